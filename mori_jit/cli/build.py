"""The verbs that render, key, describe and build kernels: ``render``, ``key``, ``describe``,
``compile``, ``precompile``."""
from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

from .common import (CliError, compile_error_line, ensure_headers, fmt_s, parse_sets, spec_cfg,
                     toolchain_and_origin, warn_stale_headers)

__all__ = ["cmd_render", "cmd_key", "cmd_describe", "cmd_compile", "cmd_precompile", "precompile_targets"]


def cmd_render(args) -> int:
    """`mori-jit render SPEC`: print the translation unit a config renders to (no compiler needed)."""
    spec, tc, cfg = spec_cfg(args, need_compiler=False)
    sys.stdout.write(spec.render_source(cfg, tc))
    return 0


def cmd_key(args) -> int:
    """`mori-jit key SPEC`: print the cache key of a config (the rendered text, toolchain and headers)."""
    from ..jit.compile import resolve
    spec, tc, cfg = spec_cfg(args)
    warn_stale_headers()
    print(resolve(spec, cfg, tc, fresh_include_hash=True).key)
    return 0


def cmd_describe(args) -> int:
    """`mori-jit describe SPEC`: the config, entry name, geometry and request schema, as JSON."""
    from ..jit.fields import render_cfg, request_schema
    spec, tc, cfg = spec_cfg(args, need_compiler=False)
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
    from ..jit.compile import build, resolve
    spec, tc, cfg = spec_cfg(args)
    ensure_headers()
    entry = build(spec, cfg, tc, resolved=resolve(spec, cfg, tc, fresh_include_hash=True))
    print(entry.path)
    return 0



def precompile_targets(toolchain, ep_request: dict[str, str] | None = None) -> list[tuple[Any, Any]]:
    """Every ``(spec, cfg)`` that ``mori-jit precompile`` builds for ``toolchain``.

    Without ``ep_request``: what each registered spec's :meth:`~mori_jit.jit.spec.Spec.precompile_cfgs`
    names. With it (``--ep KEY=VALUE ...``: EpDispatchCombineConfig fields plus ``num_cus``): exactly
    the EP variants a live ``hip`` op with that config compiles — the same tuning tables and Cfg
    construction (:func:`mori_jit.ops.ep.backends.hip.variants.plan_requests`). Duplicates are removed by the caller.
    """
    from ..jit.registry import all_specs
    if ep_request:  # exactly the variants a live op with that config compiles
        from ..ops.ep.backends.hip.variants import precompile_targets as ep_targets
        return ep_targets(ep_request, toolchain.arch)
    return [(spec, cfg) for spec in all_specs() for cfg in spec.precompile_cfgs(toolchain)]


def _skip_reason(spec, toolchain) -> str:
    """Why ``spec`` names no kernel for ``precompile`` on ``toolchain``: a device library that
    cannot be linked there or is missing, else that its configs come from an op's."""
    from ..jit.devlib import DeviceLibraryError
    for lib in spec.device_libraries:
        if toolchain.vendor != "nvidia":
            return f"they link {lib.name}, and device linking is built for NVIDIA arches only"
        try:
            lib.locate()
        except DeviceLibraryError as e:
            return f"they link {lib.name}, which is missing: {e}"
    return "they have no default config: an op builds them for its own (--ep KEY=VALUE ...)"


def _what_and_why(toolchain, arch_origin: str, targets, ep_request) -> list[str]:
    """The lines under precompile's first one: where the arch came from, what is built, and each
    shipped spec that builds nothing here, with the reason."""
    from ..jit.registry import all_specs
    out = [f"  arch {toolchain.arch}: from {arch_origin}" + ("" if arch_origin == "--arch" else
                                                            " (--arch chooses another)")]
    if ep_request:
        return out + ["  kernels: every variant a live 'hip' EP op with the --ep config compiles"]
    per_spec = {s.name: 0 for s in all_specs()}
    for spec, _ in targets:
        per_spec[spec.name] += 1
    counts = ", ".join(f"{name} {k}" for name, k in per_spec.items() if k)
    out.append(f"  kernels: the configs each shipped spec names for precompiling, so that their first use loads "
               f"them from the cache instead of compiling ({counts}); --ep KEY=VALUE ... builds the variants of "
               f"one EP op config instead")
    skipped: dict[str, list[str]] = {}
    for spec in all_specs():
        if not per_spec[spec.name]:
            skipped.setdefault(_skip_reason(spec, toolchain), []).append(spec.name)
    return out + [f"  skipped {', '.join(names)}: {why}" for why, names in skipped.items()]


def cmd_precompile(args) -> int:
    """`mori-jit precompile`: build every shipped variant for an arch in parallel, with progress.

    An interrupt (Ctrl-C, SIGTERM, SIGHUP) stops it: no kernel starts, the running compiles are
    killed, and the summary line still says what was built, stopped and never started."""
    from ..jit import cache
    from ..jit.compile import CompileError
    from ..jit.precompile import build_all, resolve_targets
    tc, arch_origin = toolchain_and_origin(args.arch, from_compiler=True)
    ensure_headers()
    ep_request = parse_sets(args.ep)
    targets = precompile_targets(tc, ep_request)
    todo = resolve_targets(targets, tc)
    n = len(todo)
    print(f"precompiling {n} kernels for {tc.arch} with {tc.compiler} into {cache.cache_root()}", flush=True)
    print("\n".join(_what_and_why(tc, arch_origin, targets, ep_request)), flush=True)
    width = max((len(r.entry_name) for _, _, r in todo), default=0)
    t_all = time.perf_counter()
    counts = {"compiled": 0, "hit": 0, "FAILED": 0, "stopped": 0}
    failed = []

    def report(done) -> None:
        counts[done.status] += 1
        line = f"[{sum(counts.values()):>{len(str(n))}}/{n}] {done.entry_name:<{width}}  {done.status:<8} " \
               f"{fmt_s(done.seconds)}"
        if done.error is not None:
            line += f"  {compile_error_line(done.error) if isinstance(done.error, CompileError) else done.error}"
            failed.append(done.entry_name)
        print(line, flush=True)

    def summary(stopped: bool) -> str:
        text = (f"{'stopped after' if stopped else 'done in'} {time.perf_counter() - t_all:.1f}s: "
                f"{counts['compiled']} compiled, {counts['hit']} hit, {counts['FAILED']} failed")
        return text + (f", {counts['stopped']} stopped, {n - sum(counts.values())} not started" if stopped else "")

    try:
        build_all(todo, tc, args.jobs, report)
    except BaseException:  # (stopped: the summary still says what was done, unless stdout is what broke)
        with contextlib.suppress(OSError):
            print(summary(stopped=True), flush=True)
        raise
    print(summary(stopped=False), flush=True)
    if failed:
        raise CliError(f"{len(failed)} of {n} kernels failed to build: {', '.join(failed)}")
    return 0
