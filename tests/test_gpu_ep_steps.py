"""The ranks' agreement and its bounded waits on NCCL, one rank per GPU (on a GPU machine:
``pytest -m gpu``): the CPU suite's jobs, on the GPUs. The records and counts travel as CUDA
tensors in asynchronous NCCL collectives, each polled until it completes."""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.distributed import run_distributed
from test_ep_bounded_waits_cpu import _close_meets_dispatch_job
from test_ep_steps_cpu import _capacity_job, _expert_major_job, _steps_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

JOBS = {"steps": _steps_job, "expert_major": _expert_major_job, "capacity": _capacity_job,
        "close_meets_dispatch": _close_meets_dispatch_job}


@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.parametrize("ws", [2, 8])
def test_torch_backend_agreement_on_nccl(ws, job):
    if torch.cuda.device_count() < ws:
        pytest.skip(f"NCCL needs a GPU per rank: {ws} ranks, {torch.cuda.device_count()} GPUs")
    run_distributed(JOBS[job], ws, backend="nccl", timeout=600)
