"""Compiler processes, and stopping them: a stop kills every running compile and starts no new one.

Each compiler command runs in a process group of its own (a new session), registered while it
runs. Its own group, because nvcc and hipcc are drivers: nvcc runs cicc and ptxas, hipcc runs
clang, and a signal to the driver alone would leave those running, orphaned, writing into a build
directory that is being removed. Killing the group ends them all.

Being outside the terminal's process group, a compiler no longer gets the terminal's Ctrl-C
itself; Python does, and decides:

* the thread waiting on a compile that is interrupted (a build in the main thread gets
  ``KeyboardInterrupt``, or the exception a signal handler raises) kills that compile's group;
* builds in worker threads are stopped by :func:`halt`, which the thread that was interrupted
  calls: no compile starts from then on (:func:`run` raises :class:`Stopped` at once), every
  running group gets SIGTERM, then SIGKILL if it outlives ``grace_s``, and once every started
  build has ended, compiles may start again.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from concurrent.futures import Future, wait
from typing import Sequence

__all__ = ["Stopped", "run", "halt", "STOP_GRACE_S"]

#: How long a stopped compiler has, after SIGTERM, to exit (and remove its own temporary files)
#: before its group gets SIGKILL: nvcc and hipcc exit at once on SIGTERM, so this only bounds a
#: compiler that ignores it.
STOP_GRACE_S = 2.0

_lock = threading.Lock()
_running: set[subprocess.Popen] = set()
_stopped: set[subprocess.Popen] = set()
_stopping = False


class Stopped(Exception):
    """A compile was stopped (:func:`halt`) before it ran or before it finished."""


def run(cmd: Sequence[str], *, env: dict[str, str], cwd: os.PathLike | str,
        pass_fds: Sequence[int] = ()) -> tuple[int, str]:
    """Run one compiler command to its end: ``(exit status, stderr then stdout)``; ``pass_fds``
    stay open in it (as :class:`subprocess.Popen` keeps them).

    Raises :class:`Stopped` while a stop is in progress (nothing is started) or when a stop killed
    it, and ``OSError`` when it cannot be started. An exception in the waiting thread (an
    interrupt) kills the command's group before it propagates.
    """
    with _lock:  # (a stop sees every compile that started before it, and none starts after it)
        if _stopping:
            raise Stopped(f"{os.path.basename(cmd[0])} not started: the build is being stopped")
        p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=cwd, pass_fds=tuple(pass_fds), start_new_session=True)
        _running.add(p)
    try:
        out, err = p.communicate()
    except BaseException:
        _signal_group(p, signal.SIGKILL)
        p.wait()
        raise
    finally:
        with _lock:
            _running.discard(p)
            stopped = p in _stopped
            _stopped.discard(p)
    if stopped and p.returncode < 0:
        raise Stopped(f"{os.path.basename(cmd[0])} killed by {signal.Signals(-p.returncode).name}: "
                      f"the build was stopped")
    return p.returncode, err + out


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.returncode is not None:  # (reaped: its pid, the group's id, may name another group now)
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:  # (the whole group has exited)
        pass


def _signal_all(sig: int) -> None:
    with _lock:
        for p in _running:
            _stopped.add(p)
            _signal_group(p, sig)


def halt(futures: Sequence[Future], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the builds of ``futures`` (each one calls :func:`run` for its compiles): cancel those
    not started, start no compile, kill the running ones (SIGTERM to each group, SIGKILL after
    ``grace_s``), and return once every started one has ended. Compiles may start again then.

    Every compile of the process is stopped, not only those of ``futures``: the caller was
    interrupted, and the process is ending its work.
    """
    global _stopping
    with _lock:
        _stopping = True
    try:
        for f in futures:
            f.cancel()
        _signal_all(signal.SIGTERM)
        try:
            if wait(futures, timeout=grace_s).not_done:
                _signal_all(signal.SIGKILL)
                wait(futures)
        except BaseException:  # interrupted again while waiting: no more grace, but still no build left running
            _signal_all(signal.SIGKILL)
            wait(futures)
            raise
    finally:
        with _lock:
            _stopping = False
