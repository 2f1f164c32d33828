"""The worked MoE block (``mori_jit.examples.moe_block``) on the torch backend (gloo, 2 and 4 ranks) against the
same block run densely on one process, for bf16 rows, fp8 rows the op casts, and fp8 rows with the
block's own UE8M0 scales; and its expert step, free of host syncs. (The jobs are device-generic:
``test_gpu_ep_moe.py`` runs them on NCCL, and on the ``hip`` backend.)"""
from __future__ import annotations

import pytest
import torch

from host_sync import forbid_host_sync
from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
from mori_jit.testing.golden_moe import golden_quantize
from mori_jit.examples.moe_block import MoeBlock, MoeExperts, route, run_experts
from mori_jit.ops.ep.results import EpExpertLayout
from mori_jit.testing.distributed import run_distributed

FP8 = torch.float8_e4m3fn
M, H, F, EPR, K = 16, 256, 64, 3, 2
MODES = {
    "bf16": (dict(), None),
    "fp8_op_cast": (dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8,
                         combine_data_type=torch.bfloat16, scale_dim=H // 128, scale_type_size=4), 4),
    "fp8_own_ue8m0": (dict(dispatch_data_type=FP8, combine_data_type=torch.bfloat16, scale_dim=H // 128,
                           scale_type_size=1), 1),
}


def _model(ws):
    """The gate and every expert's weights, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(1234)
    gate = torch.randn(H, ws * EPR, generator=g)
    w_up = (torch.randn(ws * EPR, H, F, generator=g) / H ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(ws * EPR, F, H, generator=g) / F ** 0.5).to(torch.bfloat16)
    return gate, w_up, w_down


def _dense(x, weights, ids, w_up, w_down, scale_type_size):
    """The block on one process, token by token, over all experts: float32 ``[n, H]``. The rows are
    what an expert sees: fp8 payloads quantized and scaled back (golden quantization)."""
    v = x
    if scale_type_size is not None:
        q, s = golden_quantize(x, scale_type_size)
        v = (q.float().reshape(-1, H // 128, 128) * s.float()[..., None]).reshape(-1, H).to(torch.bfloat16)
    y = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.nn.functional.silu((v[t].float() @ w_up[e].float()).to(torch.bfloat16).float())
            y[t] += weights[t, j] * (h.to(torch.bfloat16).float() @ w_down[e].float()).to(torch.bfloat16).float()
    return y


def _layer_job(rank, ws, mode, backend="torch"):
    fields, sts = MODES[mode]
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=EPR, num_experts_per_token=K, index_dtype=torch.int64,
                                  expert_counts=True, expert_capacity=ws * M, kernel_backend=backend, **fields)
    gate, w_up, w_down = _model(ws)
    mine = slice(rank * EPR, (rank + 1) * EPR)
    gen = torch.Generator().manual_seed(77 + rank)
    with EpDispatchCombineOp(cfg) as op:
        dev = op.device
        block = MoeBlock(op, gate.to(dev), MoeExperts(w_up[mine].to(dev), w_down[mine].to(dev)))
        for call, n in enumerate([M, [0, 5, 11, 3][rank % 4], M - rank, 1, 9]):  # changes every call
            x = (torch.randn(n, H, generator=gen) * 2).to(torch.bfloat16)
            weights, ids = route(x, gate, K)
            if call == 3:  # every token to the last rank's experts: the other ranks' experts get nothing
                ids = (ws - 1) * EPR + torch.stack([torch.randperm(EPR, generator=gen)[:K] for _ in range(n)])
            y = block(x.to(dev), (weights.to(dev), ids.to(dev))).cpu()
            want = _dense(x, weights, ids, w_up, w_down, sts)
            assert y.shape == (n, H) and y.dtype == torch.bfloat16
            err = (y.float() - want).abs()
            tol = 2e-2 * want.abs().amax(dim=1, keepdim=True) + 1e-2 * want.abs()
            assert bool((err <= tol).all()), f"{mode} call {call} rank {rank}: off by {float((err - tol).max())}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ws", [2, 4])
def test_moe_block_matches_the_dense_block(ws, mode):
    run_distributed(_layer_job, ws, mode, timeout=240)


def test_the_expert_step_has_no_host_sync():
    """run_experts on a layout with NaN padding: no op that waits for the device's values, and a
    finite, masked result."""
    g = torch.Generator().manual_seed(3)
    E, C = 3, 8
    counts = torch.tensor([2, 0, 8], dtype=torch.int32)
    valid = torch.arange(C)[None, :] < counts[:, None]
    q, s = golden_quantize((torch.randn(E * C, H, generator=g)).to(torch.bfloat16), 4)
    x, scales = q.reshape(E, C, H), s.reshape(E, C, -1)
    x.view(torch.uint8)[~valid] = 0x7F  # NaN in e4m3
    minus = torch.where(valid, 0, -1).to(torch.int32)
    layout = EpExpertLayout(x=x, scales=scales, weights=torch.rand(E, C, generator=g) * valid, recv_row=minus,
                            src=minus, slot=minus)
    experts = MoeExperts((torch.randn(E, H, F, generator=g) / 16).to(torch.bfloat16),
                         (torch.randn(E, F, H, generator=g) / 8).to(torch.bfloat16))
    with forbid_host_sync():
        y = run_experts(layout, counts, experts)
    assert y.shape == (E, C, H) and bool(torch.isfinite(y.float()).all()) and not bool(y[~valid].float().any())
    with pytest.raises(AssertionError, match="host sync"):  # the guard itself can fail
        with forbid_host_sync():
            run_experts(layout, counts, experts)[: int(counts.max())]
