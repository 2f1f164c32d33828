"""Toolchain resolution: arch override lock, MORI_JIT_ARCH conflicts, vendor routing, errors."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from mori_jit.examples.axpy_spec import AXPY
from mori_jit.jit import toolchain as tcm
from mori_jit.jit.archs import ARCH_PATTERN, KNOWN_ARCHS
from mori_jit.jit.compile import build
from mori_jit.jit.toolchain import (ToolchainError, detect_arch, get_toolchain, make_toolchain, set_arch_override,
                                    vendor_of, wave_size_for_arch)


# -- process-wide arch: override lock ---------------------------------------------------------------

def test_same_override_twice_is_fine(fake_cc):
    set_arch_override("gfx90a")
    set_arch_override("gfx90a")
    assert get_toolchain().arch == "gfx90a"
    set_arch_override("gfx90a")  # still fine after resolving


def test_conflicting_override_before_resolve_raises(fake_cc):
    set_arch_override("gfx90a")
    with pytest.raises(ToolchainError, match=r"'sm_90a' conflicts with the already overridden arch 'gfx90a'"):
        set_arch_override("sm_90a")
    assert get_toolchain().arch == "gfx90a"


def test_override_after_resolve_must_match(fake_cc, monkeypatch):
    monkeypatch.setenv("MORI_JIT_ARCH", "sm_90a")
    assert get_toolchain().arch == "sm_90a"
    set_arch_override("sm_90a")
    with pytest.raises(ToolchainError, match=r"'gfx942' conflicts with the already resolved arch 'sm_90a'"):
        set_arch_override("gfx942")
    assert get_toolchain().arch == "sm_90a"  # never "render for A, compile for B"


def test_env_arch_conflicting_with_override_raises(fake_cc, monkeypatch):
    monkeypatch.setenv("MORI_JIT_ARCH", "sm_90a")
    set_arch_override("gfx90a")
    with pytest.raises(ToolchainError, match=r"MORI_JIT_ARCH='sm_90a' conflicts with the arch override 'gfx90a'"):
        get_toolchain()


def test_env_arch_equal_to_override_is_fine(fake_cc, monkeypatch):
    monkeypatch.setenv("MORI_JIT_ARCH", "gfx942")
    set_arch_override("gfx942")
    assert get_toolchain().arch == "gfx942"


def test_get_toolchain_resolves_once(fake_cc, monkeypatch):
    monkeypatch.setenv("MORI_JIT_ARCH", "sm_90a")
    first = get_toolchain()
    monkeypatch.setenv("MORI_JIT_ARCH", "gfx90a")
    assert get_toolchain() is first


def test_bad_override_is_rejected_without_state_change(fake_cc):
    with pytest.raises(ToolchainError, match="not supported"):
        set_arch_override("gfx")
    set_arch_override("sm_90a")  # nothing was recorded by the bad call


def test_make_toolchain_uses_no_process_state(fake_cc):
    set_arch_override("gfx90a")
    assert make_toolchain("sm_90a").arch == "sm_90a"
    assert get_toolchain().arch == "gfx90a"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_detect_arch_without_gpu_says_what_to_set():
    with pytest.raises(ToolchainError, match="MORI_JIT_ARCH"):
        detect_arch()


# -- vendor routing -----------------------------------------------------------------------------

def test_gfx_routes_to_hipcc_genco_with_hip_platform_amd(fake_cc, monkeypatch):
    monkeypatch.setenv("HIP_PLATFORM", "nvidia")  # must not leak into the compile
    tc = make_toolchain("gfx90a")
    assert (tc.vendor, tc.binary_ext, tc.compiler, tc.wave_size) == ("amd", "hsaco", str(fake_cc.hipcc), 64)
    cmd = tc.command(Path("/s/k.hip"), Path("/o/k.hsaco"), [Path("/inc")])
    assert cmd[0] == str(fake_cc.hipcc)
    assert cmd[1:4] == ["--genco", "--offload-arch=gfx90a", "-std=c++20"]
    assert cmd[-3:] == ["-o", "/o/k.hsaco", "/s/k.hip"] and "-I/inc" in cmd
    assert tc.env()["HIP_PLATFORM"] == "amd"
    entry = build(AXPY, AXPY.make_cfg(tc, {}), tc)
    assert entry.binary.name == "kernel.hsaco"
    calls = fake_cc.calls()
    assert calls and all(c["HIP_PLATFORM"] == "amd" for c in calls)  # --version and the compile
    (compile_call,) = fake_cc.compiles()
    assert "--genco" in compile_call["argv"] and "--offload-arch=gfx90a" in compile_call["argv"]


def test_sm_routes_to_nvcc_cubin(fake_cc, monkeypatch):
    monkeypatch.delenv("HIP_PLATFORM", raising=False)
    tc = make_toolchain("sm_90a")
    assert (tc.vendor, tc.binary_ext, tc.compiler, tc.wave_size) == ("nvidia", "cubin", str(fake_cc.nvcc), 32)
    cmd = tc.command(Path("/s/k.hip"), Path("/o/k.cubin"), [Path("/inc")])
    assert cmd[0] == str(fake_cc.nvcc)
    assert "--cubin" in cmd and "-gencode=arch=compute_90a,code=sm_90a" in cmd and "-std=c++20" in cmd
    assert "-x" in cmd and cmd[cmd.index("-x") + 1] == "cu"  # the .hip source is CUDA to nvcc
    assert "HIP_PLATFORM" not in tc.env()
    entry = build(AXPY, AXPY.make_cfg(tc, {}), tc)
    assert entry.binary.name == "kernel.cubin"
    (compile_call,) = fake_cc.compiles()
    assert "--cubin" in compile_call["argv"] and compile_call["HIP_PLATFORM"] is None


@pytest.mark.parametrize("arch,vendor", [("gfx90a", "amd"), ("gfx942", "amd"), ("gfx1250", "amd"),
                                         ("sm_90a", "nvidia"), ("sm_80", "nvidia"), ("sm_100a", "nvidia")])
def test_vendor_of(arch, vendor):
    assert vendor_of(arch) == vendor


@pytest.mark.parametrize("arch,has", [("sm_90a", True), ("sm_90", True), ("sm_100a", True), ("sm_120", True),
                                      ("sm_89", False), ("sm_80", False), ("gfx90a", False), ("gfx942", False)])
def test_has_bulk_copy_is_nvidia_sm90_and_later(arch, has):
    assert tcm.has_bulk_copy(arch) is has


@pytest.mark.parametrize("arch", ["", "gfx", "sm_9", "sm90", "cuda", "gfx90a:sramecc+", "GFX90A", "sm_90b"])
def test_bad_arch_message_names_the_accepted_forms(arch, fake_cc):
    for fn in (vendor_of, make_toolchain, set_arch_override):
        with pytest.raises(ToolchainError) as ei:
            fn(arch)
        msg = str(ei.value)
        assert repr(arch) in msg and "gfx<id>" in msg and "sm_<cc>" in msg and "sm_90a" in msg


@pytest.mark.parametrize("arch", ["sm_91", "sm_99a", "sm_100", "gfx1234", "gfx90b"])
def test_an_arch_no_gpu_has_is_refused_listing_the_known_ones(arch, fake_cc):
    if arch in KNOWN_ARCHS["nvidia"]:  # (a known one is the control)
        assert make_toolchain(arch).arch == arch
        return
    assert vendor_of(arch) in ("amd", "nvidia")  # the form is right: a cache directory of it is still read
    for fn in (make_toolchain, set_arch_override):
        with pytest.raises(ToolchainError) as ei:
            fn(arch)
        msg = str(ei.value)
        assert f"arch {arch!r} is not supported; known archs: NVIDIA sm_70, " in msg and "; AMD gfx906, " in msg


def test_every_known_arch_makes_a_toolchain(fake_cc):
    for vendor, archs in KNOWN_ARCHS.items():
        assert all(make_toolchain(a).vendor == vendor and re.fullmatch(ARCH_PATTERN, a) for a in archs)


def test_wave_sizes():
    assert [wave_size_for_arch(a) for a in ("gfx90a", "gfx942", "gfx1100", "gfx1250", "sm_90a")] == [64, 64, 32, 32, 32]


# -- compiler discovery, signature, flags, NIC ---------------------------------------------------

def test_signature_is_the_version_output(fake_cc, monkeypatch):
    monkeypatch.setenv("FAKE_CC_VERSION", "fake-nvcc 12.34 build 5")
    assert make_toolchain("sm_90a").signature.strip() == "fake-nvcc 12.34 build 5"


def test_failing_version_is_a_toolchain_error(fake_cc, monkeypatch, tmp_path):
    broken = tmp_path / "nvcc"
    broken.write_text("#!/bin/sh\necho 'license expired' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("MORI_JIT_NVCC", str(broken))
    with pytest.raises(ToolchainError, match="exited 3: license expired"):
        make_toolchain("sm_90a")


def test_explicit_compiler_that_does_not_exist_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MORI_JIT_NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(ToolchainError, match="MORI_JIT_NVCC=.*no-such-nvcc is not an executable file"):
        make_toolchain("sm_90a")
    not_exec = tmp_path / "hipcc"
    not_exec.write_text("")
    monkeypatch.setenv("MORI_JIT_HIPCC", str(not_exec))
    with pytest.raises(ToolchainError, match="MORI_JIT_HIPCC"):
        make_toolchain("gfx90a")


@pytest.mark.skipif(os.path.exists("/opt/rocm/bin/hipcc"), reason="/opt/rocm/bin/hipcc exists")
def test_no_hipcc_anywhere_says_which_variable_to_set(monkeypatch, tmp_path):
    monkeypatch.delenv("MORI_JIT_HIPCC", raising=False)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolchainError, match="no hipcc found.*set MORI_JIT_HIPCC"):
        make_toolchain("gfx90a")


def test_no_compiler_message_names_each_place_once_and_how_to_get_one(no_compilers, monkeypatch):
    standard = tcm.STANDARD_PLACE["amd"]
    monkeypatch.setenv("ROCM_PATH", str(Path(standard).parent.parent))  # ROCM_PATH is the standard place
    with pytest.raises(ToolchainError) as e:
        make_toolchain("gfx90a")
    msg = str(e.value)
    assert msg.count(standard) == 1, msg
    assert " found (tried " in msg and "apt-get install hipcc" in msg and "MORI_JIT_HIPCC" in msg


def test_compiler_default_arch_follows_the_installed_compiler(no_compilers, fake_cc, monkeypatch):
    monkeypatch.delenv("MORI_JIT_HIPCC")
    monkeypatch.delenv("MORI_JIT_NVCC")
    with pytest.raises(ToolchainError, match=r"no nvcc found.*CUDA toolkit.*no hipcc found.*apt-get install hipcc"):
        tcm.compiler_default_arch()
    monkeypatch.setenv("MORI_JIT_HIPCC", str(fake_cc.hipcc))
    assert tcm.compiler_default_arch() == ("gfx90a", str(fake_cc.hipcc))
    monkeypatch.setenv("MORI_JIT_NVCC", str(fake_cc.nvcc))  # nvcc first: sm_90a is the tuned arch
    assert tcm.compiler_default_arch() == ("sm_90a", str(fake_cc.nvcc))


def test_compiler_from_rocm_path(monkeypatch, tmp_path, fake_cc):
    monkeypatch.delenv("MORI_JIT_HIPCC", raising=False)
    (tmp_path / "bin").mkdir()
    hipcc = tmp_path / "bin" / "hipcc"
    hipcc.write_text(f"#!/bin/sh\nexec {fake_cc.hipcc} \"$@\"\n")
    hipcc.chmod(0o755)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    assert make_toolchain("gfx90a").compiler == str(hipcc)


def test_extra_flags_and_nic_are_in_the_toolchain(fake_cc, monkeypatch):
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", "-DFOO=1 '-Xptxas -v'")
    monkeypatch.setenv("MORI_JIT_DEVICE_NIC", "mlx5")
    tc = make_toolchain("sm_90a")
    assert tc.flags[-2:] == ("-DFOO=1", "-Xptxas -v") and tc.nic == "mlx5"
    assert "-DFOO=1" in tc.command(Path("a"), Path("b"), []) and "mlx5" in tc.key_parts()


def test_bad_nic_name_is_rejected(fake_cc, monkeypatch):
    monkeypatch.setenv("MORI_JIT_DEVICE_NIC", "../evil")
    with pytest.raises(ValueError, match="MORI_JIT_DEVICE_NIC"):
        make_toolchain("sm_90a")


def test_reset_for_tests_forgets_everything(fake_cc):
    set_arch_override("gfx90a")
    get_toolchain()
    tcm._reset_for_tests()
    set_arch_override("sm_90a")
    assert get_toolchain().arch == "sm_90a"
