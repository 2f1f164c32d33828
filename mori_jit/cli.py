"""``mori-jit``: inspect, build and manage the JIT cache from the shell.

Verbs (``mori-jit <verb> --help`` for each)::

    mori-jit info [--arch A]                      arch, compiler + signature, engines, source root, cache, env
    mori-jit render SPEC [--arch A] [--set k=v ...]   the translation unit
    mori-jit key SPEC [--arch A] [--set k=v ...]      the hex cache key
    mori-jit describe SPEC [--arch A] [--set k=v ...] JSON: spec, entry, cfg fields, schema
    mori-jit compile SPEC [--arch A] [--set k=v ...]  build (or hit); prints the entry directory
    mori-jit precompile [--arch A] [-j N]          everything the shipped specs need
    mori-jit cache path|ls|verify|clear

``--arch`` builds a toolchain for that arch (:func:`~mori_jit.jit.toolchain.make_toolchain`, no
process-wide state); without it the arch is ``MORI_JIT_ARCH``, else the current device, and for
``precompile`` on a machine without a GPU the installed compiler's (nvcc: sm_90a, hipcc: gfx90a). ``--set``
values go through ``spec.make_cfg(toolchain, request)`` (numeric strings and enum names are coerced
there). Bad input exits non-zero with one ``mori-jit: error: ...`` line on stderr and no traceback
(``MORI_JIT_VERBOSE=2`` shows it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
import warnings
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

def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text, 0)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _parse_sets(items: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise CliError(f"--set expects FIELD=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _resolve_arch(arch: str | None, *, from_compiler: bool = False) -> tuple[str | None, str]:
    """(arch, where it came from) or (None, why none is resolvable).

    The order is ``--arch``, ``MORI_JIT_ARCH``, the current device, and with ``from_compiler`` the
    default arch of the installed compiler (``precompile`` on a build machine without a GPU).
    """
    from .jit import knobs, toolchain
    from .jit.toolchain import ToolchainError, compiler_default_arch, detect_arch
    if arch:
        return arch, "--arch"
    env = knobs.compiler.arch
    if env:
        return env, "MORI_JIT_ARCH"
    try:
        return detect_arch(), "current device"
    except ToolchainError as e:
        no_device = str(e).rstrip(".")
    if not from_compiler:
        return None, no_device
    try:
        found, compiler = compiler_default_arch()
    except ToolchainError as e:
        return None, f"{no_device}; {e}"
    return found, f"the {toolchain.COMPILER_NAME[toolchain.vendor_of(found)]} at {compiler}, as no GPU is visible"


def _arch_or_error(arch: str | None, *, from_compiler: bool = False) -> str:
    resolved, why = _resolve_arch(arch, from_compiler=from_compiler)
    if resolved is None:
        raise CliError(f"no arch: {why.rstrip('.')}; or pass --arch (e.g. --arch gfx90a, --arch sm_90a)")
    return resolved


def _toolchain(arch: str | None, *, need_compiler: bool = True, from_compiler: bool = False):
    """The toolchain for ``--arch`` / MORI_JIT_ARCH / the device (/ the installed compiler).

    Rendering never runs the compiler, so ``render``/``describe`` work without one
    (``need_compiler=False`` gives a toolchain with an empty compiler and signature).
    """
    from .jit.toolchain import make_toolchain
    return make_toolchain(_arch_or_error(arch, from_compiler=from_compiler), need_compiler=need_compiler)


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
    return (f"{e.step} {e.spec} failed (exit {e.returncode}): {pick} "
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


def _compilers_lines() -> list[str]:
    """One line per vendor: the compiler found, or that it is missing and how to get it."""
    from .jit import toolchain as tcmod
    out = []
    for vendor, tool in tcmod.COMPILER_NAME.items():
        try:
            found = tcmod.find_compiler(vendor)
        except tcmod.ToolchainError as e:
            found = f"(missing: {e})"
        out.append(f"{tool + ':':<12} {found}")
    return out


def _engines_lines() -> list[str]:
    """One line per device library (NVSHMEM, and any other a spec links): the install found (path,
    version, where from), or why none is found and how to get it."""
    from .jit.devlib import DeviceLibraryError
    from .jit.nvshmem import NVSHMEM
    from .jit.registry import all_specs
    libs = {NVSHMEM.name: NVSHMEM}
    for spec in all_specs():
        for lib in spec.device_libraries:
            libs.setdefault(lib.name, lib)
    out = []
    for name, lib in libs.items():
        try:
            found = lib.locate()
        except DeviceLibraryError as e:
            out.append(f"{name + ':':<12} (not found: {e})")
        else:
            out.append(f"{name + ':':<12} {found.home} (version {found.version}, from {found.origin})")
    return out


def cmd_info(args) -> int:
    """`mori-jit info`: version, arch, compiler and flags, device libraries, source root, header
    freshness, cache, specs, and the environment variables mori-jit reads."""
    from .jit import cache, toolchain as tcmod
    from .jit.codegen import stale_headers
    from .jit.paths import SourceRootError, kernels_dir
    from .jit.registry import all_specs

    out = []
    arch, why = _resolve_arch(args.arch)
    out.append(f"mori-jit {_version()} (python {sys.version.split()[0]})")
    if arch is None:
        out.append(f"arch:        (none resolvable: {why.rstrip('.')}; or pass --arch)")
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
    out += _compilers_lines()
    out += _engines_lines()
    if arch is None:
        pre, pre_why = _resolve_arch(None, from_compiler=True)
        out.append(f"precompile:  builds for {pre} (from {pre_why})" if pre else "precompile:  has no compiler to use")
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
    tc = _toolchain(args.arch, from_compiler=True)
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

def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def _left_lines(removal, root: Path) -> list[str]:
    return [f"left     {_rel(p, root)}: {why}" for p, why in removal.left]


def _builds_note() -> str:
    from .jit import cache_admin
    total, stale = cache_admin.build_dir_counts()
    if not total:
        return ""
    return f"; {total} build dirs in tmp/ ({stale} left by killed compiles, which the next compile removes)"


def cmd_cache(args) -> int:
    """`mori-jit cache path|ls|verify|clear`: inspect or clean the kernel cache (:mod:`mori_jit.jit.cache_admin`)."""
    from .jit import cache, cache_admin
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
        if removal.left:
            raise CliError(f"{len(removal.left)} corrupt entries could not be removed (listed above)")
        return 0
    if args.action == "clear":
        removal = cache_admin.clear()
        for line in _left_lines(removal, root):
            print(line)
        done = ", ".join(f"{n} {kind}" for kind, n in removal.removed.items()) or "nothing"
        note = f"; left {len(removal.left)} items (listed above)" if removal.left else ""
        print(f"removed {done} from {root}{note}")
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
    sp.add_argument("--arch", help="target arch (gfx90a, gfx942, sm_90a, ...); default: MORI_JIT_ARCH, else the "
                                   "current device, else the installed compiler's (nvcc: sm_90a, hipcc: gfx90a)")
    sp.add_argument("-j", "--jobs", type=_positive_int, default=None, help="parallel compiles (default: CPU count)")
    sp.add_argument("--ep", action="extend", nargs="+", metavar="KEY=VALUE", default=[],
                    help="EP op configuration to precompile variants for (see precompile_targets)")
    sp.set_defaults(fn=cmd_precompile)

    sp = sub.add_parser("cache", help="manage the cache: path | ls | verify | clear")
    sp.add_argument("action", choices=["path", "ls", "verify", "clear"])
    sp.add_argument("--remove", action="store_true", help="verify: delete corrupt entries")
    sp.set_defaults(fn=cmd_cache)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 error, 2 bad usage, 130 interrupted).

    Python warnings raised while a command runs (torch warns at import when e.g. numpy is missing)
    are held back: after success they are printed as ``mori-jit: warning:`` lines, after an error
    only with ``MORI_JIT_VERBOSE`` >= 1, so an error stays one line.
    """
    with warnings.catch_warnings(record=True) as caught:
        status, error = _run(argv)
    if error is None or _verbose() >= 1:
        for line in dict.fromkeys(" ".join(str(w.message).split()) for w in caught):
            print(f"{PROG}: warning: {line}", file=sys.stderr)
    if error is not None:
        print(error, file=sys.stderr)
    return status


def _verbose() -> int:
    try:
        from .jit import knobs
        return knobs.log.verbose
    except Exception:  # pragma: no cover - a malformed variable must not hide the real error
        return 0


def _run(argv: Sequence[str] | None) -> tuple[int, str | None]:
    """Parse and run one command: (exit status, the one error line or None)."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        return args.fn(args), None
    except SystemExit as e:  # --help
        return (e.code if isinstance(e.code, int) else (0 if e.code is None else 1)), None
    except KeyboardInterrupt:
        return 130, f"{PROG}: interrupted"
    except BaseException as e:  # noqa: BLE001 - the one place errors become exit codes
        verbose = _verbose()
        if verbose >= 2:
            traceback.print_exc()
        elif verbose >= 1 and not isinstance(e, CliError):
            print(str(e), file=sys.stderr)
        return (2 if isinstance(e, UsageError) else 1), f"{PROG}: error: {_error_line(e)}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
