"""Device linking, with the fake toolchain (and one real nvcc build when nvcc and NVSHMEM are here).

A spec with device libraries is compiled with ``-rdc=true`` and device-linked with their archives
into the entry's one binary; the key takes the sha256 of each archive's bytes and of the library's
headers (other bytes, another key; the same bytes at another path, the same key); a library that is
not installed is an error naming where it was looked for; the plan runs the library's module hook
once per loaded module (``tests/test_module_hooks.py``).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from fake_compiler import link_output_for, output_for
from jit_helpers import EM_CUDA, STT_FUNC, elf_header, elf_symbols, toolchain_or_skip
from mori_jit.examples.axpy_spec import AxpyCfg, AxpySpec
from mori_jit.jit import cache
from mori_jit.jit.args import ArgsSchema, ptr
from mori_jit.jit.compile import CompileError, build, resolve
from mori_jit.jit.devlib import DeviceLibraryError
from mori_jit.jit.nvshmem import NVSHMEM, Nvshmem
from mori_jit.jit.spec import Geometry, Spec
from mori_jit.jit.toolchain import ToolchainError, make_toolchain

LIB = "lib/libnvshmem_device.a"


class NvshmemAxpy(AxpySpec):
    """The example kernel, declared as linked against NVSHMEM (the fake compiler does not read it)."""

    name = "test_axpy_nvshmem"
    device_libraries = (NVSHMEM,)


SPEC = NvshmemAxpy()


def _install(root: Path, lib: bytes = b"!<arch>\nfake device archive\n", version: str = "9.8.7") -> Path:
    """A fake NVSHMEM install at ``root``: the marker header, the version header and the archive."""
    (root / "include" / "non_abi").mkdir(parents=True)
    (root / "include" / "nvshmem.h").write_text("#pragma once\n")
    (root / "include" / "non_abi" / "nvshmem_version.h").write_text(
        f'#define NVSHMEM_VENDOR_BASE_VERSION_STRING "{version}"\n')
    (root / "lib").mkdir()
    (root / LIB).write_bytes(lib)
    return root


@pytest.fixture
def nvshmem_home(monkeypatch, tmp_path) -> Path:
    """A fake NVSHMEM install named by MORI_JIT_NVSHMEM_HOME (NVSHMEM_HOME unset)."""
    home = _install(tmp_path / "nvshmem")
    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(home))
    return home


def _key(arch: str = "sm_90a") -> str:
    tc = make_toolchain(arch)
    return resolve(SPEC, SPEC.make_cfg(tc, {}), tc).key


# -- the build ------------------------------------------------------------------------------------

def test_the_link_step_runs_and_the_entry_holds_the_linked_binary(fake_cc, nvshmem_home):
    tc = make_toolchain("sm_90a")
    cfg = SPEC.make_cfg(tc, {})
    entry = build(SPEC, cfg, tc)
    compile_call, link_call = fake_cc.compiles()
    assert "-rdc=true" in compile_call["argv"] and f"-I{nvshmem_home / 'include'}" in compile_call["argv"]
    assert link_call["argv"][:3] == ["-dlink", "--cubin", "-gencode=arch=compute_90a,code=sm_90a"]
    source = (entry.path / cache.SOURCE_NAME).read_bytes()
    lib = (nvshmem_home / LIB).read_bytes()
    assert entry.read_binary() == link_output_for([output_for(source, relocatable=True)], [lib])
    assert sorted(p.name for p in entry.path.iterdir()) == sorted([cache.SOURCE_NAME, cache.META_NAME,
                                                                   "kernel.cubin"])
    meta = json.loads((entry.path / cache.META_NAME).read_text())
    (linked,) = meta["linked"]
    assert linked["sha256"] == hashlib.sha256(lib).hexdigest() and linked["version"] == "9.8.7"
    assert linked["origin"] == "MORI_JIT_NVSHMEM_HOME" and meta["link_command"][1] == "-dlink"
    assert not list((cache.cache_root() / "tmp").iterdir())  # the object and archive copies are gone
    build(SPEC, cfg, tc)
    assert len(fake_cc.compiles()) == 2  # a hit links nothing


def test_a_spec_without_libraries_builds_as_before(fake_cc, nvshmem_home):
    from mori_jit.examples.axpy_spec import AXPY
    tc = make_toolchain("sm_90a")
    entry = build(AXPY, AXPY.make_cfg(tc, {}), tc)
    (call,) = fake_cc.compiles()
    assert "-rdc=true" not in call["argv"] and not any(str(nvshmem_home) in a for a in call["argv"])
    assert entry.read_binary() == output_for((entry.path / cache.SOURCE_NAME).read_bytes())
    assert "linked" not in entry.meta


def test_a_failing_link_names_the_step_and_publishes_nothing(fake_cc, nvshmem_home, monkeypatch):
    monkeypatch.setenv("FAKE_CC_LINK_FAIL", "nvlink error   : Undefined reference to 'nvshmemi_device_state_d'")
    tc = make_toolchain("sm_90a")
    with pytest.raises(CompileError, match="linking test_axpy_nvshmem failed") as e:
        build(SPEC, SPEC.make_cfg(tc, {}), tc)
    assert e.value.step == "linking" and "-dlink" in e.value.cmd and "nvshmemi_device_state_d" in e.value.stderr
    assert cache.list_entries() == [] and not list((cache.cache_root() / "tmp").iterdir())


def test_an_archive_changed_after_keying_is_refused(fake_cc, nvshmem_home):
    tc = make_toolchain("sm_90a")
    res = resolve(SPEC, SPEC.make_cfg(tc, {}), tc)
    (nvshmem_home / LIB).write_bytes(b"!<arch>\nanother archive\n")
    with pytest.raises(DeviceLibraryError, match=r"libnvshmem_device\.a changed after the cache key"):
        build(SPEC, SPEC.make_cfg(tc, {}), tc, resolved=res)
    assert cache.list_entries() == []


def test_amd_arches_cannot_device_link(fake_cc, nvshmem_home):
    tc = make_toolchain("gfx90a")
    with pytest.raises(ToolchainError, match="NVIDIA arches only, not gfx90a"):
        build(SPEC, SPEC.make_cfg(tc, {}), tc)


# -- the key --------------------------------------------------------------------------------------

def test_the_key_follows_the_archive_bytes_not_its_path(fake_cc, nvshmem_home, monkeypatch, tmp_path):
    first = _key()
    moved = tmp_path / "elsewhere" / "nvshmem-copy"
    shutil.copytree(nvshmem_home, moved)
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(moved))
    assert _key() == first
    lib = bytearray((moved / LIB).read_bytes())
    lib[-2] ^= 1
    (moved / LIB).write_bytes(bytes(lib))
    second = _key()
    assert second != first
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(nvshmem_home))
    assert _key() == first


def test_the_key_follows_the_headers(fake_cc, nvshmem_home):
    tc = make_toolchain("sm_90a")
    cfg = SPEC.make_cfg(tc, {})
    first = resolve(SPEC, cfg, tc, fresh_include_hash=True).key
    (nvshmem_home / "include" / "device").mkdir()
    (nvshmem_home / "include" / "device" / "new.cuh").write_text("// a new header\n")
    second = resolve(SPEC, cfg, tc, fresh_include_hash=True).key
    (nvshmem_home / "include" / "nvshmem.h").write_text("#pragma once\n// edited\n")
    third = resolve(SPEC, cfg, tc, fresh_include_hash=True).key
    assert len({first, second, third}) == 3


# -- finding the library --------------------------------------------------------------------------

def test_a_missing_library_names_where_it_looked(fake_cc, monkeypatch, tmp_path):
    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(tmp_path / "none"))
    with pytest.raises(DeviceLibraryError) as e:
        _key()
    msg = str(e.value)
    assert "MORI_JIT_NVSHMEM_HOME" in msg and str(tmp_path / "none" / LIB) in msg
    assert "pip install nvidia-nvshmem-cu13" in msg


def test_no_install_anywhere_names_every_place(fake_cc, monkeypatch):
    class Absent(Nvshmem):
        package = "mori_jit_no_such_package.nvshmem"

    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    monkeypatch.delenv("MORI_JIT_NVSHMEM_HOME", raising=False)
    with pytest.raises(DeviceLibraryError) as e:
        Absent().locate()
    msg = str(e.value)
    for what in ("nvshmem not found", "MORI_JIT_NVSHMEM_HOME is unset", "NVSHMEM_HOME is unset",
                 "nvidia-nvshmem-cu13 (mori_jit_no_such_package.nvshmem) is not installed",
                 "pip install nvidia-nvshmem-cu13", "lib/libnvshmem_device.a"):
        assert what in msg, msg


def test_the_settings_take_precedence_in_order(monkeypatch, tmp_path):
    a, b = _install(tmp_path / "a", version="1.2.3"), _install(tmp_path / "b", version="4.5.6")
    monkeypatch.delenv("MORI_JIT_NVSHMEM_HOME", raising=False)
    monkeypatch.setenv("NVSHMEM_HOME", str(b))
    found = NVSHMEM.locate()
    assert (found.home, found.origin, found.version) == (b.resolve(), "NVSHMEM_HOME", "4.5.6")
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(a))
    found = NVSHMEM.locate()
    assert (found.home, found.origin, found.archives) == (a.resolve(), "MORI_JIT_NVSHMEM_HOME", (a.resolve() / LIB,))
    (a / "include" / "nvshmem.h").unlink()  # an explicit choice that is broken never falls back
    with pytest.raises(DeviceLibraryError, match=r"MORI_JIT_NVSHMEM_HOME points at .*lacks .*nvshmem\.h"):
        NVSHMEM.locate()


def test_info_shows_the_engine_or_why_none(fake_cc, nvshmem_home, monkeypatch, capsys):
    from mori_jit.cli import main
    assert main(["info", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert f"nvshmem:     {nvshmem_home.resolve()} (version 9.8.7, from MORI_JIT_NVSHMEM_HOME)" in out
    assert f"MORI_JIT_NVSHMEM_HOME={nvshmem_home}" in out  # among the variables set
    shutil.rmtree(nvshmem_home / "lib")
    assert main(["info", "--arch", "sm_90a"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("nvshmem:"))
    assert "(not found: nvshmem: MORI_JIT_NVSHMEM_HOME points at" in line and str(nvshmem_home / LIB) in line
    assert "pip install nvidia-nvshmem-cu13" in line


@pytest.mark.parametrize("text, version", [
    ('#define NVSHMEM_VENDOR_BASE_VERSION_STRING "3.4.5"\n', "3.4.5"),
    ("#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 2\n"
     "#define NVSHMEM_VENDOR_PATCH_VERSION 5\n", "3.2.5"),
    ("/* nothing */\n", "unknown"),
])
def test_version_from_the_header(tmp_path, text, version):
    (tmp_path / "include" / "non_abi").mkdir(parents=True)
    (tmp_path / "include" / "non_abi" / "nvshmem_version.h").write_text(text)
    assert NVSHMEM.version(tmp_path) == version
    assert Nvshmem().version(tmp_path / "nowhere") == "unknown"


# -- a real build ---------------------------------------------------------------------------------

PROBE_SOURCE = """#include <nvshmem.h>
struct ProbeArgs { int* out; };
extern "C" __global__ void mori_test_nvshmem_probe(ProbeArgs a) {
    a.out[0] = nvshmem_my_pe();
    a.out[1] = nvshmem_n_pes();
}
"""


class NvshmemProbe(Spec):
    """A kernel that calls NVSHMEM device functions (its source is fixed; no template)."""

    name = "test_nvshmem_probe"
    cfg_type = AxpyCfg
    args = ArgsSchema("ProbeArgs", [ptr("out", "int")])
    device_libraries = (NVSHMEM,)

    def entry_name(self, cfg):
        return "mori_test_nvshmem_probe"

    def geometry(self, cfg):
        return Geometry((1, 1, 1), (32, 1, 1))

    def render_source(self, cfg, toolchain):
        return PROBE_SOURCE


def test_real_nvcc_device_links_nvshmem_for_sm_90a():
    tc = toolchain_or_skip("sm_90a")
    try:
        found = NVSHMEM.locate()
    except DeviceLibraryError as e:
        pytest.skip(f"NVSHMEM absent: {e}")
    probe = NvshmemProbe()
    entry = build(probe, AxpyCfg(), tc)
    data = entry.read_binary()
    assert elf_header(data)["machine"] == EM_CUDA
    assert struct.unpack_from("<H", data, 0x10)[0] == 2  # ET_EXEC: linked, not a relocatable object
    symbols = elf_symbols(data)
    assert symbols.get("mori_test_nvshmem_probe") == STT_FUNC
    assert "nvshmemi_device_lib_version_d" in symbols  # defined only in libnvshmem_device.a
    (linked,) = entry.meta["linked"]
    assert linked["sha256"] == hashlib.sha256(found.archives[0].read_bytes()).hexdigest()
