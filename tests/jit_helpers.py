"""Helpers shared by the JIT framework tests (importable by spawned worker processes too)."""
from __future__ import annotations

import dataclasses
import random
import struct
import subprocess
from pathlib import Path
from typing import Any

from mori_jit.jit.fields import CEnum, ConfigError, cfg_fields

# ------------------------------------------------------------------------------------------------
# random configs
# ------------------------------------------------------------------------------------------------


def _random_value(rng: random.Random, kind: type, default: Any) -> Any:
    if kind is bool:
        return rng.random() < 0.5
    if isinstance(kind, type) and issubclass(kind, CEnum):
        return rng.choice(list(kind))
    d = max(int(default), 1)
    r = rng.random()
    if r < 0.25:
        return int(default)
    if r < 0.55:
        return 1 << rng.randint(0, (2 * d).bit_length())
    if r < 0.85:
        return rng.randint(0, 2 * d + 8)
    return rng.choice([-1, 0, 1, 2, 3, 7, 16, 32, 33, 64, 1000, 4096])


def force_cfg(cls: type, **values: Any) -> Any:
    """An instance of Cfg ``cls`` with ``values``, *bypassing* its validation (for IsValid tests)."""
    obj = object.__new__(cls)
    for fi in cfg_fields(cls):
        object.__setattr__(obj, fi.name, values.get(fi.name, fi.default))
    return obj


def sample_cfgs(cls: type, n_valid: int, n_invalid: int, seed: int = 0, max_tries: int = 500_000):
    """``n_valid`` distinct valid configs and ``n_invalid`` invalid ones (built with :func:`force_cfg`)."""
    rng = random.Random(seed)
    infos = cfg_fields(cls)
    valid: dict[Any, None] = {}
    invalid: list[Any] = []
    for _ in range(max_tries):
        if len(valid) >= n_valid and len(invalid) >= n_invalid:
            break
        values = {fi.name: _random_value(rng, fi.kind, fi.default) for fi in infos}
        try:
            valid.setdefault(cls(**values), None)
        except ConfigError:
            if len(invalid) < n_invalid:
                invalid.append(force_cfg(cls, **values))
    if len(valid) < n_valid or len(invalid) < n_invalid:
        raise AssertionError(f"{cls.__name__}: sampled only {len(valid)} valid / {len(invalid)} invalid configs")
    return list(valid)[:n_valid], invalid


def other_valid_value(cfg: Any, name: str, rng: random.Random | None = None):
    """A value of field ``name`` different from ``cfg``'s for which the replaced cfg is still valid."""
    rng = rng or random.Random(1)
    fi = next(f for f in cfg_fields(cfg) if f.name == name)
    cur = getattr(cfg, name)
    if fi.kind is bool:
        cands = [not cur]
    elif issubclass(fi.kind, CEnum):
        cands = [m for m in fi.kind if m != cur]
    else:
        cands = [cur * 2, cur // 2, cur + 1, cur - 1, cur + 2, cur + 16, cur * 4, 0, 1, 32, 64]
        cands += [rng.randint(1, 4096) for _ in range(50)]
    for v in cands:
        if v == cur:
            continue
        try:
            return dataclasses.replace(cfg, **{name: v})
        except ConfigError:
            continue
    return None


# ------------------------------------------------------------------------------------------------
# ELF and clang offload bundles
# ------------------------------------------------------------------------------------------------

EM_CUDA = 190
EM_AMDGPU = 224
STT_FUNC = 2


def toolchain_or_skip(arch: str):
    """The real toolchain for ``arch``; skips the test (with the reason) only when its compiler is
    not installed, so any other toolchain error still fails it."""
    import pytest

    from mori_jit.jit.toolchain import ToolchainError, make_toolchain
    try:
        return make_toolchain(arch)
    except ToolchainError as e:
        if " found (tried " in str(e):
            pytest.skip(f"compiler for {arch} absent: {e}")
        raise


def nvcc_ptx(toolchain, src: Path, out: Path, include_dirs: list[Path] = ()) -> str:
    """The PTX nvcc makes of ``src`` with the toolchain's own command and flags (``--ptx`` in place
    of ``--cubin``); asserts the compile succeeded."""
    cmd = [("--ptx" if a == "--cubin" else a) for a in toolchain.command(src, out, list(include_dirs))]
    p = subprocess.run(cmd, capture_output=True, text=True, env=toolchain.env(), timeout=600)
    assert p.returncode == 0, p.stderr
    return out.read_text()


def elf_header(data: bytes) -> dict:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    e_machine, = struct.unpack_from("<H", data, 0x12)
    e_flags, = struct.unpack_from("<I", data, 0x30)
    return {"machine": e_machine, "flags": e_flags}


def elf_symbols(data: bytes) -> dict[str, int]:
    """``{name: st_type}`` of every symbol in the ``.symtab``/``.dynsym`` sections of an ELF64 file."""
    elf_header(data)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    out: dict[str, int] = {}
    for sh_name, sh_type, _fl, _addr, off, size, link, _info, _al, entsize in sections:
        if sh_type not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        str_off, str_size = sections[link][4], sections[link][5]
        strtab = data[str_off:str_off + str_size]
        for j in range(size // (entsize or 24)):
            st_name, st_info = struct.unpack_from("<IB", data, off + j * (entsize or 24))
            end = strtab.index(b"\0", st_name)
            name = strtab[st_name:end].decode()
            if name:
                out[name] = st_info & 0xF
    return out


BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"


def unbundle(data: bytes, target: str) -> bytes:
    """The ``target`` entry of an uncompressed clang offload bundle (the format hipcc --genco writes)."""
    if not data.startswith(BUNDLE_MAGIC):
        raise ValueError("not a clang offload bundle")
    n, = struct.unpack_from("<Q", data, len(BUNDLE_MAGIC))
    pos = len(BUNDLE_MAGIC) + 8
    for _ in range(n):
        off, size, tlen = struct.unpack_from("<QQQ", data, pos)
        triple = data[pos + 24:pos + 24 + tlen].decode()
        pos += 24 + tlen
        if triple == target:
            return data[off:off + size]
    raise KeyError(f"{target} not in the bundle")


# ------------------------------------------------------------------------------------------------
# multiprocessing worker (spawned: must be importable)
# ------------------------------------------------------------------------------------------------


def build_axpy_worker(barrier, queue, arch: str) -> None:
    """Build the default example_axpy for ``arch`` once every worker is ready; report to ``queue``."""
    try:
        from mori_jit.examples.axpy_spec import AXPY
        from mori_jit.jit.cache import sha256_file
        from mori_jit.jit.compile import build
        from mori_jit.jit.toolchain import make_toolchain
        tc = make_toolchain(arch)
        cfg = AXPY.make_cfg(tc, {})
        barrier.wait(timeout=120)
        entry = build(AXPY, cfg, tc)
        queue.put(("ok", str(entry.path), sha256_file(entry.binary)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(("error", f"{type(e).__name__}: {e}", ""))


def host_harness(tmp_dir: Path, source: str):
    """``source`` (C++ that includes the kernels' headers) built with g++ into a shared library in
    ``tmp_dir`` and loaded (ctypes): the kernels' host-compilable helpers, checked on the CPU.
    No FMA contraction, so float results are the ones the source spells. Skips without g++."""
    import ctypes
    import shutil

    import pytest

    from mori_jit.jit.paths import kernels_dir

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ absent")
    src, so = tmp_dir / "harness.cpp", tmp_dir / "harness.so"
    src.write_text(source)
    p = subprocess.run([gxx, "-std=c++20", "-O2", "-ffp-contract=off", "-shared", "-fPIC", f"-I{kernels_dir()}",
                        "-o", str(so), str(src)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return ctypes.CDLL(str(so))
