"""The custom ops (namespace ``mori_jit``) under ``torch.library.opcheck`` and ``torch.compile``, on the
torch backend (gloo, 2 ranks; every opcheck and compiled call is collective, so the ranks run them in
the same order).

* opcheck (schema, autograd registration, fake tensors, AOT dispatch) of ``ep_dispatch``,
  ``ep_combine``, ``ep_combine_expert_major`` and the two backward ops;
* ``torch.compile(fullgraph=True)`` (no graph break) of a MoE layer in each layout (rows, expert-major,
  packed with ``torch._grouped_mm``): the same outputs and gradients as the layer run eagerly."""
from __future__ import annotations

import random

import torch

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, train
from mori_jit.testing.distributed import run_distributed

M, H, F, E, K = 8, 16, 8, 3, 2
BF16 = torch.bfloat16


def _op(rank, ws, replay):
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=E, num_experts_per_token=K, data_type=torch.float32,
                                  kernel_backend="torch", index_dtype=torch.int64, expert_counts=True,
                                  expert_capacity=ws * M * K, routing_replay=replay)
    return EpDispatchCombineOp(cfg)


def _inputs(rank, ws, seed, n):
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(n, H, generator=g)
    w = torch.rand(n, K, generator=g)
    ids = torch.stack([torch.randperm(ws * E, generator=g)[:K] for _ in range(n)]) if n else torch.zeros(0, K)
    return x, w, ids.long()


def _opcheck_job(rank, ws, seed):
    ops = torch.ops.mori_jit
    for replay in (True, False):
        with _op(rank, ws, replay) as op:
            h = train.register(op)
            x, w, ids = _inputs(rank, ws, seed, [5, 3][rank])
            torch.library.opcheck(ops.ep_dispatch.default, (h, x.requires_grad_(), w.requires_grad_(), None, ids))
            d = train.dispatch(h, x.detach(), w.detach(), ids)
            rows = torch.randn(d.out.shape, generator=torch.Generator().manual_seed(seed))
            torch.library.opcheck(ops.ep_combine.default, (h, rows.requires_grad_(), None, ids, d.src))
            torch.library.opcheck(ops.ep_combine.default, (h, rows, d.weights.requires_grad_(), ids, d.src))
            torch.library.opcheck(ops.ep_combine_backward.default, (h, torch.randn(x.shape), None, ids, d.src,
                                                                    rows.shape[0], torch.float32))
            torch.library.opcheck(ops.ep_dispatch_backward.default, (h, rows.detach(), None, ids, d.src,
                                                                     torch.float32, torch.float32))
            d = train.dispatch(h, x.detach(), w.detach(), ids)
            inp = torch.randn(d.expert.x.shape).requires_grad_()
            torch.library.opcheck(ops.ep_combine_expert_major.default, (h, inp, ids, d.src, d.expert.recv_row))


def test_opcheck_passes_for_every_custom_op():
    run_distributed(_opcheck_job, 2, random.SystemRandom().randrange(2 ** 31), timeout=300)


def _layer(h, rank, layout, x, gate, up, down):
    """A top-k MoE layer on the functional API (traceable)."""
    probs = torch.softmax(x @ gate, dim=-1)
    w, ids = probs.topk(K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    d = train.dispatch(h, x, w, ids)
    if layout == "packed":
        p = train.pack(d, rank, E, 4)  # (grouped GEMMs in bf16: what torch._grouped_mm's meta function takes)
        v = torch.nn.functional.silu(torch._grouped_mm(p.x.to(BF16), up.to(BF16), offs=p.offsets))
        y = torch._grouped_mm(v, down.to(BF16), offs=p.offsets).float()
        return train.combine_packed(h, p.mask(y) * p.weights[:, None], p, d)
    if layout == "expert_major":
        lay = d.expert
        v = torch.nn.functional.silu(torch.bmm(lay.x, up))
        return train.combine_expert_major(h, torch.bmm(v, down) * lay.weights[..., None], d)
    rows = torch.zeros_like(d.out)
    for e in range(E):
        coef = (d.weights * (d.indices == rank * E + e)).sum(1, keepdim=True)
        rows = rows + coef * (torch.nn.functional.silu(d.out @ up[e]) @ down[e])
    return train.combine(h, rows, d)[0]


def _compile_job(rank, ws, seed):
    torch._dynamo.config.cache_size_limit = 64
    g = torch.Generator().manual_seed(seed)
    gate, up, down = torch.randn(H, ws * E, generator=g), torch.randn(ws * E, H, F, generator=g) / 4, \
        torch.randn(ws * E, F, H, generator=g) / 3
    mine = slice(rank * E, (rank + 1) * E)
    with _op(rank, ws, replay=rank >= 0) as op:
        h = train.register(op)
        for layout in ("rows", "expert_major", "packed"):
            x = _inputs(rank, ws, seed, [6, 2][rank])[0]
            results = []
            for fn in (_layer, torch.compile(_layer, fullgraph=True, backend="aot_eager")):
                leaves = [t.clone().requires_grad_() for t in (x, gate, up[mine], down[mine])]
                y = fn(h, rank, layout, *leaves)
                (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
                results.append([y.detach()] + [t.grad for t in leaves])
            for name, a, b in zip(("y", "x", "gate", "up", "down"), *results):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{layout} {name} rank {rank} (seed {seed})"


def test_compiled_layers_match_eager():
    run_distributed(_compile_job, 2, random.SystemRandom().randrange(2 ** 31), timeout=600)
