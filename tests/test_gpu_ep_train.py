"""The differentiable op (``mori_jit.ops.ep.train``) on the ``hip`` backend (on a GPU machine:
``pytest -m gpu tests/test_gpu_ep_train.py``; world sizes from ``MORI_EP_TEST_WORLD_SIZES``, several
ranks per GPU under MPS where there are fewer GPUs):

* the CPU suite's gradient checks against the dense float64 MoE (every layout, fp32 and bf16 legs,
  int32/int64 ids, a rank without tokens, layers sharing one op, checkpointing, an fp8 forward with
  a bf16 gradient op);
* a training step (forward + backward through dispatch, the packed layout and combine) captured in a
  CUDA/HIP graph and replayed on fresh inputs: the gradients of an eager step on the same inputs;
* ``torch.compile(fullgraph=True)`` (inductor) of a MoE layer: the eager layer's outputs and gradients.
"""
from __future__ import annotations

import random

import pytest
import torch

from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job
from mori_jit.testing.moe_grads import Case, cases_job, rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

BF16, I32 = torch.bfloat16, torch.int32
TOKENS = [8, 0, 5, 7, 3, 8, 1, 6]
HIP_CASES = [Case(("rows",), backend="hip", replay=True), Case(("expert_major",), backend="hip", index_dtype=I32),
             Case(("packed",), backend="hip", dtype=BF16),
             Case(("rows", "expert_major", "packed"), backend="hip"),
             Case(("packed", "rows"), backend="hip", checkpoint=True, replay=True),
             Case(("rows",), backend="hip", fp8=True)]


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_gradients_match_the_dense_moe(ws):
    run_ep_job(cases_job, ws, _seed(), HIP_CASES, TOKENS)


def _setup(rank, ws, seed, replay=True):
    """A bf16 hip op of 16 tokens per rank, its handle and this rank's float32 leaves."""
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, train

    H, F, E, k, M = 128, 64, 4, 2, 16
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=E, num_experts_per_token=k, data_type=BF16,
                                  kernel_backend="hip", index_dtype=torch.int64, routing_replay=replay)
    op = EpDispatchCombineOp(cfg)
    g = torch.Generator().manual_seed(seed)
    dev = op.device
    gate = torch.randn(H, ws * E, generator=g).to(dev)
    up = (torch.randn(ws * E, H, F, generator=g) / H ** 0.5)[rank * E:(rank + 1) * E].to(dev)
    down = (torch.randn(ws * E, F, H, generator=g) / F ** 0.5)[rank * E:(rank + 1) * E].to(dev)
    return op, train.register(op), [gate, up, down], (M, H, E, k)


def _layer(handle, rank, E, k, x, gate, up, down):
    """A top-k MoE layer on the packed layout, grouped GEMMs in bf16 (traceable, capturable)."""
    from mori_jit.ops.ep import train

    probs = torch.softmax(x.float() @ gate, -1)
    w, ids = probs.topk(k, -1)
    d = train.dispatch(handle, x.to(BF16), (w / w.sum(-1, keepdim=True)).to(BF16), ids)
    p = train.pack(d, rank, E, 8)
    v = torch.nn.functional.silu(torch._grouped_mm(p.x, up.to(BF16), offs=p.offsets).float())
    y = torch._grouped_mm(v.to(BF16), down.to(BF16), offs=p.offsets).float()
    return train.combine_packed(handle, (p.mask(y) * p.weights[:, None]).to(BF16), p, d).float()


def _graph_job(rank, ws, seed):
    from mori_jit.testing.cuda_graph import capture

    op, h, params, (M, H, E, k) = _setup(rank, ws, seed)
    dev = op.device
    gen = torch.Generator(device=dev).manual_seed(seed + rank)
    x = torch.randn(M, H, device=dev, generator=gen).requires_grad_()
    cot = torch.randn(M, H, device=dev, generator=gen)
    leaves = [x] + [t.clone().requires_grad_() for t in params]

    def step():
        for t in leaves:
            t.grad = None  # (the captured backward allocates them: replays rewrite them)
        y = _layer(h, rank, E, k, *leaves)
        (y * cot).sum().backward()
        return [t.grad for t in leaves]

    graph, grads = capture(step)
    for trial in range(3):
        with torch.no_grad():
            x.copy_(torch.randn(M, H, device=dev, generator=gen))
            cot.copy_(torch.randn(M, H, device=dev, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in grads]
        eager = [t.detach().clone().requires_grad_() for t in leaves]
        y = _layer(h, rank, E, k, *eager)
        (y * cot).sum().backward()
        for name, a, b in zip(("x", "gate", "up", "down"), replayed, [t.grad for t in eager]):
            assert rel_err(a.cpu(), b.cpu()) <= 2e-2, f"trial {trial} {name} rank {rank} (seed {seed})"
    op.check()
    op.close()


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_training_step_replays_from_a_graph(ws):
    run_ep_job(_graph_job, ws, _seed())


def _compile_job(rank, ws, seed):
    op, h, params, (M, H, E, k) = _setup(rank, ws, seed)
    x = torch.randn(M, H, device=op.device, generator=torch.Generator(device=op.device).manual_seed(seed + rank))
    results = []
    for fn in (_layer, torch.compile(_layer, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in [x] + params]
        y = fn(h, rank, E, k, *leaves)
        (y * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("y", "x", "gate", "up", "down"), *results):
        assert rel_err(a.cpu(), b.cpu()) <= 2e-2, f"{name} rank {rank} (seed {seed})"
    op.close()


@pytest.mark.parametrize("ws", [w for w in WORLD_SIZES if w <= 2])
def test_hip_layer_compiles_with_inductor(ws):
    run_ep_job(_compile_job, ws, _seed())
