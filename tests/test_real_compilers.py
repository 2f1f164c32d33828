"""Real compilers: Debian's hipcc (gfx90a, gfx940) and nvcc (sm_90a) build example_axpy for every dtype
(and nvcc the push probe, scripts/probes/probe_push_modes.cu).

The entry symbol named by ``spec.entry_name(cfg)`` must be a FUNC in the binary's ELF symbol table:
the cubin is read directly; the hipcc ``--genco`` output (a clang offload bundle with Debian's HIP
5.2) is unbundled with ``clang-offload-bundler`` when it is installed (else by parsing the bundle
format here), and the gfx code object's ELF header must say AMDGPU. Skipped only when the compiler
binary is absent.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import types
from pathlib import Path

import pytest

from jit_helpers import (BUNDLE_MAGIC, EM_AMDGPU, EM_CUDA, STT_FUNC, elf_header, elf_symbols, nvcc_ptx,
                         toolchain_or_skip, unbundle)
from mori_jit.examples.axpy_spec import AXPY, AxpyDType, AxpyElemBytes
from mori_jit.jit import cache
from mori_jit.jit.compile import build

# EF_AMDGPU_MACH_* values (llvm/BinaryFormat/ELF.h)
AMDGPU_MACH = {"gfx90a": 0x3F, "gfx940": 0x40}


def _bundler() -> str | None:
    cands = [shutil.which("clang-offload-bundler"), *sorted(glob.glob("/usr/lib/llvm-*/bin/clang-offload-bundler")),
             "/opt/rocm/llvm/bin/clang-offload-bundler"]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def _axpy_cfg(tc, dtype):
    elem = AxpyElemBytes(types.SimpleNamespace(dtype=dtype))
    return AXPY.make_cfg(tc, {"dtype": dtype, "vecElems": 16 // elem})


@pytest.mark.parametrize("dtype", list(AxpyDType), ids=lambda d: d.name)
def test_nvcc_builds_axpy(dtype):
    tc = toolchain_or_skip("sm_90a")
    cfg = _axpy_cfg(tc, dtype)
    entry = build(AXPY, cfg, tc)
    data = entry.binary.read_bytes()
    assert elf_header(data)["machine"] == EM_CUDA
    syms = elf_symbols(data)
    name = AXPY.entry_name(cfg)
    assert syms.get(name) == STT_FUNC, f"{name} not a function in the cubin: {sorted(syms)[:20]}"
    assert cache.verify_entry(entry.path) is not None


@pytest.mark.parametrize("arch", ["gfx90a", "gfx940"])
@pytest.mark.parametrize("dtype", list(AxpyDType), ids=lambda d: d.name)
def test_hipcc_builds_axpy(arch, dtype, tmp_path):
    tc = toolchain_or_skip(arch)
    cfg = _axpy_cfg(tc, dtype)
    entry = build(AXPY, cfg, tc)
    data = entry.binary.read_bytes()
    target = f"hipv4-amdgcn-amd-amdhsa--{arch}"
    if data.startswith(BUNDLE_MAGIC):
        code = unbundle(data, target)
        bundler = _bundler()
        if bundler is not None:
            out = tmp_path / "kernel.co"
            p = subprocess.run([bundler, "--type=o", f"--targets={target}", "--unbundle",
                                f"--input={entry.binary}", f"--output={out}"], capture_output=True, text=True,
                               timeout=120)
            assert p.returncode == 0, p.stderr
            assert out.read_bytes() == code  # our reading of the bundle agrees with the tool's
    else:
        code = data  # a plain code object (newer ROCm)
    hdr = elf_header(code)
    assert hdr["machine"] == EM_AMDGPU and hdr["flags"] & 0xFF == AMDGPU_MACH[arch]
    syms = elf_symbols(code)
    name = AXPY.entry_name(cfg)
    assert syms.get(name) == STT_FUNC, f"{name} not a function in the code object: {sorted(syms)[:20]}"
    assert f"{name}.kd" in syms  # the kernel descriptor hipModuleGetFunction looks up


def test_nvcc_builds_the_push_probe(tmp_path):
    """scripts/probes/probe_push_modes.cu (a standalone CUDA probe) still builds, its bulk-copy kernel
    really uses the bulk-copy unit (its `tma` rows) and its task kernels the store each `task` row
    names (docs/performance.md, "Store cache operators")."""
    tc = toolchain_or_skip("sm_90a")
    src = Path(__file__).resolve().parents[1] / "scripts" / "probes" / "probe_push_modes.cu"
    text = nvcc_ptx(tc, src, tmp_path / "probe.ptx")
    assert "cp.async.bulk.global.shared::cta.bulk_group" in text and "cp.async.bulk.shared::cluster.global" in text
    assert "st.global.v4" in text  # the 16-byte stores of the st128 rows
    # the task rows' store variants and the fenced variant's release
    for store in ("st.global.cs.v4", "st.global.wt.v4", "st.global.L1::no_allocate.v4", "st.relaxed.sys.global.v4",
                  "st.release.sys.global.u64"):
        assert store in text, store
