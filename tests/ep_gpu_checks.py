"""Checks the GPU tests of the ``hip`` backend share: the dtype pairs they run, the identity
expert, parity with the torch backend, a short combine input's reports, and a captured dispatch +
combine replayed against the golden check."""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.cuda_graph import capture

BF16, FP32 = torch.bfloat16, torch.float32
FP8 = getattr(torch, "float8_e4m3fn", None)
FP4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
#: (dispatch dtype, combine dtype) of the golden checks: every payload, and asymmetric legs
DTYPE_PAIRS = [(BF16, BF16), (FP32, FP32), (FP8, BF16), (FP4, BF16), (BF16, FP32)]


def identity_expert(out: torch.Tensor, combine_dtype: torch.dtype) -> torch.Tensor:
    """The identity expert: byte payloads map byte value -> number (exact in bf16/fp32)."""
    if out.element_size() == 1:
        return out.view(torch.uint8).to(combine_dtype)
    return out.to(combine_dtype)


def parity_with_torch(op, ref_op, x, w, idx, out, out_w, out_idx, total, routing, y, y_w):
    """``op`` vs the torch backend's ``ref_op``: the same rows per source (matched through the
    reverse map), the same sums. The torch backend runs where its group's collectives do (gloo:
    the host); its results come back to ``x``'s device."""
    on = ref_op.device
    r_out, r_w, _, r_idx, r_total, r_routing = ref_op.dispatch(x.to(on), w.to(on), None, idx.to(on),
                                                               return_routing=True)
    dev = x.device
    r_out, r_w, r_idx = r_out.to(dev), r_w.to(dev), r_idx.to(dev)
    t = total.item()
    assert t == r_total.item(), f"total_recv hip {t} != torch {r_total.item()}"
    src, r_src = routing.recv_src[:t].long(), r_routing.recv_src[:t].long().to(dev)
    order, r_order = torch.argsort(src), torch.argsort(r_src)
    assert torch.equal(src[order], r_src[r_order]), "received source sets differ"
    assert torch.equal(out[:t].view(torch.uint8)[order], r_out[:t].view(torch.uint8)[r_order])
    assert torch.equal(out_w[:t][order], r_w[:t][r_order])
    assert torch.equal(out_idx[:t][order], r_idx[:t][r_order])
    cfg = op.cfg
    r_y, r_yw = ref_op.combine(identity_expert(r_out, cfg.combine_dtype)[:t].to(on), weights=r_w[:t].to(on),
                               routing=r_routing)
    tol = 1e-2 if cfg.combine_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), r_y.to(dev).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(y_w, r_yw.to(dev), rtol=1e-5, atol=1e-5)


def combine_short_and_expect_reports(op, out, out_w, routing, rows: int, total: int) -> torch.Tensor:
    """Combine the first ``rows`` of the ``total`` rows this rank received (rank 0 passes fewer, the
    others all): rank 0 must report its short input, every rank whose tokens lost rows by it must
    report rank 0's, and no other rank anything (never a silent wrong sum). Collective; returns
    ``lost`` (1 for each home rank of a row rank 0 dropped)."""
    from mori_jit.ops.ep import EpDeviceError

    rank, ws, m = op.cfg.rank, op.cfg.world_size, op.cfg.max_num_inp_token_per_rank
    lost = torch.zeros(ws, dtype=torch.int32)  # by home rank of a dropped row
    if rank == 0:
        lost[(routing.recv_src[rows:total].long() // m).unique().cpu()] = 1
    if torch.distributed.get_backend() != "gloo":  # (where the group's collectives take it)
        lost = lost.to(op.device)
    torch.distributed.broadcast(lost, 0)
    op.combine(out[:rows].clone(), weights=out_w[:rows].clone(), routing=routing)
    torch.cuda.synchronize()
    if rank == 0:
        with pytest.raises(EpDeviceError, match=f"rank 0: combine input had {rows} rows but dispatch received {total}"):
            op.check()
    elif lost[rank]:
        with pytest.raises(EpDeviceError, match=f"rank {rank}: rank 0's combine input was short"):
            op.check()
    else:
        op.check()  # none of this rank's tokens lost a row: its sum is whole
    return lost


def dispatch_combine_step(op, x, w, idx, zero_copy: bool):
    """A step to capture: dispatch the static inputs ``x, w, idx`` and combine the received rows
    as they are (the identity expert). ``zero_copy``: the expert writes into the combine input
    buffer and the caller's output tensors receive the result. Returns
    ``step() -> (out, out_w, out_idx, total, routing, y, y_w)``."""
    m, hidden = x.shape
    stage = op.get_combine_input_buffer()
    y_out = torch.empty(m, hidden, dtype=op.cfg.combine_dtype, device=x.device)
    y_w_out = torch.empty(m, w.shape[1], dtype=torch.float32, device=x.device)

    def step():
        out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        if zero_copy:
            stage.copy_(out)
            y, y_w = op.combine(stage, weights=out_w, routing=routing, out=y_out, out_weights=y_w_out)
            assert y is y_out and y_w is y_w_out
        else:
            y, y_w = op.combine(out, weights=out_w, routing=routing)
        return out, out_w, out_idx, total, routing, y, y_w

    return step


def replays_match_golden(op, rank: int, ws: int, step, static, gen, replays: int = 20) -> None:
    """Capture ``step`` (:func:`dispatch_combine_step` over the static bf16 inputs ``static``), then
    ``replays`` times: fresh random inputs copied in, the combine outputs poisoned, one replay, the
    golden check; ``op.check()`` at the end."""
    from mori_jit.testing.golden import golden_check, make_inputs

    sx, sw, sidx = static
    (m, hidden), k, cfg = sx.shape, sw.shape[1], op.cfg
    graph, outs = capture(step)
    for _ in range(replays):
        torch.distributed.barrier()  # peers must be done checking before the next dispatch
        x, w, idx = make_inputs(rank, m, hidden, k, cfg.num_experts, sx.dtype, sx.device, gen)
        sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
        outs[5].fill_(float("nan")), outs[6].fill_(float("nan"))  # poison the graph's outputs
        graph.replay()
        out, out_w, out_idx, total, routing, y, y_w = outs
        golden_check(op.group, rank, ws, m, cfg.num_experts_per_rank, sx, sw, sidx, out, out_w, out_idx, total,
                     routing.recv_src, y, y_w)
    op.check()
