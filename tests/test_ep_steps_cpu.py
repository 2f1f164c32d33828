"""Ranks at different steps of the ``torch`` backend (gloo), and errors of one rank that every rank
must get. Before any rank enters a call's exchange, the ranks agree on which op and which call each
is in, and of which dispatch: a rank repeating a combine while its peer dispatches, a replay
meeting a fresh dispatch, or two ops' calls meeting is an ``EpStateError`` on every rank, naming
each rank's step, and nothing ran. A capacity overflow on one rank is an error on every rank. A
valid round works afterwards each time (no rank was left inside a collective)."""
from __future__ import annotations

import pytest
import torch

from mori_jit.ops.ep import (EpCapacityError, EpDeviceError, EpDispatchCombineConfig, EpDispatchCombineOp,
                             EpStateError)
from mori_jit.ops.ep.backends.torch.reference import reference_dispatch
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.golden import golden_check, make_inputs

M, H, K, E = 8, 64, 2, 2


def _op(rank, ws, **extra):
    return EpDispatchCombineOp(EpDispatchCombineConfig(
        rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=E,
        num_experts_per_token=K, kernel_backend="torch", **extra))


def _inputs(op, rank, gen):
    return make_inputs(rank, M, H, K, op.cfg.num_experts, torch.bfloat16, op.device, gen)


def _valid_round(op, rank, ws, gen):
    x, w, idx = _inputs(op, rank, gen)
    out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
    y, y_w = op.combine(out, weights=out_w, routing=routing)
    golden_check(op.group, rank, ws, M, E, x, w, idx, out, out_w, out_idx, total, routing.recv_src, y, y_w)


def _out_of_step(call, match):
    with pytest.raises(EpStateError, match=match) as ei:
        call()
    assert "no rank ran these" in str(ei.value)


def _steps_job(rank, ws):
    gen = torch.Generator().manual_seed(5 + rank)
    with _op(rank, ws, routing_replay=True) as op, _op(rank, ws) as other:
        x, w, idx = _inputs(op, rank, gen)
        out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
        op.combine(out, weights=out_w, routing=routing)

        # rank 0 repeats its combine (which is allowed) while the others dispatch again
        x2, w2, idx2 = _inputs(op, rank, gen)
        _out_of_step(lambda: op.combine(out, weights=out_w, routing=routing) if rank == 0 else
                     op.dispatch(x2, w2, None, idx2),
                     r"the ranks are at different steps \(rank 0 in combine of dispatch 1 of op #1; ranks? "
                     r"[\d, ]+ in dispatch 2 of op #1\)")
        _valid_round(op, rank, ws, gen)  # dispatch 2

        # a replay of dispatch 3 on the last rank meets a fresh dispatch on the others
        out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
        last = ws - 1
        _out_of_step(lambda: op.dispatch(x2, w2, None, None, routing=routing) if rank == last else
                     op.dispatch(x2, w2, None, idx2),
                     rf"ranks? [\d, ]+ in dispatch 4 of op #1; rank {last} in replay of dispatch 3 of op #1")
        out2, out_w2, *_ = op.dispatch(x2, w2, None, None, routing=routing)  # the replay, on every rank
        y, _ = op.combine(out2, weights=out_w2, routing=routing)  # along dispatch 3, with the new payload
        assert y.shape == (M, H)
        _valid_round(op, rank, ws, gen)  # dispatch 4

        # two ops' calls meet: rank 0 dispatches on the second op, the others on the first
        _out_of_step(lambda: (other if rank == 0 else op).dispatch(x, w, None, idx),
                     r"rank 0 in dispatch 1 of op #2; ranks? [\d, ]+ in dispatch 5 of op #1")
        _valid_round(other, rank, ws, gen)
        _valid_round(op, rank, ws, gen)


@pytest.mark.parametrize("ws", [2, 3])
def test_ranks_at_different_steps_all_raise_naming_every_step(ws):
    run_distributed(_steps_job, ws, timeout=90)


def _expert_major_job(rank, ws):
    gen = torch.Generator().manual_seed(9 + rank)
    with _op(rank, ws, expert_counts=True, expert_capacity=2 * M * ws) as op:
        x, w, idx = _inputs(op, rank, gen)
        res = op.dispatch(x, w, None, idx, return_result=True)
        layout = res.expert.x.to(torch.bfloat16)
        _out_of_step(lambda: op.combine(res.out, routing=res.routing) if rank == 0 else
                     op.combine_expert_major(layout, routing=res.routing),
                     r"rank 0 in combine of dispatch 1 of op #1; ranks? [\d, ]+ in combine_expert_major of "
                     r"dispatch 1 of op #1")
        op.combine_expert_major(layout, routing=res.routing)


def test_a_combine_and_an_expert_major_combine_do_not_meet():
    run_distributed(_expert_major_job, 2, timeout=90)


def _capacity_job(rank, ws):
    """Every token of every rank names rank 1's first expert: it overflows, every rank raises the
    same error naming rank 1, from a dispatch and from a split send alike; the retry, with a larger
    spread, runs on every rank."""
    gen = torch.Generator().manual_seed(rank)
    with _op(rank, ws, expert_counts=True, expert_capacity=4, split_send_recv=True) as op:
        x, w, _ = _inputs(op, rank, gen)
        idx = torch.full((M, K), E, dtype=torch.int32, device=op.device)  # rank 1's local expert 0, twice a token
        with pytest.raises(EpCapacityError, match=r"rank 1's local experts 0 .* the dispatch returns on no rank"):
            op.dispatch_send(x, w, None, idx)  # (refused by the send: no leg is left in flight)
        with pytest.raises(EpCapacityError) as ei:
            op.dispatch(x, w, None, idx)
        assert str(ei.value) == (f"EP dispatch: rank 1's local experts 0 ({2 * M * ws} pairs) would receive more "
                                 f"than expert_capacity=4 (token, expert) pairs; raise expert_capacity to at least "
                                 f"{2 * M * ws} (nothing was sent or truncated: the dispatch returns on no rank)")
        # the overflowing rank's retry meets every peer's: the ranks stay in step
        idx = (torch.arange(M * K, dtype=torch.int32, device=op.device).reshape(M, K) + rank) % op.cfg.num_experts
        x = x[:2].contiguous()
        res = op.dispatch(x, w[:2].contiguous(), None, idx[:2].contiguous(), return_result=True)
        y, _ = op.combine(res.out, weights=res.out_weights, routing=res.routing)
        received = res.out_indices[:int(res.total_recv)]
        assert int(res.expert_counts.sum()) == int((received // E == rank).sum()) and y.shape == (2, H)

    # the reference itself: a rank that would receive more rows than its capacity fails every rank,
    # before any row moves, and the next exchange stays matched
    x, w, _ = _inputs(op, rank, gen)
    idx = torch.zeros(M, K, dtype=torch.int32, device=op.device)  # every token to rank 0
    with pytest.raises(EpDeviceError, match=rf"rank 0 would receive {ws * M} rows, but recv_capacity is {M}; "
                                            rf"no row was sent"):
        reference_dispatch(None, rank, ws, M, E, x, w, None, idx, M)
    *_, total, _ = reference_dispatch(None, rank, ws, M, E, x, w, None, idx, ws * M)
    assert int(total) == (ws * M if rank == 0 else 0)


@pytest.mark.parametrize("ws", [2, 3])
def test_a_capacity_overflow_on_one_rank_is_an_error_on_every_rank(ws):
    run_distributed(_capacity_job, ws, timeout=90)
