"""A cache that must never wedge, and removals whose outcome is told right (fake toolchain, CPU).

* an entry member (``meta.json``, the binary, the source) that is a directory is reported as
  corrupt, skipped by ``verify`` (which goes on with the other entries), removed by ``clear`` and
  rebuilt by the next compile;
* the first compile into a new cache on a full disk leaves no half-written ``CACHEDIR.TAG``;
* ``cache clear`` and ``cache verify --remove`` that cannot remove what they should exit non-zero;
* ``-save-temps`` in the flags leaves the published entry its three files (fake compiler, and
  Debian's hipcc where it is installed);
* ``MORI_JIT_EXTRA_FLAGS`` too long for ``meta.json`` is refused before anything compiles, and the
  longest allowed ones still give an entry that is read back.
Cases that need root (a tmpfs as the full disk, a second Unix user) skip without it.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import unix_users
from fake_compiler import output_for
from jit_helpers import toolchain_or_skip
from mori_jit.cli import main
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType
from mori_jit.jit import cache, knobs
from mori_jit.jit.compile import build
from mori_jit.jit.toolchain import make_toolchain

ARCH = "sm_90a"


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _build(cfg=None, arch=ARCH):
    return build(AXPY, cfg or AxpyCfg(), make_toolchain(arch))


def _rel(p: Path) -> str:
    return str(p.relative_to(cache.cache_root()))


def _make_dir_of(p: Path) -> None:
    p.unlink()
    p.mkdir()
    (p / "inside.txt").write_text("x")


@pytest.mark.parametrize("member", [cache.META_NAME, "kernel.cubin", cache.SOURCE_NAME])
def test_an_entry_member_that_is_a_directory_is_reported_skipped_cleared_and_rebuilt(fake_cc, capsys, member):
    entry, other = _build(), _build(AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4))
    good = entry.binary.read_bytes()
    _make_dir_of(entry.path / member)
    rc, out, err = _cli(capsys, "cache", "verify")
    assert rc == 1 and f"corrupt  {_rel(entry.path)}: {member} is not a regular file (d" in out, (out, err)
    assert "verified 2 entries" in out and "1 ok, 1 corrupt" in out and _rel(other.path) not in out, out
    rc, out, err = _cli(capsys, "cache", "ls")
    assert rc == 0 and "2 entries (1 corrupt)" in out, (out, err)
    again = _build()
    assert again.path == entry.path and again.binary.read_bytes() == good
    assert sorted(p.name for p in again.path.iterdir()) == sorted([cache.SOURCE_NAME, "kernel.cubin", cache.META_NAME])
    _make_dir_of(entry.path / member)
    rc, out, err = _cli(capsys, "cache", "clear")
    assert rc == 0 and "removed 2 entries" in out and "left" not in out, (out, err)
    assert cache.list_entries() == []


@pytest.fixture
def full_disk(tmp_path):
    """A directory on a tmpfs of 64 KiB that a file fills (root only: it mounts)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8): a small tmpfs stands for the full disk")
    mnt = tmp_path / "full-disk"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        with open(mnt / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_first_compile_into_a_new_cache_on_a_full_disk_leaves_no_marker_tmp(fake_cc, capsys, monkeypatch, full_disk):
    root = full_disk / "cache"
    monkeypatch.setenv("MORI_JIT_CACHE_DIR", str(root))
    rc, _, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH)
    assert rc == 1 and "No space left on device" in err and str(root / "CACHEDIR.TAG") in err, err
    assert sorted(p.name for p in root.iterdir()) == []


def test_clear_and_verify_remove_that_cannot_remove_exit_non_zero(fake_cc, capsys, monkeypatch):
    users = unix_users.ensure_users()
    owner, reader = users["mori-jit-test-owner"], users["mori-jit-test-reader"]
    base = unix_users.shared_tmpdir()
    try:
        root = base / "team-cache"
        monkeypatch.setenv("MORI_JIT_CACHE_DIR", str(root))
        entry = _build()
        entry.binary.write_bytes(b"damaged")  # (verify --remove has a corrupt entry to remove)
        unix_users.chown_tree(root, owner.pw_uid, owner.pw_gid)

        def as_reader():
            os.environ["MORI_JIT_SHARED_CACHE"] = "1"
            results = {}
            for verb in (["cache", "clear"], ["cache", "verify", "--remove"]):
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = main(verb)
                results[verb[1]] = rc, out.getvalue(), err.getvalue()
            return results

        for verb, (rc, out, err) in unix_users.run_as(reader, as_reader).items():
            assert rc == 1 and f"left     {_rel(entry.path)}: cannot remove it: Permission denied" in out, (verb, out)
            assert "could not be removed (listed above)" in err, (verb, err)
        assert entry.path.is_dir() and cache.list_entries() == [entry.path]
    finally:
        shutil.rmtree(base)
        unix_users.remove_users()


def test_save_temps_leaves_the_entry_its_three_files_and_clear_removes_it(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", "-save-temps")
    entry = _build(arch="gfx90a")
    assert "-save-temps" in fake_cc.compiles()[-1]["argv"]
    assert sorted(p.name for p in entry.path.iterdir()) == sorted([cache.SOURCE_NAME, "kernel.hsaco", cache.META_NAME])
    assert entry.read_binary() == output_for((entry.path / cache.SOURCE_NAME).read_bytes())
    rc, out, err = _cli(capsys, "cache", "clear")
    assert rc == 0 and "removed 1 entries" in out and "left" not in out, (out, err)
    assert cache.list_entries() == [] and not (cache.cache_root() / "tmp").exists()


def test_real_hipcc_save_temps_stay_out_of_the_entry(monkeypatch):
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", "-save-temps")
    tc = toolchain_or_skip("gfx90a")
    entry = build(AXPY, AXPY.make_cfg(tc, {}), tc)
    assert sorted(p.name for p in entry.path.iterdir()) == sorted([cache.SOURCE_NAME, "kernel.hsaco", cache.META_NAME])


def test_extra_flags_too_long_for_meta_json_are_refused_before_compiling(fake_cc, capsys, monkeypatch):
    flags = " ".join(["-DA"] * 10300)  # (41 KB; meta.json lists them one a line: over 64 KiB)
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", flags)
    rc, _, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH)
    assert rc == 1 and err.count("\n") == 1 and fake_cc.compiles() == [], err
    limit = knobs.CompilerKnobs.extra_flags.max_bytes
    assert f"MORI_JIT_EXTRA_FLAGS is {len(flags)} bytes long; at most {limit} are allowed" in err, err
    assert cache.list_entries() == []
    # the longest flags allowed still give an entry that is read back: one compile, then hits
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", " ".join(["-DA"] * ((limit + 1) // 4)))
    for _ in range(2):
        assert _cli(capsys, "compile", "example_axpy", "--arch", ARCH)[0] == 0
    assert len(fake_cc.compiles()) == 1
