"""``mori-jit``: inspect, build and manage the JIT cache from the shell.

Verbs (``mori-jit <verb> --help`` for each)::

    mori-jit info [--arch A]                      arch, compiler + signature, source root, cache, env
    mori-jit render SPEC [--arch A] [--set k=v ...]   the translation unit
    mori-jit key SPEC [--arch A] [--set k=v ...]      the hex cache key
    mori-jit describe SPEC [--arch A] [--set k=v ...] JSON: spec, entry, cfg fields, schema
    mori-jit compile SPEC [--arch A] [--set k=v ...]  build (or hit); prints the entry directory
    mori-jit precompile [--arch A] [-j N]          everything the shipped specs need
    mori-jit cache path|ls|verify|clear

``--arch`` builds a toolchain for that arch (:func:`~mori_jit.jit.toolchain.make_toolchain`, no
process-wide state); without it the arch is ``MORI_JIT_ARCH``, else the current device. ``--set``
values go through ``spec.make_cfg(toolchain, request)`` (numeric strings and enum names are coerced
there). Bad input exits non-zero with one ``mori-jit: error: ...`` line on stderr and no traceback
(``MORI_JIT_VERBOSE=2`` shows it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "precompile_targets", "CliError", "UsageError"]

PROG = "mori-jit"


class CliError(Exception):
    """A user-facing error: printed as one ``mori-jit: error: ...`` line."""


class UsageError(CliError):
    """Bad command-line syntax (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _parse_sets(items: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise CliError(f"--set expects FIELD=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _resolve_arch(arch: str | None) -> tuple[str | None, str]:
    """(arch, where it came from) or (None, why none is resolvable)."""
    from .jit import knobs
    from .jit.toolchain import ToolchainError, detect_arch
    if arch:
        return arch, "--arch"
    env = knobs.compiler.arch
    if env:
        return env, "MORI_JIT_ARCH"
    try:
        return detect_arch(), "current device"
    except ToolchainError as e:
        return None, str(e)


def _arch_or_error(arch: str | None) -> str:
    resolved, why = _resolve_arch(arch)
    if resolved is None:
        raise CliError(f"no arch: {why.rstrip('.')}; or pass --arch (e.g. --arch gfx90a, --arch sm_90a)")
    return resolved


def _toolchain(arch: str | None, *, need_compiler: bool = True):
    """The toolchain for ``--arch`` / MORI_JIT_ARCH / the device.

    Rendering never runs the compiler, so ``render``/``describe`` work without one
    (``need_compiler=False`` gives a toolchain with an empty compiler and signature).
    """
    from .jit.toolchain import make_toolchain
    return make_toolchain(_arch_or_error(arch), need_compiler=need_compiler)


def _spec(name: str):
    from .jit.registry import get_spec
    try:
        return get_spec(name)
    except KeyError as e:
        raise CliError(e.args[0]) from None


def _spec_cfg(args, *, need_compiler: bool = True):
    spec = _spec(args.spec)
    tc = _toolchain(args.arch, need_compiler=need_compiler)
    cfg = spec.make_cfg(tc, _parse_sets(args.set))
    return spec, tc, cfg


def _ensure_headers() -> None:
    """Regenerate stale generated headers before compiling (they are part of what is compiled)."""
    from .jit.codegen import stale_headers, write_headers
    from .jit.paths import kernels_dir
    kd = kernels_dir()
    stale = stale_headers(kd)
    if not stale:
        return
    try:
        written = write_headers(kd)
    except OSError as e:
        raise CliError(f"generated headers {', '.join(stale)} in {kd} are stale and cannot be rewritten: "
                       f"{e.strerror or e}") from None
    print(f"{PROG}: regenerated {', '.join(written)} in {kd}", file=sys.stderr)


def _warn_stale_headers() -> None:
    from .jit.codegen import stale_headers
    from .jit.paths import kernels_dir
    stale = stale_headers(kernels_dir())
    if stale:
        print(f"{PROG}: warning: generated headers {', '.join(stale)} are stale; 'mori-jit compile' "
              f"regenerates them, which changes this key", file=sys.stderr)


def _fmt_s(s: float) -> str:
    return f"{s:6.2f}s"


def _compile_error_line(e) -> str:
    lines = [ln.strip() for ln in (e.stderr or "").splitlines() if ln.strip()]
    pick = next((ln for ln in lines if re.search(r"\berror\b", ln, re.I)), lines[-1] if lines else "(no output)")
    kept = f"source kept at {e.source_path}" if e.source_path else "MORI_JIT_KEEP_FAILED=1 keeps the source"
    return (f"compiling {e.spec} failed (exit {e.returncode}): {pick} "
            f"[{kept}; MORI_JIT_VERBOSE=1 prints the command and the full output]")


def _error_line(e: BaseException) -> str:
    from .jit.compile import CompileError
    if isinstance(e, CompileError):
        return _compile_error_line(e)
    if isinstance(e, KeyError) and e.args:
        msg = str(e.args[0])
    else:
        msg = str(e) or type(e).__name__
    from .jit.fields import ConfigError
    from .jit.paths import SourceRootError
    from .jit.toolchain import ToolchainError
    known = (CliError, ConfigError, ToolchainError, SourceRootError, OSError, ValueError)
    if not isinstance(e, known):
        msg = f"{type(e).__name__}: {msg} (MORI_JIT_VERBOSE=2 shows the traceback)"
    return "; ".join(ln.strip() for ln in msg.splitlines() if ln.strip())


# ----------------------------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------------------------

def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("mori-jit")
    except (ImportError, PackageNotFoundError):
        return "(not installed)"


def _settings_lines() -> list[str]:
    """The environment section of ``info``: what is set, what is not recognised, and every setting
    (group, variable, type, default, doc) from its declaration (:func:`mori_jit.jit.knobs.all_groups`)."""
    from .jit import knobs
    groups = knobs.all_groups()
    settings = [s for g in groups for s in g.settings()]
    set_vars = {k: v for k, v in os.environ.items() if any(s.matches(k) for s in settings)}
    unknown = sorted(k for k in os.environ if k.startswith("MORI_") and k not in set_vars)
    out = ["environment:" + ("" if set_vars else " (none of mori-jit's variables is set)")]
    out += [f"    {k}={set_vars[k]}" for k in sorted(set_vars)]
    if unknown:
        out.append("unrecognised MORI_* variables (ignored): " + ", ".join(unknown))
    out.append("settings (variable, type, meaning; default):")
    width = max(len(s.label) for s in settings)
    for g in groups:
        out.append(f"  {g.name}")
        out += [f"    {s.label:<{width}}  {s.type_name:<6} {s.doc}; default: {s.default_text()}" for s in g.settings()]
    return out


def _source_root_line() -> str:
    from .jit import paths
    try:
        root = paths.source_root()
    except paths.SourceRootError as e:
        return f"(error: {e})"
    return f"{root} ({paths.source_root_origin(root)})"


def cmd_info(args) -> int:
    """`mori-jit info`: version, arch, compiler and flags, source root, header freshness, cache,
    specs, and the environment variables mori-jit reads."""
    from .jit import cache, toolchain as tcmod
    from .jit.codegen import stale_headers
    from .jit.paths import SourceRootError, kernels_dir
    from .jit.registry import all_specs

    out = []
    arch, why = _resolve_arch(args.arch)
    out.append(f"mori-jit {_version()} (python {sys.version.split()[0]})")
    if arch is None:
        out.append(f"arch:        (none resolvable: {why.rstrip('.')}; or pass --arch)")
        for vendor, tool in (("amd", "hipcc"), ("nvidia", "nvcc")):
            try:
                found = tcmod.find_compiler(vendor)
            except tcmod.ToolchainError as e:
                found = f"(not found: {e})"
            out.append(f"{tool + ':':<12} {found}")
    else:
        vendor = tcmod.vendor_of(arch)  # bad --arch is an error
        out.append(f"arch:        {arch} (from {why}; vendor {vendor}, wave size {tcmod.wave_size_for_arch(arch)})")
        try:
            tc = tcmod.make_toolchain(arch)
        except tcmod.ToolchainError as e:
            out.append(f"compiler:    (not found: {e})")
        else:
            out.append(f"compiler:    {tc.compiler}")
            out.append(f"flags:       {' '.join(tc.flags)}")
            out.append(f"nic:         {tc.nic}")
            out.append(f"output:      kernel.{tc.binary_ext}")
            out.append("signature:")
            out += [f"    {ln}" for ln in tc.signature.rstrip().splitlines()]
    out.append(f"source root: {_source_root_line()}")
    try:
        stale = stale_headers(kernels_dir())
        out.append(f"generated headers: {'stale: ' + ', '.join(stale) if stale else 'up to date'}")
    except SourceRootError:
        pass
    root = cache.cache_root()
    out.append(f"cache dir:   {root} ({len(cache.list_entries())} entries)")
    out.append(f"specs:       {', '.join(s.name for s in all_specs())}")
    out += _settings_lines()
    print("\n".join(out))
    return 0


# ----------------------------------------------------------------------------------------------
# render / key / describe / compile
# ----------------------------------------------------------------------------------------------

def cmd_render(args) -> int:
    """`mori-jit render SPEC`: print the translation unit a config renders to (no compiler needed)."""
    spec, tc, cfg = _spec_cfg(args, need_compiler=False)
    sys.stdout.write(spec.render_source(cfg, tc))
    return 0


def cmd_key(args) -> int:
    """`mori-jit key SPEC`: print the cache key of a config (the rendered text, toolchain and headers)."""
    from .jit.compile import resolve
    spec, tc, cfg = _spec_cfg(args)
    _warn_stale_headers()
    print(resolve(spec, cfg, tc, fresh_include_hash=True).key)
    return 0


def cmd_describe(args) -> int:
    """`mori-jit describe SPEC`: the config, entry name, geometry and request schema, as JSON."""
    from .jit.fields import render_cfg, request_schema
    spec, tc, cfg = _spec_cfg(args, need_compiler=False)
    doc: dict[str, Any] = {"spec": spec.name, "arch": tc.arch, "entry": spec.entry_name(cfg),
                           "cfg_type": type(cfg).__name__, "cfg": spec.describe(cfg),
                           "rendered_cfg": render_cfg(cfg)}
    g = spec.geometry(cfg)
    doc["geometry"] = {"grid": list(g.grid), "block": list(g.block), "shared_bytes": g.shared_bytes}
    doc["schema"] = request_schema(spec.cfg_type)
    print(json.dumps(doc, indent=2))
    return 0


def cmd_compile(args) -> int:
    """`mori-jit compile SPEC`: build one config into the cache (or find it there); print the entry's directory."""
    from .jit.compile import build, resolve
    spec, tc, cfg = _spec_cfg(args)
    _ensure_headers()
    entry = build(spec, cfg, tc, resolved=resolve(spec, cfg, tc, fresh_include_hash=True))
    print(entry.path)
    return 0


# ----------------------------------------------------------------------------------------------
# precompile
# ----------------------------------------------------------------------------------------------

def precompile_targets(toolchain, ep_request: dict[str, str] | None = None) -> list[tuple[Any, Any]]:
    """Every ``(spec, cfg)`` that ``mori-jit precompile`` builds for ``toolchain``.

    Without ``ep_request``: what each registered spec's :meth:`~mori_jit.jit.spec.Spec.precompile_cfgs`
    names. With it (``--ep KEY=VALUE ...``: EpDispatchCombineConfig fields plus ``num_cus``): exactly
    the EP variants a live ``hip`` op with that config compiles — the same tuning tables and Cfg
    construction (:func:`mori_jit.ops.ep.variants.plan_requests`). Duplicates are removed by the caller.
    """
    from .jit.registry import all_specs
    if ep_request:  # exactly the variants a live op with that config compiles
        from .ops.ep.variants import precompile_targets as ep_targets
        return ep_targets(ep_request, toolchain.arch)
    return [(spec, cfg) for spec in all_specs() for cfg in spec.precompile_cfgs(toolchain)]


def cmd_precompile(args) -> int:
    """`mori-jit precompile`: build every shipped variant for an arch in parallel, with progress."""
    from .jit import cache
    from .jit.compile import CompileError, build, resolve
    tc = _toolchain(args.arch)
    _ensure_headers()
    ep_request = _parse_sets(args.ep)
    seen: set = set()
    todo = []
    for spec, cfg in precompile_targets(tc, ep_request):
        if (spec.name, cfg) in seen:
            continue
        seen.add((spec.name, cfg))
        todo.append((spec, cfg, resolve(spec, cfg, tc, fresh_include_hash=True)))
    n = len(todo)
    print(f"precompiling {n} kernels for {tc.arch} with {tc.compiler} into {cache.cache_root()}", flush=True)
    width = max((len(r.entry_name) for _, _, r in todo), default=0)

    def one(item):
        spec, cfg, res = item
        t0 = time.perf_counter()
        hit = cache.verify_entry(res.path) is not None
        try:
            build(spec, cfg, tc, resolved=res)
        except CompileError as e:
            return res, "FAILED", time.perf_counter() - t0, _compile_error_line(e)
        return res, "hit" if hit else "compiled", time.perf_counter() - t0, ""

    t_all = time.perf_counter()
    counts = {"compiled": 0, "hit": 0, "FAILED": 0}
    failed = []
    jobs = max(1, args.jobs or (os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, item) for item in todo]
        for i, fut in enumerate(as_completed(futures), 1):
            res, status, secs, err = fut.result()
            counts[status] += 1
            line = f"[{i:>{len(str(n))}}/{n}] {res.entry_name:<{width}}  {status:<8} {_fmt_s(secs)}"
            if err:
                line += f"  {err}"
                failed.append(res.entry_name)
            print(line, flush=True)
    print(f"done in {time.perf_counter() - t_all:.1f}s: {counts['compiled']} compiled, {counts['hit']} hit, "
          f"{counts['FAILED']} failed", flush=True)
    if failed:
        raise CliError(f"{len(failed)} of {n} kernels failed to compile: {', '.join(failed)}")
    return 0


# ----------------------------------------------------------------------------------------------
# cache
# ----------------------------------------------------------------------------------------------

_ARCH_DIR_RE = re.compile(r"^(gfx[0-9a-f]{3,5}|sm_[0-9]{2,3}a?)_[A-Za-z0-9._-]+$")
_AUX_DIRS = ("tmp", "locks", "failed")


def _entry_problem(p: Path) -> str | None:
    """Why entry ``p`` is corrupt, or None if it is whole (what the loader checks, and a bit more)."""
    from .jit import cache
    meta_p = p / cache.META_NAME
    if not meta_p.is_file():
        return f"{cache.META_NAME} missing"
    try:
        meta = json.loads(meta_p.read_text())
    except (OSError, ValueError) as e:
        return f"{cache.META_NAME} unreadable ({e})"
    if not isinstance(meta, dict):
        return f"{cache.META_NAME} is not an object"
    for k in ("binary", "binary_sha256", "key"):
        if k not in meta:
            return f"{cache.META_NAME} lacks {k!r}"
    if not p.name.endswith("." + str(meta["key"])):
        return f"directory name does not end with the key in {cache.META_NAME}"
    binary = p / str(meta["binary"])
    if not binary.is_file():
        return f"binary {meta['binary']} missing"
    sha = cache.sha256_file(binary)
    if sha != meta["binary_sha256"]:
        return f"binary sha256 {sha[:16]}... does not match {cache.META_NAME} ({str(meta['binary_sha256'])[:16]}...)"
    if not (p / cache.SOURCE_NAME).is_file():
        return f"{cache.SOURCE_NAME} missing"
    if cache.verify_entry(p) is None:
        return "rejected by the loader"
    return None


def cmd_cache(args) -> int:
    """`mori-jit cache path|ls|verify|clear`: inspect or clean the kernel cache."""
    from .jit import cache
    root = cache.cache_root()
    if args.action == "path":
        print(root)
        return 0
    entries = cache.list_entries()
    if args.action == "ls":
        total = 0
        for p in entries:
            try:
                meta = json.loads((p / cache.META_NAME).read_text())
                size = (p / meta["binary"]).stat().st_size
                total += size
                info = f"{meta.get('spec', '?'):<14} {size:>10} B"
            except (OSError, ValueError, KeyError, TypeError):
                info = f"{'?':<14} {'(incomplete)':>12}"
            print(f"{info}  {p.relative_to(root)}")
        print(f"{len(entries)} entries, {total / 2**20:.2f} MiB in {root}")
        return 0
    if args.action == "verify":
        bad = []
        for p in entries:
            why = _entry_problem(p)
            if why is not None:
                bad.append(p)
                print(f"corrupt  {p.relative_to(root)}: {why}")
                if args.remove:
                    cache.discard(p)
        tmp = root / "tmp"
        leftovers = len(list(tmp.iterdir())) if tmp.is_dir() else 0
        extra = f"; {leftovers} leftover build dirs in tmp/ ('mori-jit cache clear' removes them)" if leftovers else ""
        print(f"verified {len(entries)} entries in {root}: {len(entries) - len(bad)} ok, {len(bad)} corrupt"
              f"{' (removed)' if bad and args.remove else ''}{extra}")
        if bad and not args.remove:
            raise CliError(f"{len(bad)} corrupt cache entries (they are rebuilt on next use; "
                           f"'mori-jit cache verify --remove' deletes them)")
        return 0
    if args.action == "clear":
        removed = 0
        kept = []
        if root.is_dir():
            for d in sorted(root.iterdir()):
                if d.is_dir() and _ARCH_DIR_RE.match(d.name):
                    removed += sum(1 for p in d.iterdir() if p.name.startswith("kernel."))
                    shutil.rmtree(d)
                elif d.is_dir() and d.name in _AUX_DIRS:
                    shutil.rmtree(d)
                else:
                    kept.append(d.name)
        note = f" (left {len(kept)} unrecognised items: {', '.join(kept)})" if kept else ""
        print(f"removed {removed} entries from {root}{note}")
        return 0
    raise CliError(f"unknown cache action {args.action!r}")  # pragma: no cover - argparse checks choices


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="mori-jit: inspect, build and cache JIT GPU kernels.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def arch_opt(sp):
        sp.add_argument("--arch", help="target arch (gfx90a, gfx942, sm_90a, ...); default: MORI_JIT_ARCH, "
                                       "else the current device")

    def spec_verb(name, help_):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("spec", help="spec name (see 'mori-jit info')")
        arch_opt(sp)
        sp.add_argument("--set", action="extend", nargs="+", metavar="FIELD=VALUE", default=[],
                        help="config field overrides (enum names and numeric strings are accepted)")
        return sp

    sp = sub.add_parser("info", help="arch, compiler, source root, cache dir and environment")
    arch_opt(sp)
    sp.set_defaults(fn=cmd_info)
    spec_verb("render", "print the translation unit").set_defaults(fn=cmd_render)
    spec_verb("key", "print the cache key").set_defaults(fn=cmd_key)
    spec_verb("describe", "print the spec, entry, config and request schema as JSON").set_defaults(fn=cmd_describe)
    spec_verb("compile", "build (or find in the cache); prints the entry directory").set_defaults(fn=cmd_compile)

    sp = sub.add_parser("precompile", help="compile everything the shipped specs need for one arch")
    arch_opt(sp)
    sp.add_argument("-j", "--jobs", type=int, default=0, help="parallel compiles (default: CPU count)")
    sp.add_argument("--ep", action="extend", nargs="+", metavar="KEY=VALUE", default=[],
                    help="EP op configuration to precompile variants for (see precompile_targets)")
    sp.set_defaults(fn=cmd_precompile)

    sp = sub.add_parser("cache", help="manage the cache: path | ls | verify | clear")
    sp.add_argument("action", choices=["path", "ls", "verify", "clear"])
    sp.add_argument("--remove", action="store_true", help="verify: delete corrupt entries")
    sp.set_defaults(fn=cmd_cache)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 error, 2 bad usage, 130 interrupted)."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        return args.fn(args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # noqa: BLE001 - the one place errors become exit codes
        verbose = 0
        try:
            from .jit import knobs
            verbose = knobs.log.verbose
        except Exception:  # pragma: no cover
            pass
        if verbose >= 2:
            traceback.print_exc()
        elif verbose >= 1 and not isinstance(e, CliError):
            print(str(e), file=sys.stderr)
        print(f"{PROG}: error: {_error_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
