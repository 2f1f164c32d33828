"""Cleaning the cache removes only what is provably the cache's, and killed builds do not pile up.

* ``cache clear`` / ``cache verify --remove`` on a folder that holds a user's files (a cache dir
  pointed at a home-like folder) remove none of them and list each one left;
* a folder that is neither empty nor marked as mori-jit's is not written into;
* on a real cache, ``clear`` removes entries, lock files, stale builds, kept failed sources and
  legacy template bytecode, and leaves a live build, an entry holding a user's file, and the marker;
* a killed compile's build dir is counted by ``cache ls`` and removed by the next compile once no
  process holds it and it is older than the bound; a live one is left.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from mori_jit.cli import main
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
from mori_jit.jit import cache, cache_builds
from mori_jit.jit.compile import build
from mori_jit.jit.toolchain import make_toolchain

ARCH = "sm_90a"

#: A user's folder that looks like the cache's tree in places (names the old clear matched).
HOME_FILES = ["tmp/notes.txt", "failed/exam.pdf", "locks/door.txt", "sm_90_results/run1.csv",
              "gfx900_thesis/ch1.tex", "src/kernel.linux-6.8/Makefile", f"locks/{'a' * 64}.lock",
              f"tmp/{'b' * 32}/draft.txt", "sm_90a_none/kernel.mine.txt", "jinja/__jinja2_x.cache", "kernel.config"]


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _home_like(root: Path) -> list[Path]:
    paths = [root / rel for rel in HOME_FILES]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"the user's {p.name}")
    return paths


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("verb", [["cache", "clear"], ["cache", "verify", "--remove"]])
def test_cleaning_a_home_like_folder_removes_none_of_its_files(fake_cc, capsys, verb):
    root = cache.cache_root()
    paths = _home_like(root)
    rc, out, err = _cli(capsys, *verb)
    assert all(p.read_text() == f"the user's {p.name}" for p in paths), _files_under(root)
    assert rc == 0, err
    if verb[1] == "clear":
        assert "removed nothing" in out
        for top in ("tmp/notes.txt", "sm_90_results", "gfx900_thesis", "src", "kernel.config", "jinja/__jinja2_x"):
            assert f"left     {top}" in out, out


def test_a_home_like_folder_is_not_used_as_a_cache(fake_cc, capsys):
    root = cache.cache_root()
    _home_like(root)
    before = _files_under(root)
    rc, _, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH)
    assert rc == 1 and f"MORI_JIT_CACHE_DIR={root} is not a mori-jit cache" in err and "gfx900_thesis" in err, err
    assert _files_under(root) == before  # nothing written: no marker, no entry, no build dir


def test_an_empty_folder_becomes_a_marked_cache(fake_cc, capsys):
    root = cache.cache_root()
    root.mkdir(parents=True)
    assert _cli(capsys, "compile", "example_axpy", "--arch", ARCH)[0] == 0
    assert (root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")


def test_clear_removes_the_caches_own_and_lists_what_it_leaves(fake_cc, capsys, monkeypatch):
    root = cache.cache_root()
    tc = make_toolchain(ARCH)
    keep = build(AXPY, AxpyCfg(vecElems=4), tc)
    (keep.path / "notes.txt").write_text("a user's note in an entry")
    build(AXPY, AxpyCfg(), tc)
    monkeypatch.setenv("FAKE_CC_FAIL", "boom")
    monkeypatch.setenv("MORI_JIT_KEEP_FAILED", "1")
    assert _cli(capsys, "compile", "example_axpy", "--arch", ARCH, "--set", "vecElems=2")[0] == 1
    (root / "jinja").mkdir(exist_ok=True)  # (older versions kept template bytecode there)
    (root / "jinja" / f"__jinja2_{'c' * 40}.cache").write_bytes(b"old bytecode")
    stale, live = root / "tmp" / ("d" * 32), root / "tmp" / ("e" * 32)
    for d in (stale, live):
        d.mkdir()
        (d / cache.SOURCE_NAME).write_text("x")
        os.utime(d, (time.time() - 3600,) * 2)
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build in progress
        rc, out, err = _cli(capsys, "cache", "clear")
    finally:
        os.close(fd)
    assert rc == 0, err
    # (bookkeeping: 3 lock files, a kept failed source, a legacy bytecode file)
    assert "removed 1 entries, 1 build dirs, 5 bookkeeping files from" in out, out
    assert f"left     {keep.path.relative_to(root)}: an entry holding what mori-jit did not make: notes.txt" in out
    assert f"left     tmp/{'e' * 32}: a build in progress" in out, out
    assert sorted(p.name for p in root.iterdir()) == ["CACHEDIR.TAG", "sm_90a_none", "tmp"]
    assert cache.list_entries() == [keep.path] and (keep.path / "notes.txt").exists()
    assert not stale.exists() and live.exists()


def test_verify_remove_leaves_a_corrupt_entry_holding_a_users_file(fake_cc, capsys):
    entry = build(AXPY, AxpyCfg(), make_toolchain(ARCH))
    entry.binary.write_bytes(b"x")
    (entry.path / "notes.txt").write_text("mine")
    rc, out, err = _cli(capsys, "cache", "verify", "--remove")
    assert rc == 1 and "could not be removed" in err, err
    assert "an entry holding what mori-jit did not make: notes.txt" in out and (entry.path / "notes.txt").exists()


# -- killed compiles -------------------------------------------------------------------------------

def _start_compile(vec: int) -> subprocess.Popen:
    env = {**os.environ, "FAKE_CC_SLEEP": "120", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "mori_jit", "compile", "example_axpy", "--arch", ARCH,
                             "--set", f"vecElems={vec}"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _build_dirs() -> list[Path]:
    tmp = cache.cache_root() / "tmp"
    return sorted(tmp.iterdir()) if tmp.is_dir() else []


def test_killed_compiles_are_counted_then_removed_by_the_next_compile(fake_cc, capsys):
    procs = [_start_compile(v) for v in (2, 4)]
    try:
        deadline = time.time() + 120
        while sum((d / cache.SOURCE_NAME).exists() for d in _build_dirs()) < 2:
            assert time.time() < deadline and all(p.poll() is None for p in procs), "the compiles did not start"
            time.sleep(0.1)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    killed = _build_dirs()
    assert len(killed) == 2
    rc, out, _ = _cli(capsys, "cache", "ls")
    assert rc == 0 and "2 build dirs in tmp/ (0 left by killed compiles" in out, out  # too young to tell
    live = cache.cache_root() / "tmp" / ("f" * 32)
    live.mkdir()
    for d in killed + [live]:
        os.utime(d, (time.time() - 2 * cache_builds.STALE_BUILD_S,) * 2)
    rc, out, _ = _cli(capsys, "cache", "ls")
    assert "3 build dirs in tmp/ (3 left by killed compiles" in out, out
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a compile still running (in another process)
        assert _cli(capsys, "cache", "ls")[1].count("3 build dirs in tmp/ (2 left by killed compiles") == 1
        assert _cli(capsys, "compile", "example_axpy", "--arch", ARCH)[0] == 0
        assert _build_dirs() == [live]
    finally:
        os.close(fd)
