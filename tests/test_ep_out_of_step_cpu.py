"""Ranks out of step (the ``torch`` backend on gloo): a call one rank refuses, weights on one rank
only, a short combine input on one rank, a routing from an older dispatch or another op. Each is an
error on every rank, raised before any rank enters the leg's exchange, and a valid round works
afterwards (nobody was left inside a collective)."""
from __future__ import annotations

import pytest
import torch

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpPeerError
from mori_jit.testing.golden import golden_check, make_inputs
from mori_jit.testing.distributed import run_distributed

M, H, K = 8, 64, 2


def _op(rank, ws):
    return EpDispatchCombineOp(EpDispatchCombineConfig(
        rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=2,
        num_experts_per_token=K, kernel_backend="torch"))


def _valid_round(op, rank, ws, gen):
    x, w, idx = make_inputs(rank, M, H, K, op.cfg.num_experts, torch.bfloat16, torch.device("cpu"), gen)
    out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
    y, y_w = op.combine(out, weights=out_w, routing=routing)
    golden_check(op.group, rank, ws, M, op.cfg.num_experts_per_rank, x, w, idx, out, out_w, out_idx, total,
                 routing.recv_src, y, y_w)


def _expect_on(rank, culprit, own_error, peer_match, call):
    """``call()`` raises ``own_error`` on ``culprit`` and EpPeerError naming it everywhere else."""
    if rank == culprit:
        with pytest.raises(own_error):
            call()
    else:
        with pytest.raises(EpPeerError, match=peer_match):
            call()


def _job(rank, ws):
    gen = torch.Generator().manual_seed(11 + rank)
    cpu = torch.device("cpu")
    with _op(rank, ws) as op, _op(rank, ws) as other:
        # n > M on rank 0 only
        n = M + 3 if rank == 0 else M
        x, w, idx = make_inputs(rank, n, H, K, op.cfg.num_experts, torch.bfloat16, cpu, gen)
        _expect_on(rank, 0, ValueError, r"dispatch: rank 0 refused its arguments \(EpArgumentError: input: 11 tokens "
                                         r"exceed max_num_inp_token_per_rank=8\); no rank ran this dispatch",
                   lambda: op.dispatch(x, w, None, idx))
        _valid_round(op, rank, ws, gen)

        # weights on one rank only, to dispatch and to combine
        x, w, idx = make_inputs(rank, M, H, K, op.cfg.num_experts, torch.bfloat16, cpu, gen)
        with pytest.raises(ValueError, match=r"weights: given on ranks \[1\] and not on the others"):
            op.dispatch(x, w if rank == 1 else None, None, idx)
        out, out_w, _, _, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        with pytest.raises(ValueError, match=r"weights: given on ranks \[0\] and not on the others; every rank "
                                             r"passes weights to combine or none does"):
            op.combine(out, weights=out_w if rank == 0 else None, routing=routing)

        # a short combine input on rank 1 (it always receives rows here: every token goes everywhere)
        t = int(total.item())
        assert t > 0
        rows = t - 1 if rank == 1 else t
        _expect_on(rank, 1, ValueError, r"combine: rank 1 refused its arguments \(EpArgumentError: input: \d+ rows, "
                                         r"but dispatch received \d+",
                   lambda: op.combine(out[:rows], weights=out_w[:rows], routing=routing))

        # a routing from an older dispatch, and one from another op
        _, _, _, _, _, old = op.dispatch(x, w, None, idx, return_routing=True)
        out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
        with pytest.raises(ValueError, match="routing: expected the routing returned by this op's latest dispatch"):
            op.combine(out, weights=out_w, routing=old)
        o_out, o_w, _, _, _, o_routing = other.dispatch(x, w, None, idx, return_routing=True)
        with pytest.raises(ValueError, match="routing: expected the routing returned by this op's latest dispatch"):
            op.combine(out, weights=out_w, routing=o_routing)
        _valid_round(op, rank, ws, gen)
        _valid_round(other, rank, ws, gen)


@pytest.mark.parametrize("ws", [2, 3])
def test_a_refusal_on_one_rank_is_an_error_on_every_rank(ws):
    run_distributed(_job, ws, timeout=180)
