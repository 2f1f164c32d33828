"""Run a function on several CPU processes joined by a gloo process group (test helper).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` inside an initialised default gloo group. A worker exception
fails the caller with the worker's traceback text; a hang fails it after ``timeout`` seconds
instead of blocking CI. ``fn`` must be a module-level (picklable) function.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: How long a worker retries a GPU the driver reports "busy or unavailable" (CUDA MPS refuses new
#: clients while its server still tears down the contexts of killed ones: a previous job's).
DEVICE_BUSY_RETRY_S = 30.0


def set_device_when_free(index: int, retry_s: float = DEVICE_BUSY_RETRY_S) -> None:
    """``torch.cuda.set_device(index)``, retried every 0.5 s for up to ``retry_s`` while the device
    is "busy or unavailable"; any other error, or that one past the bound, is raised."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            torch.cuda.set_device(index)
            return
        except RuntimeError as e:  # (torch.AcceleratorError is a RuntimeError)
            if "busy or unavailable" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _worker(rank: int, fn, world_size: int, port: int, timeout: float, errors, args: tuple,
            backend: str = "gloo", gpus: int = 0) -> None:
    # Keep gloo on loopback: container hostnames often resolve to unreachable addresses.
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Several processes share few cores; intra-op threads would only oversubscribe them.
    torch.set_num_threads(1)
    if gpus:  # ranks round-robin over the GPUs (several per GPU when there are fewer GPUs than ranks)
        set_device_when_free(rank % gpus)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        # A collective whose peer died errors out instead of waiting forever.
        timeout=datetime.timedelta(seconds=timeout),
    )
    # Whatever ends the parent's wait while this worker runs (its deadline, pytest's timeout, an
    # interrupt), the parent asks for this worker's stacks before killing it: where a hang is.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # Report before tearing the group down: peers then fail with secondary errors
        # ("connection reset"), and the parent orders reports by time to show the root cause first.
        # Tail only: a report must fit the pipe buffer, as the parent reads only after a failure.
        errors.put((time.time(), rank, traceback.format_exc()[-6000:]))
        # Tearing an NCCL group down while a peer is inside a collective hangs; exit at once.
        os._exit(1)
    # What of the job is left in reference cycles (an op kept alive by a caught exception's
    # traceback) may hold the process group; collected at interpreter exit, after the group is
    # destroyed, it intermittently aborts the worker (std::terminate) although the job passed.
    gc.collect()
    dist.destroy_process_group()


def _drain(errors) -> str:
    """All worker tracebacks reported so far, earliest first."""
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    reports.sort()
    return "\n".join(f"--- rank {rank} ---\n{tb}" for _, rank, tb in reports)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo",
                    gpus: int = 0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes and wait for all.

    ``backend`` is the process-group backend: ``gloo`` or ``nccl`` (one rank per GPU). With
    ``gpus`` > 0, rank r makes GPU ``r % gpus`` its current device (NCCL needs ``gpus >= world_size``).

    Raises:
        AssertionError: a worker raised or died; the message holds every reported traceback,
            earliest first (the first is usually the root cause, later ones its echoes).
        TimeoutError: not all workers finished within ``timeout`` seconds (they are killed).
    """
    if backend == "nccl" and not gpus:
        gpus = world_size  # rank r on GPU r
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"nccl needs a GPU per rank: world_size {world_size}, gpus {gpus} (use gloo)")
    port = free_port()
    errors = mp.get_context("spawn").SimpleQueue()
    ctx = mp.spawn(_worker, args=(fn, world_size, port, timeout, errors, args, backend, gpus),
                   nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    name = getattr(fn, "__name__", repr(fn))
    try:
        while True:
            try:
                # Raises as soon as any worker fails (and terminates the rest); True once all are done.
                if ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                    return
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                reports = _drain(errors) or str(e)
                raise AssertionError(f"distributed job {name!r} (world_size {world_size}) failed:\n"
                                     f"{reports}") from None
            if time.monotonic() >= deadline:
                alive = [p.pid for p in ctx.processes if p.is_alive()]
                raise TimeoutError(f"distributed job {name!r} with world_size {world_size} did not "
                                   f"finish within {timeout} s (killed pids {alive})\n{_drain(errors)}")
    finally:  # whatever ends the wait (a failure, the deadline, an interrupt), no worker outlives it
        _dump_stacks([p for p in ctx.processes if p.is_alive()])
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(5)


def _dump_stacks(alive) -> None:
    """Ask each live worker, one after the other, to print its threads' stacks to its stderr (the
    worker registered the signal with faulthandler), so that the dumps do not interleave."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        time.sleep(0.3)
