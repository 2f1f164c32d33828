"""A closed op (the ``torch`` backend on gloo): every call refuses it by name, and it no longer keeps
its process group alive.

A program that keeps its closed op in a variable and then destroys the process group (the
README's example does) must not hold the group until interpreter exit: a gloo group torn down
then can abort the process (``std::terminate``) after the program's work passed.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpStateError
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.golden import make_inputs

M, H, K, E = 8, 64, 2, 2


#: what a closed op still answers: close again (a no-op), and what describes it
STILL_SERVED = {"close", "kernels", "backend_name"}


def _calls(op, x, w, idx, routing):
    """Every other public call of the op, with arguments it would accept while open."""
    out = torch.zeros(op.cfg.recv_capacity, H, dtype=torch.bfloat16)
    return {
        "dispatch": lambda: op.dispatch(x, w, None, idx),
        "combine": lambda: op.combine(out, routing=routing),
        "combine_expert_major": lambda: op.combine_expert_major(out, routing=routing),
        "dispatch_send": lambda: op.dispatch_send(x, w, None, idx),
        "dispatch_recv": op.dispatch_recv,
        "combine_send": lambda: op.combine_send(out, routing=routing),
        "combine_recv": op.combine_recv,
        "reset": op.reset,
        "check": op.check,
        "latest_routing": lambda: op.latest_routing,
        "local_expert_count": lambda: op.local_expert_count,
        "get_combine_input_buffer": op.get_combine_input_buffer,
        "get_registered_combine_input_buffer": lambda: op.get_registered_combine_input_buffer(torch.bfloat16),
        "mask_rank": lambda: op.mask_rank(0),
        "unmask_rank": lambda: op.unmask_rank(0),
        "active_ranks": lambda: op.active_ranks,
        "rank_mask": lambda: op.rank_mask,
        "masked_pairs": lambda: op.masked_pairs,
        "update_mask_buffer": lambda: op.update_mask_buffer(0, True),
        "query_mask_buffer": lambda: op.query_mask_buffer(torch.zeros(op.cfg.world_size, dtype=torch.int32)),
        "clean_mask_buffer": op.clean_mask_buffer,
    }


def _closed_op_job(rank, ws):
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=E, num_experts_per_token=K, kernel_backend="torch")
    x, w, idx = make_inputs(rank, M, H, K, E * ws, torch.bfloat16, torch.device("cpu"),
                            torch.Generator().manual_seed(rank))
    sub = dist.new_group(list(range(ws)), backend="gloo")  # (a group of its own, destroyed below)
    with EpDispatchCombineOp(cfg, sub) as op:
        *_, routing = op.dispatch(x, w, None, idx, return_routing=True)
    group = weakref.ref(sub)
    del sub
    op.close()  # (idempotent)
    calls = _calls(op, x, w, idx.long(), routing)
    public = {n for n in dir(EpDispatchCombineOp) if not n.startswith("_")}
    assert set(calls) == public - STILL_SERVED, f"not covered here: {sorted(public - STILL_SERVED - set(calls))}"
    for name, call in calls.items():
        with pytest.raises(EpStateError, match="EpDispatchCombineOp is closed"):
            call()
    # once torch.distributed lets go of the group, nothing else holds it
    dist.destroy_process_group(group())
    gc.collect()
    assert group() is None, f"the closed op still reaches its process group: {gc.get_referrers(group())}"


def test_a_closed_op_refuses_every_call_and_lets_go_of_its_group():
    run_distributed(_closed_op_job, 2, timeout=90)
