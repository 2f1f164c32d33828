"""Rank masking on the hip backend's intranode kernels (``pytest -m gpu``; docs/design.md §6, "Rank
masking"): the jobs of ``ep_mask_jobs.py`` at 4 and 8 ranks (several per GPU under MPS where the
machine has fewer GPUs): a masked rank's experts removed from the golden check, a reset among the
survivors and the masked rank's return, a rank lost (exited, or stopped) mid-run, and a graph
captured before the mask replayed after it."""
from __future__ import annotations

import pytest
import torch

from ep_mask_jobs import graph_after_mask_job, lost_rank_job, mask_and_rejoin_job
from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

SIZES = [ws for ws in WORLD_SIZES if ws >= 3]
#: the kernels' wait bound in the lost-rank jobs: the survivors must raise within twice it
TIMEOUT_S = "3"


def _dev() -> str:
    return "cuda"


@pytest.mark.parametrize("moe", [False, True], ids=["plain", "moe"])
@pytest.mark.parametrize("ws", SIZES)
def test_mask_reset_among_survivors_and_rejoin(ws, moe):
    run_ep_job(mask_and_rejoin_job, ws, "hip", moe, _dev(), ws - 1)


@pytest.mark.parametrize("how", ["exit", "stop"])
@pytest.mark.parametrize("ws", SIZES)
def test_lost_rank_survivors_raise_mask_reset_and_serve(ws, how, monkeypatch):
    monkeypatch.setenv("MORI_EP_TIMEOUT_S", TIMEOUT_S)
    run_ep_job(lost_rank_job, ws, "hip", True, _dev(), ws // 2, 50, how)


@pytest.mark.parametrize("ws", SIZES)
def test_graph_captured_before_the_mask_replays_after_it(ws):
    run_ep_job(graph_after_mask_job, ws, _dev(), 1)
