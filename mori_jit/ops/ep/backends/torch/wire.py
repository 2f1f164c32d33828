"""The combine's wire and sum in the ``torch`` backend, as the hip kernels do them (bit for bit):
each returned row travels as :func:`~mori_jit.ops.ep.quant.combine_wire_encode` makes it (the row,
or its e4m3 bytes and scales under ``quant_type``), and each token's rows are summed in float32 in
the order of its top-k slots (the rank named by its first slot first), starting from +0, as the
kernels' summers add a token's sources (:mod:`mori_jit.ops.ep.quant`, "The combine wire").
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from mori_jit.ops.ep.quant import combine_wire_decode, combine_wire_encode

__all__ = ["CombineWire", "send_positions", "pack_combine"]


@dataclasses.dataclass(frozen=True)
class CombineWire:
    """The combine wire of an op: ``quant_type`` and (``"fp8_blockwise"``) its scales' bytes."""

    quant_type: str = "none"
    scale_type_size: int = 4

    @classmethod
    def of(cls, cfg) -> "CombineWire":
        """The wire of config ``cfg``."""
        return cls(cfg.quant_type, cfg.combine_scale_type_size)


def send_positions(indices: torch.Tensor, pairs: torch.Tensor, world_size: int, num_experts_per_rank: int) -> torch.Tensor:
    """int64 ``[len(pairs)]``: for each sent (destination, token) pair (``pairs [s, 2]``, the send
    order), the token's first top-k slot whose expert lives on that destination: the position of
    that rank's row in the token's sum."""
    idx = indices.to(pairs.device).long()
    n, k = idx.shape
    valid = (idx >= 0) & (idx < num_experts_per_rank * world_size)
    dest = torch.where(valid, idx // num_experts_per_rank, torch.full_like(idx, world_size))
    slots = torch.arange(k, device=idx.device).expand(n, k)
    first = torch.full((n, world_size + 1), k, dtype=torch.int64, device=idx.device)
    first.scatter_reduce_(1, dest, slots, reduce="amin")
    return first[pairs[:, 1], pairs[:, 0]]


def _slot_order_sum(rows: torch.Tensor, send_tok: torch.Tensor, send_pos: torch.Tensor, n: int) -> torch.Tensor:
    """float32 ``[n, c]``: each token's ``rows`` (float32 ``[s, c]``, in send order) summed from +0 in
    slot order: one ``index_add_`` per slot position, each adding at most one row per token, so each
    element is ``((0 + r0) + r1) + ...`` exactly."""
    out = torch.zeros(n, rows.shape[1], dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:
        return out
    for p in torch.unique(send_pos).tolist():
        sel = (send_pos == p).nonzero()[:, 0]
        out.index_add_(0, send_tok[sel], rows[sel])
    return out


def pack_combine(expert_out: torch.Tensor, weights: Optional[torch.Tensor], total: int, wire: CombineWire
                 ) -> tuple[list[torch.Tensor], Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple]]:
    """The byte fields a rank sends back for rows ``[0, total)`` of ``expert_out`` (and of
    ``weights``, as float32), and ``unpack(back, send_tok, send_pos, n) -> (y32 [n, H], y_w | None)``
    that sums what came back (``back``: the fields' bytes, row by row, in send order)."""
    hidden, dtype = expert_out.shape[1], expert_out.dtype
    fields = combine_wire_encode(expert_out[:total], wire.quant_type, wire.scale_type_size)
    if weights is not None:
        fields.append(weights[:total].to(device=expert_out.device, dtype=torch.float32).contiguous()
                      .view(torch.uint8).reshape(total, -1) if total else
                      torch.empty((0, weights.shape[1] * 4), dtype=torch.uint8, device=expert_out.device))
    widths = [f.shape[1] for f in fields]

    def unpack(back: torch.Tensor, send_tok: torch.Tensor, send_pos: torch.Tensor, n: int):
        parts, off = [], 0
        for w in widths:
            parts.append(back[:, off:off + w])
            off += w
        nx = len(parts) - (weights is not None)
        rows = combine_wire_decode(parts[:nx], wire.quant_type, wire.scale_type_size, dtype, hidden)
        y = _slot_order_sum(rows, send_tok, send_pos, n)
        y_w = None
        if weights is not None:
            k = weights.shape[1]
            wrows = parts[-1].contiguous().view(torch.float32).reshape(-1, k) if back.shape[0] else \
                torch.empty((0, k), dtype=torch.float32, device=back.device)
            y_w = _slot_order_sum(wrows, send_tok, send_pos, n)
        return y, y_w

    return fields, unpack
