"""Checks the GPU tests of the ``hip`` backend share: the identity expert, parity with the torch
backend, and a short combine input's reports (graph capture: ``mori_jit.testing.cuda_graph``)."""
from __future__ import annotations

import pytest
import torch


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
