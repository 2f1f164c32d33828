"""Stopping builds: Ctrl-C, SIGTERM and SIGHUP end ``mori-jit precompile`` (and an interrupted
``build_many``) at once: no kernel starts after the signal, every running compiler is killed with
the processes it started, no build directory is left, and the CLI exits 128 + the signal with its
summary line.

Deterministic: the fake compiler sleeps for a minute in a child process (as nvcc runs cicc), the
test signals only once the log shows both compiles of ``-j 2`` running, and a stop must end the
command within :data:`PROMPT_S`, well inside that minute.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
from mori_jit.jit import cache, procs
from mori_jit.jit.compile import build
from mori_jit.jit.toolchain import make_toolchain

SLEEP_S = 60
PROMPT_S = 15


def _pids(path: Path) -> list[int]:
    return [int(w) for w in path.read_text().split()] if path.exists() else []


def _wait_for_children(path: Path, n: int, timeout_s: float = 60) -> list[int]:
    """The pids of the first ``n`` compilers' sleeping children, once they all run."""
    deadline = time.monotonic() + timeout_s
    while len(_pids(path)) < n:
        assert time.monotonic() < deadline, f"{n} compiles did not start within {timeout_s}s"
        time.sleep(0.05)
    return _pids(path)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie has ended)


def _kill_leftovers(pids) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def sleepy_cc(fake_cc, monkeypatch, tmp_path):
    """The fake compiler, sleeping :data:`SLEEP_S` in a child whose pid goes to ``children.txt``."""
    children = tmp_path / "children.txt"
    monkeypatch.setenv("FAKE_CC_SLEEP", str(SLEEP_S))
    monkeypatch.setenv("FAKE_CC_SLEEP_IN_CHILD", str(children))
    fake_cc.children = children
    return fake_cc


def _as_in_a_terminal() -> None:
    """In the child before its exec: Ctrl-C's default disposition, as a foreground command's. A
    test run started in the background of a non-interactive shell (``pytest &``, ``nohup``) has
    SIGINT ignored, and an ignored signal stays ignored across exec (Python then installs no
    KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # (a session of its own: the test sends SIGINT to its process group, as a terminal does on Ctrl-C)
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_as_in_a_terminal)


def _assert_stopped_cleanly(cc, proc: subprocess.Popen, sig: int, to_group: bool) -> tuple[str, str]:
    children = _wait_for_children(cc.children, 2)
    compilers = [c["pid"] for c in cc.compiles()]
    try:
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=PROMPT_S)
        took = time.monotonic() - t0
    finally:  # (whatever a failing stop left: the command, and every compiler logged so far)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _kill_leftovers([c["pid"] for c in cc.compiles()] + _pids(cc.children))
    assert took < PROMPT_S
    assert len(cc.compiles()) == 2, "a compile started after the signal"
    assert not [p for p in compilers + children if _alive(p)], "a compiler outlived the stop"
    assert list((cache.cache_root() / "tmp").iterdir()) == [], "a build directory was left"
    assert cache.list_entries() == []
    return out, err


@pytest.mark.parametrize("sig,to_group,message", [
    (signal.SIGINT, True, "mori-jit: interrupted"),  # Ctrl-C: the terminal signals the process group
    (signal.SIGTERM, False, "mori-jit: stopped by SIGTERM"),  # kill PID
    (signal.SIGHUP, False, "mori-jit: stopped by SIGHUP"),  # the terminal closed
])
def test_a_signal_stops_precompile_at_once(sleepy_cc, sig, to_group, message):
    proc = _spawn(["-m", "mori_jit", "precompile", "--arch", "sm_90a", "-j", "2"])
    out, err = _assert_stopped_cleanly(sleepy_cc, proc, sig, to_group)
    assert proc.returncode == 128 + sig and err == message + "\n", (proc.returncode, err)
    n = int(re.match(r"precompiling (\d+) kernels", out).group(1))
    assert len(re.findall(r"^\[\d/\d\] \S+ +stopped +\d+\.\d\ds$", out, re.M)) == 2, out
    assert re.search(rf"^stopped after \d+\.\ds: 0 compiled, 0 hit, 0 failed, 2 stopped, {n - 2} not started$",
                     out, re.M), out


def test_an_interrupted_build_many_kills_its_compiles(sleepy_cc):
    code = textwrap.dedent("""
        from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
        from mori_jit.jit.compile import build_many
        from mori_jit.jit.toolchain import make_toolchain
        build_many([(AXPY, AxpyCfg(blockNum=b)) for b in (1, 2, 3, 4)], make_toolchain("sm_90a"), jobs=2)
    """)
    proc = _spawn(["-c", code])
    _, err = _assert_stopped_cleanly(sleepy_cc, proc, signal.SIGINT, True)
    assert proc.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt"), err


def test_a_halted_build_raises_stopped_and_compiles_run_again_after(sleepy_cc, monkeypatch):
    tc = make_toolchain("sm_90a")
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(build, AXPY, AxpyCfg(blockNum=5), tc)
        (child,) = _wait_for_children(sleepy_cc.children, 1)
        t0 = time.monotonic()
        procs.halt([fut])
        assert time.monotonic() - t0 < PROMPT_S and not _alive(child)
        with pytest.raises(procs.Stopped, match="killed by SIGTERM: the build was stopped"):
            fut.result()
    monkeypatch.delenv("FAKE_CC_SLEEP")
    assert build(AXPY, AxpyCfg(blockNum=5), tc).binary.is_file()  # (the stop is over)


def test_no_compile_starts_while_a_stop_is_in_progress(sleepy_cc):
    tc = make_toolchain("sm_90a")
    started, release = threading.Event(), threading.Event()

    def stop_held():  # a build that ends only when released, so the stop stays in progress meanwhile
        started.set()
        release.wait(PROMPT_S)

    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(stop_held)
        started.wait(PROMPT_S)
        halting = threading.Thread(target=procs.halt, args=([held],), kwargs={"grace_s": PROMPT_S})
        halting.start()
        try:
            deadline = time.monotonic() + PROMPT_S
            while not procs._stopping and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(procs.Stopped, match="not started: the build is being stopped"):
                build(AXPY, AxpyCfg(blockNum=6), tc)
        finally:
            release.set()
            halting.join()
    assert sleepy_cc.compiles() == []
