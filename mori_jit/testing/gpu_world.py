"""Where the GPU tests' ranks run: one rank per GPU when there are enough GPUs, otherwise several
ranks per GPU, on the IPC arena provider and gloo, under CUDA MPS.

Ranks that share a GPU spin-wait on each other's kernels, so they must run concurrently: MPS does
that (plain time slicing only makes them crawl into their timeouts). :func:`run_gpu_job` starts an
MPS control daemon with private pipe and log folders when a job shares a GPU and none runs yet, and
:func:`stop_mps` (called when the pytest run ends, and at exit) stops the daemon it started. After a
failed shared-GPU job, :func:`wait_for_mps_clients` holds the next one until the MPS server, which
recovers from the failed ranks' terminated contexts, takes clients again.
NCCL refuses two ranks on one GPU, so such jobs use gloo (the golden check and the torch backend
run on it too). No timing from several ranks on one GPU measures anything but the protocol.

``MORI_EP_TEST_WORLD_SIZES`` (comma-separated, default ``1,2,4,8``) selects the world sizes.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from mori_jit.ops.ep import knobs
from mori_jit.testing.distributed import run_distributed

__all__ = ["WORLD_SIZES", "Placement", "placement", "gpu_count", "mps_unavailable", "GpuWorldUnavailable",
           "run_gpu_job", "run_ep_job", "stop_mps", "wait_for_mps_clients"]

WORLD_SIZES = knobs.ep.test_world_sizes

_MPS_CONTROL = "nvidia-cuda-mps-control"


def gpu_count() -> int:
    """Visible GPUs (0 without CUDA/ROCm)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Placement(NamedTuple):
    """How a job of ``world_size`` ranks lands on ``gpus`` GPUs."""

    world_size: int
    gpus: int
    ranks_per_gpu: int  # the most ranks on one GPU
    backend: str  # the process group's: nccl with a GPU per rank, gloo otherwise


def placement(world_size: int, gpus: Optional[int] = None) -> Placement:
    """Ranks round-robin over the GPUs (rank r on GPU ``r % gpus``)."""
    gpus = gpu_count() if gpus is None else gpus
    used = min(gpus, world_size)
    per = -(-world_size // used) if used else 0
    return Placement(world_size, used, per, "nccl" if per == 1 else "gloo")


_DEFAULT_PIPE = "/tmp/nvidia-mps"  # (MPS's pipe folder when CUDA_MPS_PIPE_DIRECTORY is unset)


def _running_daemon_pipe() -> Optional[str]:
    """The pipe folder of a running MPS control daemon (the one this process started, or another
    one), "" when one runs whose environment cannot be read, None when none runs."""
    if _MPS.dirs:
        return _MPS.dirs[0]
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:  # (a process name is cut to 15 characters: "nvidia-cuda-mps")
            if comm.read_text().strip() != _MPS_CONTROL[:15] or "control" not in (comm.parent / "cmdline").read_text():
                continue
        except OSError:
            continue
        try:
            env = dict(v.split("=", 1) for v in (comm.parent / "environ").read_text().split("\0") if "=" in v)
        except OSError:
            return ""
        return env.get("CUDA_MPS_PIPE_DIRECTORY", _DEFAULT_PIPE)
    return None


def _daemon_running() -> bool:
    """Whether an MPS control daemon runs (the one this process started, or another one)."""
    return _running_daemon_pipe() is not None


def _join_running_daemon() -> None:
    """Point the ranks, spawned later, at the running daemon's pipe folder: a daemon left by a run
    that was killed (its private folder unknown to this process) would otherwise serve no rank, and
    the ranks would share the GPU without MPS (NVSHMEM then refuses its team calls as "limited MPG")."""
    pipe = _running_daemon_pipe()
    if pipe:
        os.environ.update({"CUDA_MPS_PIPE_DIRECTORY": pipe})


def mps_unavailable() -> Optional[str]:
    """Why MPS cannot be used here (None when it can: a daemon runs, or this process can start one)."""
    if torch.version.hip is not None:
        return None  # ROCm runs kernels of several processes concurrently without a daemon
    if shutil.which(_MPS_CONTROL) is None:
        return f"{_MPS_CONTROL} is not installed"
    if _daemon_running():
        return None
    if os.geteuid() != 0:
        return f"no MPS daemon runs and starting one ({_MPS_CONTROL} -d) needs root"
    return None


class _Mps:
    """The daemon this process started: its folders and the environment it changed."""

    def __init__(self):
        self.dirs: list[str] = []
        self.saved: dict[str, Optional[str]] = {}

    def start(self) -> None:
        pipe, log = tempfile.mkdtemp(prefix="mori-mps-pipe-"), tempfile.mkdtemp(prefix="mori-mps-log-")
        env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
        subprocess.run([_MPS_CONTROL, "-d"], env={**os.environ, **env}, check=True, timeout=30)
        self.dirs = [pipe, log]
        self.saved = {k: None for k in env} | {k: v for k, v in os.environ.items() if k in env}
        os.environ.update(env)  # the ranks, spawned later, inherit it and connect to this daemon

    def _kill_daemon(self) -> None:
        """SIGKILL the MPS processes that run with this daemon's pipe folder."""
        mark = f"CUDA_MPS_PIPE_DIRECTORY={self.dirs[0]}".encode()
        for env in Path("/proc").glob("[0-9]*/environ"):
            try:
                if (env.parent / "comm").read_text().strip() == _MPS_CONTROL[:15] and mark in env.read_bytes():
                    os.kill(int(env.parent.name), 9)
            except (OSError, ValueError):
                continue

    def stop(self) -> None:
        if not self.dirs:
            return
        try:
            subprocess.run([_MPS_CONTROL], input="quit\n", text=True, env=dict(os.environ), timeout=30,
                           capture_output=True)
        except subprocess.TimeoutExpired:  # a client still holds it: end the daemon and its server
            self._kill_daemon()
        finally:
            for k, v in self.saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ.update({k: v})
            for d in self.dirs:
                shutil.rmtree(d, ignore_errors=True)
            self.dirs, self.saved = [], {}


_MPS = _Mps()
atexit.register(_MPS.stop)


def stop_mps() -> None:
    """Stop the MPS daemon this process started (no-op otherwise)."""
    _MPS.stop()


#: CUDA's CUDA_ERROR_MPS_SERVER_NOT_READY: what cuInit returns while the MPS server recovers from
#: clients that died inside a context (a failed job's ranks, terminated by their spawner).
CUDA_ERROR_MPS_SERVER_NOT_READY = 807
#: How long the job after a failed one may wait for the MPS server to take clients again.
MPS_RECOVERY_S = 60.0
_CU_INIT_PROBE = "import ctypes; print(ctypes.CDLL('libcuda.so.1').cuInit(0))"


def cu_init_code() -> Optional[int]:
    """cuInit's result in a fresh process (this one may hold a context already); None when the
    driver library cannot be loaded or the probe fails otherwise."""
    try:
        run = subprocess.run([sys.executable, "-c", _CU_INIT_PROBE], capture_output=True, text=True, timeout=30,
                             env=dict(os.environ))
        return int(run.stdout.strip()) if run.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def wait_for_mps_clients(timeout_s: float = MPS_RECOVERY_S, probe: Callable[[], Optional[int]] = cu_init_code,
                         poll_s: float = 0.5) -> bool:
    """Wait until a new process's cuInit no longer fails with CUDA_ERROR_MPS_SERVER_NOT_READY, at
    most ``timeout_s``; whether the server takes clients (True also when the probe cannot tell)."""
    deadline = time.monotonic() + timeout_s
    while probe() == CUDA_ERROR_MPS_SERVER_NOT_READY:
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class GpuWorldUnavailable(RuntimeError):
    """This machine cannot host the job's ranks (no GPU; ranks that must share a GPU and no MPS); the
    message says why."""


def run_gpu_job(fn, world_size: int, *args, timeout: float = 600.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks placed by :func:`placement`
    (several per GPU under an MPS daemon, started here when none runs). Raises
    :class:`GpuWorldUnavailable` before starting anything when the machine cannot host them."""
    where = placement(world_size)
    if where.gpus == 0:
        raise GpuWorldUnavailable("needs a CUDA/ROCm GPU")
    if where.ranks_per_gpu > 1:
        why = mps_unavailable()
        if why:
            raise GpuWorldUnavailable(f"{world_size} ranks on {where.gpus} GPU(s) need CUDA MPS: {why}")
        if torch.version.hip is None:
            _join_running_daemon() if _daemon_running() else _MPS.start()
    try:
        run_distributed(fn, world_size, *args, timeout=timeout, backend=where.backend, gpus=where.gpus)
    except Exception:  # (not on Ctrl-C: nothing follows then)
        # The spawner terminated the failed job's other ranks inside their contexts: the next job's
        # ranks would find the MPS server recovering (cuInit fails) and fail for no fault of theirs.
        if where.ranks_per_gpu > 1 and torch.version.hip is None:
            wait_for_mps_clients()
        raise


def run_ep_job(fn, world_size: int, *args, timeout: float = 600.0) -> None:
    """:func:`run_gpu_job` for a pytest test: skips it where the machine cannot host the ranks."""
    import pytest

    try:
        run_gpu_job(fn, world_size, *args, timeout=timeout)
    except GpuWorldUnavailable as e:
        pytest.skip(str(e))
