"""CPU tests of the GPU harness's placement (``mori_jit/testing/gpu_world.py``): where the ranks of
each world size go on a machine of 0, 1, 2 or 8 GPUs, and which process-group backend they use."""
from __future__ import annotations

import pytest

from mori_jit.testing.gpu_world import Placement, placement


@pytest.mark.parametrize("ws,gpus,want", [
    (1, 1, Placement(1, 1, 1, "nccl")),
    (2, 1, Placement(2, 1, 2, "gloo")),   # two ranks on one GPU: NCCL refuses it
    (8, 1, Placement(8, 1, 8, "gloo")),
    (2, 2, Placement(2, 2, 1, "nccl")),
    (8, 2, Placement(8, 2, 4, "gloo")),
    (3, 2, Placement(3, 2, 2, "gloo")),   # ranks 0 and 2 share GPU 0
    (4, 8, Placement(4, 4, 1, "nccl")),   # only the GPUs needed
    (2, 0, Placement(2, 0, 0, "gloo")),   # no GPU: the tests skip
])
def test_ranks_go_round_robin_and_share_a_gpu_only_when_they_must(ws, gpus, want):
    assert placement(ws, gpus) == want



def test_a_busy_device_is_retried_and_any_other_error_raised(monkeypatch):
    """set_device_when_free: "busy or unavailable" (CUDA MPS tearing down killed clients) is retried
    until the device is free or the bound passes; other errors are raised at once."""
    import torch

    from mori_jit.testing import distributed

    calls = []

    def flaky(index, busy_times):
        calls.append(index)
        if len(calls) <= busy_times:
            raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")

    monkeypatch.setattr(distributed.time, "sleep", lambda s: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: flaky(i, 3))
    distributed.set_device_when_free(1)
    assert calls == [1, 1, 1, 1]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: flaky(i, 10 ** 6))
    with pytest.raises(RuntimeError, match="busy or unavailable"):
        distributed.set_device_when_free(0, retry_s=0.05)
    calls.clear()

    def broken(index):
        calls.append(index)
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "set_device", broken)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        distributed.set_device_when_free(5)
    assert calls == [5]


def test_a_daemon_left_by_a_killed_run_is_joined_through_its_pipe_folder(monkeypatch, tmp_path):
    """A control daemon this process did not start (a killed run's, with its own pipe folder) is
    found by its pipe folder and the ranks are pointed there; without it they would share the GPU
    without MPS."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    from mori_jit.testing import gpu_world

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    # a stand-in process whose name and command line are the control daemon's, with a private pipe folder
    fake = tmp_path / gpu_world._MPS_CONTROL
    shutil.copy("/bin/sleep", fake)
    pipe = str(tmp_path / "pipe")
    proc = subprocess.Popen([str(fake), "30"], env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe})
    try:
        for _ in range(100):
            if gpu_world._running_daemon_pipe() == pipe:
                break
            time.sleep(0.02)
        monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
        assert gpu_world._daemon_running()
        gpu_world._join_running_daemon()
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    finally:
        proc.kill()
        proc.wait()


def test_after_a_failed_job_the_next_waits_for_the_mps_server_to_take_clients(monkeypatch):
    """wait_for_mps_clients: polls cuInit in a fresh process while it answers
    CUDA_ERROR_MPS_SERVER_NOT_READY, returns at the first other answer (None: no driver to ask),
    and gives up at its bound."""
    from mori_jit.testing import gpu_world

    monkeypatch.setattr(gpu_world.time, "sleep", lambda s: None)
    answers = [gpu_world.CUDA_ERROR_MPS_SERVER_NOT_READY] * 3 + [0]
    assert gpu_world.wait_for_mps_clients(probe=lambda: answers.pop(0)) is True
    assert answers == []
    assert gpu_world.wait_for_mps_clients(probe=lambda: None) is True
    assert gpu_world.wait_for_mps_clients(timeout_s=0.0, probe=lambda: gpu_world.CUDA_ERROR_MPS_SERVER_NOT_READY) is False


def test_the_cuinit_probe_runs_in_a_fresh_process():
    """cu_init_code: cuInit's code where a driver library loads, None where none does (this is the
    probe itself, run for real: no GPU driver here gives None, one gives an int)."""
    import ctypes

    from mori_jit.testing import gpu_world

    try:
        ctypes.CDLL("libcuda.so.1")
        has_driver = True
    except OSError:
        has_driver = False
    code = gpu_world.cu_init_code()
    assert (isinstance(code, int)) if has_driver else (code is None)
