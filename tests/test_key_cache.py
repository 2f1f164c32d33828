"""Key and cache, with the fake toolchain.

The key changes exactly when something that can change the binary changes (each Cfg field, extra
flags, NIC, compiler signature, any byte of any file in the spec's source deps, the template) and
not otherwise (the tree moved elsewhere, a new field with a behaviour-keeping default). The cache
publishes atomically: 8 processes racing on one key leave one entry and an empty tmp/, with or
without the lock; a killed compile publishes nothing; a truncated binary is detected and rebuilt;
a failing compile reports command, stderr and the kept source.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest

from conftest import FAKE_NVCC, REPO, TESTS
from fake_compiler import output_for
from jit_helpers import build_axpy_worker, other_valid_value
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType
from mori_jit.jit import cache
from mori_jit.jit.cache import list_entries, verify_entry
from mori_jit.jit.compile import CompileError, build, build_many, resolve
from mori_jit.jit.fields import cfg_fields
from mori_jit.jit.registry import all_specs, get_spec
from mori_jit.jit.spec import Geometry, Spec
from mori_jit.jit.toolchain import _signature, make_toolchain
from mori_jit.ops.ep.backends.hip.intranode.cfg import EpCfg

ARCHS = ["sm_90a", "gfx90a"]


def _key(spec=AXPY, cfg=None, arch="sm_90a"):
    tc = make_toolchain(arch)
    cfg = spec.make_cfg(tc, {}) if cfg is None else cfg
    return resolve(spec, cfg, tc, fresh_include_hash=True).key


def _tmp_children() -> list[Path]:
    tmp = cache.cache_root() / "tmp"
    return sorted(tmp.iterdir()) if tmp.is_dir() else []


# -- the key changes exactly when it must -----------------------------------------------------

def test_key_is_stable(fake_cc):
    assert _key() == _key()
    cfg = AxpyCfg(blockNum=3)
    assert _key(cfg=cfg) == _key(cfg=AxpyCfg(blockNum=3))


@pytest.mark.parametrize("spec_name,cfg_type", [("example_axpy", AxpyCfg), ("ep_dispatch", EpCfg),
                                                ("ep_combine", EpCfg)])
def test_every_cfg_field_changes_the_key(fake_cc, spec_name, cfg_type):
    spec = get_spec(spec_name)
    tc = make_toolchain("sm_90a")
    bases = [spec.make_cfg(tc, {})]
    if cfg_type is AxpyCfg:
        bases.append(AxpyCfg(vecElems=4))  # dtype can only flip where both dtypes are valid
    if cfg_type is EpCfg:  # the scale fields, the fp8 cast and the layout change only beside others
        from mori_jit.ops.ep.backends.hip.intranode.cfg import EpDType
        bases.append(dataclasses.replace(bases[0], dtype=EpDType.Fp8, scaleDim=bases[0].hiddenDim // 128,
                                         scaleTypeSize=4, expertCounts=True))
    keys_seen = {resolve(spec, bases[0], tc, fresh_include_hash=True).key}
    for fi in cfg_fields(cfg_type):
        if spec_name == "ep_combine" and fi.name == "dtype":
            base, other = bases[0], dataclasses.replace(bases[0], dtype=type(bases[0].dtype).Fp32)
        else:
            base, other = next(((b, o) for b in bases if (o := other_valid_value(b, fi.name)) is not None),
                               (None, None))
        assert other is not None, f"no valid alternative value for {fi.name}"
        k0 = resolve(spec, base, tc, fresh_include_hash=True).key
        k1 = resolve(spec, other, tc, fresh_include_hash=True).key
        assert k0 != k1, f"changing {fi.name} did not change the key"
        keys_seen.add(k1)
    assert len(keys_seen) == len(cfg_fields(cfg_type)) + 1  # and no two changes collide


def test_extra_flags_change_the_key(fake_cc, monkeypatch):
    k0 = _key()
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", "-DMORI_TRACE=1")
    k1 = _key()
    assert k1 != k0
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", "-DMORI_TRACE=2")
    assert _key() not in (k0, k1)
    monkeypatch.delenv("MORI_JIT_EXTRA_FLAGS")
    assert _key() == k0
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", "-DMORI_TRACE=1")
    entry = build(AXPY, AxpyCfg(), make_toolchain("sm_90a"))
    assert "-DMORI_TRACE=1" in fake_cc.compiles()[-1]["argv"] and entry.path.name.endswith(k1)


def test_nic_changes_the_key_and_the_directory(fake_cc, monkeypatch):
    k0 = _key()
    monkeypatch.setenv("MORI_JIT_DEVICE_NIC", "mlx5")
    assert _key() != k0
    entry = build(AXPY, AxpyCfg(), make_toolchain("sm_90a"))
    assert entry.path.parent.name == "sm_90a_mlx5"


def test_compiler_signature_changes_the_key(fake_cc, monkeypatch):
    monkeypatch.setenv("FAKE_CC_VERSION", "fake-cc 1.0")
    _signature.cache_clear()
    k0 = _key()
    monkeypatch.setenv("FAKE_CC_VERSION", "fake-cc 1.1")
    _signature.cache_clear()
    k1 = _key()
    assert k1 != k0


def test_compiler_upgrade_in_place_changes_the_key_without_clearing_memos(fake_cc, monkeypatch, tmp_path):
    # A private copy of the fake (shim + script), upgraded in place: the new mtime re-reads --version.
    (tmp_path / "bin").mkdir()
    shutil.copy2(TESTS / "fake_compiler.py", tmp_path / "fake_compiler.py")
    shim = tmp_path / "bin" / "fake-nvcc"
    shutil.copy2(FAKE_NVCC, shim)
    monkeypatch.setenv("MORI_JIT_NVCC", str(shim))
    monkeypatch.setenv("FAKE_CC_VERSION", "fake-cc 1.0")
    k0 = _key()
    monkeypatch.setenv("FAKE_CC_VERSION", "fake-cc 2.0")  # "install" the new compiler ...
    st = shim.stat()
    os.utime(shim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # ... which touches the binary
    assert _key() != k0


@pytest.mark.parametrize("spec_name", ["example_axpy", "ep_dispatch", "ep_combine"])
def test_any_byte_of_any_dep_file_changes_the_key(fake_cc, src_copy, spec_name):
    spec = get_spec(spec_name)
    k0 = _key(spec)
    files = [p for dep in spec.source_deps() for p in sorted((src_copy / dep).rglob("*")) if p.is_file()]
    assert len(files) >= 3
    for f in files:
        orig = f.read_bytes()
        pos = len(orig) // 2
        f.write_bytes(orig[:pos] + bytes([orig[pos] ^ 0x01]) + orig[pos + 1:])  # flip one bit
        assert _key(spec) != k0, f"{f.relative_to(src_copy)} is not in the key of {spec_name}"
        f.write_bytes(orig)
        assert _key(spec) == k0
    new = src_copy / spec.source_deps()[-1] / "new_helper.hpp"
    new.write_text("// a new file in a dep dir\n")
    assert _key(spec) != k0, "a new file in a dependency directory is not in the key"
    new.unlink()
    renamed = files[0].with_name(files[0].name + ".bak")
    files[0].rename(renamed)
    assert _key(spec) != k0, "renaming a dependency file does not change the key"
    renamed.rename(files[0])
    assert _key(spec) == k0


def test_template_change_changes_the_key(fake_cc, src_copy):
    k0 = _key()
    t = src_copy / "templates" / AXPY.template
    t.write_text(t.read_text().replace("do not edit.", "do not edit!"))
    assert _key() != k0


def test_file_outside_the_deps_does_not_change_the_key(fake_cc, src_copy):
    k0 = _key(AXPY)
    (src_copy / "kernels" / "ep" / "unrelated.hpp").write_text("// not an axpy dependency\n")
    (src_copy / "templates" / "other.hip.j2").write_text("// another spec's template\n")
    assert _key(AXPY) == k0


def test_moving_the_source_tree_does_not_change_the_key(fake_cc, monkeypatch, tmp_path):
    keys = {}
    for where in ("a/deep/er", "b"):
        root = tmp_path / where
        for d in ("kernels", "templates"):
            shutil.copytree(REPO / d, root / d)
        monkeypatch.setenv("MORI_JIT_SOURCE_ROOT", str(root))
        keys[where] = {s.name: _key(s) for s in all_specs()}
    monkeypatch.delenv("MORI_JIT_SOURCE_ROOT")
    keys["checkout"] = {s.name: _key(s) for s in all_specs()}
    assert keys["a/deep/er"] == keys["b"] == keys["checkout"]


def test_arch_is_in_the_key_and_the_directory(fake_cc):
    res = {a: resolve(AXPY, AxpyCfg(), make_toolchain(a), fresh_include_hash=True) for a in ARCHS}
    assert res["sm_90a"].key != res["gfx90a"].key
    assert res["sm_90a"].path.parent.name == "sm_90a_none" and res["gfx90a"].path.parent.name == "gfx90a_none"
    assert res["sm_90a"].path.name == f"kernel.{AXPY.entry_name(AxpyCfg())}.{res['sm_90a'].key}"


# -- a new field with a behaviour-keeping default keeps keys -------------------------------------------

TOY_TEMPLATE = """// toy TU
#include "toy/toy.hpp"
constexpr {{ cfg_type }} kCfg = {{ cfg }};
extern "C" __global__ void {{ entry }}({{ args_type }} args) { ToyBody<kCfg>(args); }
"""


def _toy_spec(cfg_cls):
    from mori_jit.jit.args import ArgsSchema, ptr

    class ToySpec(Spec):
        name = "toy_test_only"  # never registered
        cfg_type = cfg_cls
        args = ArgsSchema("ToyArgs", [ptr("p")])
        template = "toy.hip.j2"
        deps = ("kernels/toy",)

        def entry_name(self, cfg):
            return f"toy_{cfg.width}"

        def geometry(self, cfg):
            return Geometry((1, 1, 1), (cfg.width, 1, 1))

    return ToySpec()


def test_new_field_with_behaviour_keeping_default_keeps_text_and_key(fake_cc, monkeypatch, tmp_path):
    root = tmp_path / "toy-root"
    (root / "kernels" / "toy").mkdir(parents=True)
    (root / "templates").mkdir()
    (root / "kernels" / "toy" / "toy.hpp").write_text("// hand-written toy body\n")
    (root / "templates" / "toy.hip.j2").write_text(TOY_TEMPLATE)
    monkeypatch.setenv("MORI_JIT_SOURCE_ROOT", str(root))

    def v1():
        @dataclasses.dataclass(frozen=True)
        class ToyCfg:
            width: int = 64
            fast: bool = False
        return ToyCfg

    def v2():
        @dataclasses.dataclass(frozen=True)
        class ToyCfg:
            width: int = 64
            fast: bool = False
            unroll: int = 1  # the new field; its default is the old behaviour
        return ToyCfg

    old_cls, new_cls = v1(), v2()
    old_spec, new_spec = _toy_spec(old_cls), _toy_spec(new_cls)
    tc = make_toolchain("sm_90a")
    for values in ({}, {"width": 128}, {"width": 32, "fast": True}):
        old = resolve(old_spec, old_cls(**values), tc, fresh_include_hash=True)
        new = resolve(new_spec, new_cls(**values), tc, fresh_include_hash=True)
        assert new.source == old.source and new.key == old.key and new.path == old.path
    # a non-default value of the new field is a new specialization
    new_changed = resolve(new_spec, new_cls(unroll=4), tc, fresh_include_hash=True)
    assert ".unroll=4" in new_changed.source and new_changed.key != resolve(old_spec, old_cls(), tc).key
    # the already-built binary is found (not rebuilt) by the new declaration
    e_old = build(old_spec, old_cls(width=128), tc)
    e_new = build(new_spec, new_cls(width=128), tc)
    assert e_old.path == e_new.path and len(fake_cc.compiles()) == 1


def test_changed_default_in_a_dep_header_changes_the_key_even_if_the_text_does_not(fake_cc, src_copy):
    # The safety net of the coarse include hash: a generated header carries the C++ defaults.
    k0 = _key()
    gen = src_copy / "kernels" / "example" / "axpy_generated.hpp"
    gen.write_text(gen.read_text().replace("int blockNum = 264;", "int blockNum = 265;"))
    assert _key() != k0


# -- cache: concurrency, killed compiles, corruption, failures ---------------------------------------

def _race(n: int, arch: str = "sm_90a") -> list[tuple[str, str, str]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    queue = ctx.Queue()
    procs = [ctx.Process(target=build_axpy_worker, args=(barrier, queue, arch)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("lock", ["lock", "lock-timeout"])
def test_eight_processes_one_key(fake_cc, monkeypatch, lock):
    monkeypatch.setenv("FAKE_CC_SLEEP", "1.0")
    if lock == "lock-timeout":
        # the lock is only an optimisation: with it timing out everyone compiles and races to publish
        monkeypatch.setenv("MORI_JIT_LOCK_TIMEOUT_S", "0.05")
    results = _race(8)
    assert [r[0] for r in results] == ["ok"] * 8, results
    assert len({r[1] for r in results}) == 1 and len({r[2] for r in results}) == 1
    entries = list_entries()
    assert len(entries) == 1 and str(entries[0]) == results[0][1]
    assert verify_entry(entries[0]) is not None
    assert _tmp_children() == []
    n_compiles = len(fake_cc.compiles())
    if lock == "lock":
        assert n_compiles == 1, "the per-key lock should make the other 7 wait and reuse the entry"
    else:
        assert n_compiles >= 2, "the race was not exercised"
    source = (entries[0] / cache.SOURCE_NAME).read_bytes()
    assert (entries[0] / "kernel.cubin").read_bytes() == output_for(source)


def test_compile_killed_midway_publishes_nothing_and_next_call_rebuilds(fake_cc, monkeypatch):
    tc = make_toolchain("sm_90a")
    monkeypatch.setenv("FAKE_CC_DIE", "1")
    with pytest.raises(CompileError) as ei:
        build(AXPY, AxpyCfg(), tc)
    assert ei.value.returncode != 0
    assert list_entries() == [] and _tmp_children() == []
    assert not resolve(AXPY, AxpyCfg(), tc).path.exists()
    monkeypatch.delenv("FAKE_CC_DIE")
    entry = build(AXPY, AxpyCfg(), tc)
    assert verify_entry(entry.path) is not None and len(fake_cc.compiles()) == 2
    assert entry.binary.read_bytes() == output_for((entry.path / cache.SOURCE_NAME).read_bytes())


@pytest.mark.parametrize("damage", ["truncate", "delete-binary", "delete-meta", "garble-meta"])
def test_damaged_entry_is_detected_and_rebuilt(fake_cc, damage):
    tc = make_toolchain("gfx90a")
    entry = build(AXPY, AxpyCfg(), tc)
    good = entry.binary.read_bytes()
    if damage == "truncate":
        with open(entry.binary, "r+b") as f:
            f.truncate(len(good) // 2)
    elif damage == "delete-binary":
        entry.binary.unlink()
    elif damage == "delete-meta":
        (entry.path / cache.META_NAME).unlink()
    else:
        (entry.path / cache.META_NAME).write_text("{not json")
    assert verify_entry(entry.path) is None
    again = build(AXPY, AxpyCfg(), tc)
    assert again.path == entry.path and again.binary.read_bytes() == good
    assert verify_entry(again.path) is not None
    assert len(fake_cc.compiles()) == 2 and _tmp_children() == [] and len(list_entries()) == 1


def test_truncated_binary_is_reported_by_cache_verify(fake_cc, capsys):
    from mori_jit.cli import main
    tc = make_toolchain("sm_90a")
    entry = build(AXPY, AxpyCfg(), tc)
    with open(entry.binary, "r+b") as f:
        f.truncate(10)
    assert main(["cache", "verify"]) == 1
    out, err = capsys.readouterr()
    assert f"corrupt  {entry.path.relative_to(cache.cache_root())}: binary sha256" in out
    assert err.count("\n") == 1 and err.startswith("mori-jit: error: 1 corrupt")
    build(AXPY, AxpyCfg(), tc)
    assert main(["cache", "verify"]) == 0


def test_failing_compile_reports_command_stderr_and_kept_source(fake_cc, monkeypatch):
    tc = make_toolchain("sm_90a")
    monkeypatch.setenv("FAKE_CC_FAIL", "kernel.hip(7): error: identifier \"frobnicate\" is undefined")
    with pytest.raises(CompileError) as ei:
        build(AXPY, AxpyCfg(), tc)
    e = ei.value
    assert e.cmd[0] == str(fake_cc.nvcc) and "--cubin" in e.cmd and e.cmd[-1].endswith(cache.SOURCE_NAME)
    assert "frobnicate" in e.stderr and "frobnicate" in str(e) and " ".join(e.cmd) in str(e)
    assert e.returncode == 1 and e.source_path is None and "MORI_JIT_KEEP_FAILED" in str(e)
    assert list_entries() == [] and _tmp_children() == []

    monkeypatch.setenv("MORI_JIT_KEEP_FAILED", "1")
    with pytest.raises(CompileError) as ei:
        build(AXPY, AxpyCfg(), tc)
    kept = ei.value.source_path
    assert kept is not None and kept.is_file() and str(kept) in str(ei.value)
    assert kept.read_text() == resolve(AXPY, AxpyCfg(), tc).source
    assert list_entries() == [] and _tmp_children() == []


def test_hit_does_not_run_the_compiler(fake_cc):
    tc = make_toolchain("sm_90a")
    e1 = build(AXPY, AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4), tc)
    e2 = build(AXPY, AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4), tc)
    assert e1 == e2 and len(fake_cc.compiles()) == 1
    meta = json.loads((e1.path / cache.META_NAME).read_text())
    assert meta["entry"] == AXPY.entry_name(AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4))
    assert meta["key"] in e1.path.name and meta["arch"] == "sm_90a"
    assert AXPY.entry_name(AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4)).encode() in e1.binary.read_bytes()


# -- an installed wheel compiles from its own copy, with the same keys ------------------------------

def test_wheel_ships_sources_and_keys_match_the_checkout(fake_cc, tmp_path):
    setuptools = pytest.importorskip("setuptools", reason="--no-build-isolation needs setuptools installed")
    if int(setuptools.__version__.split(".")[0]) < 70:
        pytest.skip(f"setuptools {setuptools.__version__} cannot build wheels without the 'wheel' package")
    import subprocess
    import sys
    import zipfile
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path / "whl")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = (tmp_path / "whl").glob("mori_jit-0.1.0-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for d in ("kernels", "templates"):
        for f in (REPO / d).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                assert f"mori_jit/_sources/{f.relative_to(REPO).as_posix()}" in names
    assert "mori_jit/cli/__init__.py" in names and "mori_jit/__main__.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("from mori_jit.jit import paths, compile, toolchain; from mori_jit.examples.axpy_spec import AXPY, AxpyCfg;"
            "tc = toolchain.make_toolchain('sm_90a');"
            "print(paths.source_root()); print(compile.resolve(AXPY, AxpyCfg(), tc).key)")
    env = {k: v for k, v in os.environ.items() if k != "MORI_JIT_SOURCE_ROOT"}
    env["PYTHONPATH"] = str(site)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    root, key = p.stdout.split()
    assert root == str(site / "mori_jit" / "_sources")
    assert key == _key()


def test_build_many_compiles_each_once_in_order_and_raises_on_failure(fake_cc, monkeypatch):
    tc = make_toolchain("sm_90a")
    cfgs = [AxpyCfg(blockNum=b) for b in (1, 2, 3, 4)]
    entries = build_many([(AXPY, c) for c in cfgs + cfgs[:1]], tc, jobs=4)
    assert [e.path for e in entries] == [resolve(AXPY, c, tc).path for c in cfgs + cfgs[:1]]
    assert len(fake_cc.compiles()) == 4 and len(list_entries()) == 4 and _tmp_children() == []
    monkeypatch.setenv("FAKE_CC_FAIL", "kernel.hip(1): error: boom")
    with pytest.raises(CompileError, match="boom"):
        build_many([(AXPY, AxpyCfg(blockNum=b)) for b in (5, 6)], tc, jobs=2)
    assert len(list_entries()) == 4 and _tmp_children() == []
