"""One op shared by several layers (torch backend, gloo): each layer's routing kept alive by its autograd
node, backward passes running after later layers' dispatches, activation checkpointing; and a dispatch
whose backward finds no routing (its gradient goes home by a re-route).

Each model is checked against the dense float64 MoE (``mori_jit.testing.moe_grads``): gradients of the
tokens, the router and each rank's expert shard, fresh random data each run."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, train
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.moe_grads import Case, cases_job, rel_err

BF16 = torch.bfloat16
TOKENS = [7, 4, 0]

CASES = {
    2: [Case(("rows", "expert_major", "packed")), Case(("packed", "rows", "rows"), replay=True),
        Case(("rows", "expert_major"), checkpoint=True), Case(("packed", "rows"), checkpoint=True, replay=True),
        Case(("rows", "packed"), dtype=BF16, checkpoint=True, index_dtype=torch.int32)],
    3: [Case(("expert_major", "rows", "packed"), replay=True), Case(("rows", "packed"), checkpoint=True)],
}


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


@pytest.mark.parametrize("ws", [2, 3])
def test_layers_sharing_one_op_match_the_dense_model(ws):
    run_distributed(cases_job, ws, _seed(), CASES[ws], TOKENS, timeout=400)


def _dispatch_only_job(rank, ws, seed):
    """Two dispatches, no combine; the loss reads the received rows and weights. The first dispatch's
    backward runs after the second dispatch replaced its routing: it re-routes. Expected gradients:
    token t's is the sum, over its destination ranks, of the cotangent at its row there (a function of
    the receiving rank and the row's source id)."""
    H, M, E, k = 16, 6, 2, 2
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=E, num_experts_per_token=k, data_type=torch.float32,
                                  kernel_backend="torch")
    g = torch.Generator().manual_seed(seed)
    n = [[M, 3, 0][r] for r in range(ws)]
    ids = [[torch.stack([torch.randperm(ws * E, generator=g)[:k] for _ in range(c)]) if c else
            torch.zeros(0, k, dtype=torch.int64) for c in n] for _ in range(2)]
    xs = [[torch.randn(c, H, generator=g) for c in n] for _ in range(2)]
    ws_ = [[torch.rand(c, k, generator=g) for c in n] for _ in range(2)]
    cot = torch.randn(2, ws, ws * M, H + k, generator=g, dtype=torch.float64)  # [call, receiver, source id, :]
    with EpDispatchCombineOp(cfg) as op:
        leaves, loss = [], 0
        for call in range(2):
            x = xs[call][rank].clone().requires_grad_()
            w = ws_[call][rank].clone().requires_grad_()
            d = train.dispatch(train.register(op), x, w, ids[call][rank].int())
            valid = d.src >= 0
            c = cot[call, rank][d.src.clamp(min=0).long()] * valid.unsqueeze(1)
            loss = loss + (d.out.double() * c[:, :H]).sum() + (d.weights.double() * c[:, H:]).sum()
            leaves.append((x, w))
        loss.backward()
    for call, (x, w) in enumerate(leaves):
        want = torch.zeros(n[rank], H + k, dtype=torch.float64)
        for t in range(n[rank]):
            for dest in sorted(set((ids[call][rank][t] // E).tolist())):
                want[t] += cot[call, dest, rank * M + t]
        for name, got, exp in (("x", x.grad, want[:, :H]), ("weights", w.grad, want[:, H:])):
            assert rel_err(got, exp) <= 1e-6, f"call {call} {name} rank {rank} (seed {seed}): {rel_err(got, exp)}"
    dist.barrier()


@pytest.mark.parametrize("ws", [2, 3])
def test_a_dispatch_whose_routing_was_replaced_sends_its_gradient_home(ws):
    run_distributed(_dispatch_only_job, ws, _seed(), timeout=200)
