"""The whole cache at once: what ``mori-jit cache ls|verify|clear`` do (the CLI only prints).

Nothing is removed unless it is provably the cache's (:func:`~mori_jit.jit.cache_layout.classify`):
an entry-shaped directory holding only entry file names, and, under a root marked as mori-jit's, the
cache's bookkeeping (build dirs no process holds, lock files, kept failed sources, legacy template
bytecode). Everything else is left where it is and reported, with the reason; so is what could
not be removed (:attr:`Removal.failed`), which the CLI turns into a non-zero exit.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from . import cache, cache_builds, cache_fs
from .cache_layout import CacheUnsafeError, classify, is_marked

__all__ = ["EntryInfo", "Removal", "scan", "build_dir_counts", "verify", "clear"]

#: ``cache clear`` leaves a build dir younger than this even without a flock (the instant between
#: its mkdir and its flock).
_CLEAR_MIN_AGE_S = 5.0


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """One entry-shaped directory: its spec and binary size when whole, else why not (``problem``)."""

    path: Path
    spec: str | None = None
    size: int | None = None
    problem: str | None = None


@dataclasses.dataclass
class Removal:
    """What a removal did: ``removed`` counts by kind; ``left`` is ``(path, why)`` of what stayed on
    purpose (not the cache's, in use); ``failed`` is ``(path, why)`` of what could not be removed."""

    removed: dict[str, int] = dataclasses.field(default_factory=dict)
    left: list[tuple[Path, str]] = dataclasses.field(default_factory=list)
    failed: list[tuple[Path, str]] = dataclasses.field(default_factory=list)

    def count(self, kind: str) -> None:
        """Count one removed item of ``kind``."""
        self.removed[kind] = self.removed.get(kind, 0) + 1


def scan() -> list[EntryInfo]:
    """Every entry-shaped directory, read as the loader reads it."""
    out = []
    for p in cache.list_entries():
        try:
            e = cache.read_entry(p)
        except (cache.CorruptEntry, CacheUnsafeError) as err:
            out.append(EntryInfo(p, problem=str(err)))
            continue
        if e is None:  # removed meanwhile
            continue
        out.append(EntryInfo(p, e.meta["spec"], e.binary.stat().st_size))
    return out


def build_dir_counts() -> tuple[int, int]:
    """(build dirs in ``tmp/``, how many of them are stale: the next compile removes those)."""
    states = cache_builds.build_dir_states()
    return len(states), sum(state == "stale" for state in states.values())


def _remove_at(root_fd: int, root: Path, p: Path) -> None:
    """Remove ``p`` (a path below ``root``, one or two levels) through the held root: its directory
    is opened without following a link and ``p`` removed relative to it (:func:`cache_fs.remove_at`)."""
    rel = p.relative_to(root).parts
    if len(rel) == 1:
        cache_fs.remove_at(root_fd, rel[0])
        return
    with cache_fs.open_dir_at(root_fd, rel[0], root / rel[0]) as dfd:
        cache_fs.remove_at(dfd, rel[1])


def _remove_entry(root_fd: int, root: Path, p: Path, marked: bool) -> None:
    if marked:  # through tmp/: never a half-deleted entry in place
        cache_builds.discard(p)
    else:
        _remove_at(root_fd, root, p)


def _try(out: Removal, kind: str, p: Path, fn) -> None:
    try:
        fn()
    except FileNotFoundError:  # gone meanwhile (another clear, or a compile replacing it): not ours to count
        pass
    except OSError as e:
        out.failed.append((p, f"cannot remove it: {e.strerror or e}"))
    else:
        out.count(kind)


def verify(remove: bool = False) -> tuple[list[EntryInfo], Removal]:
    """Every entry, checked; with ``remove``, the corrupt ones that are provably entries are removed."""
    infos = scan()
    out = Removal()
    bad = [i.path for i in infos if i.problem is not None]
    if remove and bad:
        root = cache.cache_root()
        contents, marked = classify(root), is_marked(root)
        removable, foreign = set(contents.entries), dict(contents.foreign)
        with cache_fs.open_dir(root, follow=True) as rfd:
            for p in bad:
                if p in removable:
                    _try(out, "entries", p, lambda p=p: _remove_entry(rfd, root, p, marked))
                else:
                    out.left.append((p, foreign.get(p, "not made by mori-jit")))
    return infos, out


def clear() -> Removal:
    """Remove every entry and (under a marked root) the cache's bookkeeping; leave the rest. Every
    removal goes through directory handles that refuse links (:mod:`~mori_jit.jit.cache_fs`): a
    directory swapped for a link after it was classified is unlinked or refused, never followed."""
    root = cache.cache_root()
    out = Removal()
    if not root.exists():
        return out
    with cache_fs.open_dir(root, follow=True) as rfd:  # (checked: see cache_layout.check_stat)
        contents, marked = classify(root), is_marked(root)
        out.left += contents.foreign
        for p in contents.entries:
            _try(out, "entries", p, lambda p=p: _remove_entry(rfd, root, p, marked))
        if marked:
            states = cache_builds.build_dir_states(min_age_s=_CLEAR_MIN_AGE_S)
            for d in contents.builds:
                if states.get(d.name, "active") == "active":
                    out.left.append((d, "a build in progress"))
                else:
                    _try(out, "build dirs", d, lambda d=d: _remove_at(rfd, root, d))
            for p in contents.bookkeeping:
                _try(out, "bookkeeping files", p, lambda p=p: _remove_at(rfd, root, p))
        else:
            out.left += [(p, "not in a root marked as mori-jit's cache")
                         for p in contents.builds + contents.bookkeeping]
        # containers are removed once emptied; under an unmarked root only the arch dirs entries left
        for d in contents.containers if marked else {p.parent for p in contents.entries}:
            try:
                os.rmdir(d.name, dir_fd=rfd)  # only if emptied
            except OSError:
                pass
    return out
