"""The torch backend's MoE features and the worked MoE block on NCCL, one rank per GPU (on a GPU
machine: ``pytest -m gpu``): the CPU suite's jobs, on the GPUs."""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.distributed import run_distributed
from test_ep_moe_cpu import _features_job
from test_ep_moe_layer_cpu import MODES, _layer_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


def _gpus_for(ws: int) -> None:
    if torch.cuda.device_count() < ws:
        pytest.skip(f"NCCL needs a GPU per rank: {ws} ranks, {torch.cuda.device_count()} GPUs")


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_torch_backend_moe_features_on_nccl(ws):
    _gpus_for(ws)
    run_distributed(_features_job, ws, backend="nccl", timeout=600)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ws", [2, 4, 8])
def test_moe_block_on_nccl_matches_the_dense_block(ws, mode):
    _gpus_for(ws)
    run_distributed(_layer_job, ws, mode, backend="nccl", timeout=600)
