"""``mori-jit cache path|ls|verify|clear``: prints what :mod:`mori_jit.jit.cache_admin` finds and does."""
from __future__ import annotations

from pathlib import Path

from .common import CliError

__all__ = ["cmd_cache"]


def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def _left_lines(removal, root: Path) -> list[str]:
    return [f"left     {_rel(p, root)}: {why}" for p, why in removal.left + removal.failed]


def _check_removed(removal) -> None:
    """A removal that failed is an error (``clear`` and ``verify --remove`` alike)."""
    if removal.failed:
        raise CliError(f"{len(removal.failed)} items could not be removed (listed above)")


def _builds_note() -> str:
    from ..jit import cache_admin
    total, stale = cache_admin.build_dir_counts()
    if not total:
        return ""
    return f"; {total} build dirs in tmp/ ({stale} left by killed compiles, which the next compile removes)"


def cmd_cache(args) -> int:
    """`mori-jit cache path|ls|verify|clear`: inspect or clean the kernel cache (:mod:`mori_jit.jit.cache_admin`)."""
    from ..jit import cache, cache_admin
    root = cache.cache_root()
    if args.action == "path":
        print(root)
        return 0
    if args.action == "ls":
        infos = cache_admin.scan()
        for i in infos:
            what = f"{i.spec:<14} {i.size:>10} B" if i.problem is None else f"{'?':<14} {'(corrupt)':>12}"
            print(f"{what}  {_rel(i.path, root)}")
        total = sum(i.size for i in infos if i.size is not None)
        bad = sum(i.problem is not None for i in infos)
        print(f"{len(infos)} entries{f' ({bad} corrupt)' if bad else ''}, {total / 2**20:.2f} MiB in {root}"
              f"{_builds_note()}")
        return 0
    if args.action == "verify":
        infos, removal = cache_admin.verify(remove=args.remove)
        bad = [i for i in infos if i.problem is not None]
        for i in bad:
            print(f"corrupt  {_rel(i.path, root)}: {i.problem}")
        for line in _left_lines(removal, root):
            print(line)
        removed = removal.removed.get("entries", 0)
        print(f"verified {len(infos)} entries in {root}: {len(infos) - len(bad)} ok, {len(bad)} corrupt"
              f"{f' ({removed} removed)' if args.remove else ''}{_builds_note()}")
        if bad and not args.remove:
            raise CliError(f"{len(bad)} corrupt cache entries (they are rebuilt on next use; "
                           f"'mori-jit cache verify --remove' deletes them)")
        _check_removed(removal)
        if removal.left:
            raise CliError(f"{len(removal.left)} corrupt entries could not be removed (listed above)")
        return 0
    if args.action == "clear":
        removal = cache_admin.clear()
        for line in _left_lines(removal, root):
            print(line)
        done = ", ".join(f"{n} {kind}" for kind, n in removal.removed.items()) or "nothing"
        kept = len(removal.left) + len(removal.failed)
        note = f"; left {kept} items (listed above)" if kept else ""
        print(f"removed {done} from {root}{note}")
        _check_removed(removal)
        return 0
    raise CliError(f"unknown cache action {args.action!r}")  # pragma: no cover - argparse checks choices


