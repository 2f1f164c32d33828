"""``mori-jit info``: what this machine has (arch, compilers or how to get them), the source root,
the cache, the specs, and every setting from its declaration."""
from __future__ import annotations

import os
import sys

from .common import package_version, resolve_arch

__all__ = ["cmd_info"]


def _settings_lines() -> list[str]:
    """The environment section of ``info``: what is set, what is not recognised, and every setting
    (group, variable, type, default, doc) from its declaration (:func:`mori_jit.jit.knobs.all_groups`)."""
    from ..jit import knobs
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
    from ..jit import paths
    try:
        root = paths.source_root()
    except paths.SourceRootError as e:
        return f"(error: {e})"
    return f"{root} ({paths.source_root_origin(root)})"


def _compilers_lines() -> list[str]:
    """One line per vendor: the compiler found, or that it is missing and how to get it."""
    from ..jit import toolchain as tcmod
    out = []
    for vendor, tool in tcmod.COMPILER_NAME.items():
        try:
            found = tcmod.find_compiler(vendor)
        except tcmod.ToolchainError as e:
            found = f"(missing: {e})"
        out.append(f"{tool + ':':<12} {found}")
    return out


def _launch_lines() -> list[str]:
    """Whether kernels can be launched here: the GPU torch sees (or why none), and each vendor's
    launch bindings, installed or how to install them."""
    from ..jit.runtime.support import BINDINGS, bindings_version, gpu_problem
    problem = gpu_problem()
    if problem is None:
        import torch
        gpu = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, {torch.cuda.device_count()} visible)"
    else:
        gpu = f"none usable: {problem}"
    found = {v: bindings_version(v) for v in BINDINGS}
    bindings = "; ".join(f"{b.distribution} {found[v]} ({v})" if found[v] else
                         f"{b.distribution} not installed ({v}: {b.install()})" for v, b in BINDINGS.items())
    return [f"{'gpu:':<12} {gpu}", f"{'bindings:':<12} {bindings}"]


def _engines_lines() -> list[str]:
    """One line per device library (NVSHMEM, and any other a spec links): the install found (path,
    version, where from), or why none is found and how to get it."""
    from ..jit.devlib import DeviceLibraryError
    from ..jit.nvshmem import NVSHMEM
    from ..jit.registry import all_specs
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
    """`mori-jit info`: version, arch, compiler and flags, the GPU and launch bindings, device
    libraries, source root, header freshness, cache, specs, and the environment variables mori-jit
    reads, each with its default's value here."""
    from ..jit import cache, toolchain as tcmod
    from ..jit.codegen import stale_headers
    from ..jit.paths import SourceRootError, kernels_dir
    from ..jit.registry import all_specs

    out = []
    arch, why = resolve_arch(args.arch)
    out.append(f"mori-jit {package_version()} (python {sys.version.split()[0]})")
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
    out += _launch_lines()
    out += _engines_lines()
    if arch is None:
        pre, pre_why = resolve_arch(None, from_compiler=True)
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


