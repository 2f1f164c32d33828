"""Rank masking on the torch backend over gloo (docs/design.md §6, "Rank masking"): a masked rank's
experts removed from the golden check on the others, a reset among the survivors while the masked
rank is away, its refusal until every survivor unmasks it, a rank lost mid-run, and the mask's
calls and refusals."""
from __future__ import annotations

import pytest
import torch

from ep_mask_jobs import config, lost_rank_job, mask_and_rejoin_job
from mori_jit.ops.ep import EpArgumentError, EpArgumentTypeError, EpDispatchCombineOp
from mori_jit.testing.distributed import run_distributed

CPU = torch.device("cpu")


@pytest.mark.parametrize("moe", [False, True], ids=["plain", "moe"])
def test_mask_reset_among_survivors_and_rejoin(moe):
    run_distributed(mask_and_rejoin_job, 3, "torch", moe, CPU, 1, timeout=240)


def test_lost_rank_survivors_mask_reset_and_serve(monkeypatch):
    monkeypatch.setenv("MORI_EP_TIMEOUT_S", "5")
    run_distributed(lost_rank_job, 4, "torch", True, CPU, 2, 5, timeout=240)


def _calls_job(rank, ws):
    op = EpDispatchCombineOp(config(rank, ws, "torch", False))
    with pytest.raises(EpArgumentError, match="a rank does not mask itself"):
        op.mask_rank(rank)
    with pytest.raises(EpArgumentError, match=r"rank=5: outside the op's group \[0, 2\)"):
        op.mask_rank(5)
    with pytest.raises(EpArgumentTypeError, match="rank=True"):
        op.mask_rank(True)
    other = 1 - rank
    op.update_mask_buffer(other, True)
    assert op.active_ranks == (rank,) and op.rank_mask.tolist() == [int(r == other) for r in range(ws)]
    op.clean_mask_buffer()
    assert op.active_ranks == (0, 1) and op.rank_mask.tolist() == [0, 0]
    op.close()


def test_mask_calls_and_refusals():
    run_distributed(_calls_job, 2, timeout=120)
