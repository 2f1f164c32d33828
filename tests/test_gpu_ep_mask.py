"""Rank masking on the hip backend's kernels (``pytest -m gpu``; docs/design.md §6, "Rank
masking"): the jobs of ``ep_mask_jobs.py`` at 4 and 8 ranks (several per GPU under MPS where the
machine has fewer GPUs): a masked rank's experts removed from the golden check, a reset among the
survivors and the masked rank's return, a rank lost (exited, or stopped) mid-run, and a graph
captured before the mask replayed after it. The intranode kernels, and the internode ``v2_ll``
kernels on NVSHMEM (``run_shmem_job``: the PEs' MPS shares); internode ``v2`` refuses masking."""
from __future__ import annotations

import pytest
import torch

from ep_mask_jobs import config, graph_after_mask_job, lost_rank_job, mask_and_rejoin_job
from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job
from mori_jit.testing.gpu_world_shmem import run_shmem_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

SIZES = [ws for ws in WORLD_SIZES if ws >= 3]
#: the kernels' wait bound in the lost-rank jobs: the survivors must raise within twice it
TIMEOUT_S = "3"
#: internode (world_size, gpu_per_node): two nodes, each of several ranks (stores inside a node, puts across)
NET_LAYOUTS = [(ws, g) for ws, g in ((4, 2), (8, 4)) if ws in WORLD_SIZES]
_NET = pytest.mark.parametrize("ws, gpn", NET_LAYOUTS, ids=[f"ws{ws}-gpn{g}" for ws, g in NET_LAYOUTS])


def _net(gpn: int, family: str = "v2_ll") -> dict:
    return {"gpu_per_node": gpn, "internode_kernel": family}


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


@_NET
def test_internode_mask_reset_among_survivors_and_rejoin(ws, gpn):
    run_shmem_job(mask_and_rejoin_job, ws, "hip", False, _dev(), ws - 1, 3, _net(gpn))


@_NET
def test_internode_lost_rank_survivors_raise_mask_reset_and_serve(ws, gpn, monkeypatch):
    monkeypatch.setenv("MORI_EP_TIMEOUT_S", TIMEOUT_S)
    run_shmem_job(lost_rank_job, ws, "hip", False, _dev(), ws // 2, 50, "exit", _net(gpn))


@_NET
def test_internode_graph_captured_before_the_mask_replays_after_it(ws, gpn):
    run_shmem_job(graph_after_mask_job, ws, _dev(), 1, _net(gpn))


def _v2_refuses_job(rank, ws, gpn):
    from mori_jit.ops.ep import EpDispatchCombineOp, EpUnsupportedError

    with EpDispatchCombineOp(config(rank, ws, "hip", False, layout=_net(gpn, "v2"))) as op:
        assert op.rank_mask is None and op.masked_pairs is None
        with pytest.raises(EpUnsupportedError, match=r"mask_rank\(.*internode_kernel='v2' builds the 'v2' family.*"
                                                     r"internode_kernel='v2_ll'"):
            op.mask_rank((rank + 1) % ws)
        assert op.active_ranks == tuple(range(ws))


@_NET
def test_internode_v2_refuses_masking_naming_v2_ll(ws, gpn):
    run_shmem_job(_v2_refuses_job, ws, gpn)
