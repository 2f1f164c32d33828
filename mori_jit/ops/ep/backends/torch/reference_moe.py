"""Reference MoE outputs around the transfer, for the ``torch`` backend (docs/design.md §6):
local expert counts, the expert-major layout, the local sum of an expert-major combine, and the
replay of a payload along an earlier routing.

Counts and the layout are computed from the received rows' expert ids with device tensor ops only
(scatter, stable sort, gather), so they add no host sync of their own. An overflow of
``capacity`` never reaches them: every rank refuses such a dispatch from the gathered counts,
before any row moves (:mod:`.counts`).
Entries follow receive order: receive row ascending, then top-k slot; one entry per valid slot
(a token naming one expert twice has two).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mori_jit.ops.ep.backends.torch.reference import TorchRouting
from mori_jit.ops.ep.backends.torch.rows import from_row_bytes, pack_rows, row_bytes
from mori_jit.ops.ep.core.watch import Exchange
from mori_jit.ops.ep.results import EpExpertLayout

__all__ = ["ExpertMap", "TorchMoeRouting", "expert_map", "expert_layout", "expert_rows_sum", "reference_replay"]


@dataclasses.dataclass(frozen=True)
class ExpertMap:
    """Where each received (row, top-k slot) pair goes in the expert-major layout."""

    counts: torch.Tensor
    """int32 ``[E]``: valid slots per local expert (the true count, even above ``capacity``)."""

    dest: torch.Tensor
    """int64 ``[rows * k]``: flat entry ``e * capacity + c`` of each (row, slot) in receive order;
    ``E * capacity`` (one past the layout: a spare entry) for slots of no local expert."""

    capacity: int
    """Entries per expert (0: counts only, no layout)."""

    topk: int
    """Slots per received row (``k``): entry i of ``dest`` is row ``i // topk``, slot ``i % topk``."""


@dataclasses.dataclass
class TorchMoeRouting(TorchRouting):
    """A :class:`TorchRouting` with what the MoE features need after the dispatch."""

    out_indices: Optional[torch.Tensor] = None
    """``[recv_capacity, k]``: the dispatch's received ids (a replay returns them again)."""

    experts: Optional[ExpertMap] = None
    """The expert map (``cfg.expert_counts``), else None."""

    recv_capacity: int = 0
    """Rows of the receive buffers."""


def expert_map(out_indices: torch.Tensor, total: int, rank: int, num_experts_per_rank: int,
               capacity: int) -> ExpertMap:
    """Count and place the valid slots of the ``total`` received rows among the local experts
    (slots beyond ``capacity``, which the dispatch refuses before any row moves, land on the spare
    entry)."""
    E, k, device = num_experts_per_rank, out_indices.shape[1], out_indices.device
    local = out_indices[:total].long() - rank * E  # ids of other ranks and invalid ids fall outside [0, E)
    key = torch.where((local >= 0) & (local < E), local, torch.full_like(local, E)).reshape(-1)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    # the position of each slot among its expert's: its rank in a stable sort by expert
    sorted_key, order = torch.sort(key, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(key).scatter_(0, order, torch.arange(key.numel(), device=device) - starts[sorted_key])
    dest = torch.where((key < E) & (pos < capacity), key * capacity + pos, torch.full_like(key, E * capacity))
    return ExpertMap(counts=counts[:E].to(torch.int32), dest=dest, capacity=capacity, topk=k)


def _scatter_rows(m: ExpertMap, rows: torch.Tensor, pad_byte: int) -> torch.Tensor:
    """``rows [rows * k, C]`` (one per (row, slot)) placed at their entries: ``[E * capacity, C]``,
    every byte of a padding entry ``pad_byte`` (0: zeros; 0xFF: -1 in an int32 map). Moves bytes, so
    every dtype (fp8, UE8M0) goes through unchanged."""
    entries = m.counts.numel() * m.capacity
    b = row_bytes(rows)
    flat = torch.full((entries + 1, b.shape[1]), pad_byte, dtype=torch.uint8, device=b.device)
    flat[m.dest] = b  # slots of no local expert all land on the spare entry, cut off below
    return from_row_bytes(flat[:entries], rows.dtype, rows.shape[1])


def expert_layout(m: ExpertMap, out: torch.Tensor, out_scales: Optional[torch.Tensor],
                  out_weights: Optional[torch.Tensor], recv_src: torch.Tensor, total: int) -> EpExpertLayout:
    """The expert-major layout of the received rows ``[0, total)`` (see :class:`EpExpertLayout`)."""
    E, C, k, device = m.counts.numel(), m.capacity, m.topk, out.device
    row = torch.arange(total, device=device, dtype=torch.int64).repeat_interleave(k)
    slot = torch.arange(k, device=device, dtype=torch.int32).repeat(total)
    ints = torch.stack([row.to(torch.int32), recv_src[:total].to(torch.int32)[row], slot], dim=1)
    maps = _scatter_rows(m, ints, 0xFF).reshape(E, C, 3)
    x = _scatter_rows(m, out[:total][row], 0).reshape(E, C, out.shape[1])
    scales = None if out_scales is None else _scatter_rows(m, out_scales[:total][row], 0).reshape(E, C, -1)
    weights = None
    if out_weights is not None:
        weights = _scatter_rows(m, out_weights[:total].reshape(-1, 1), 0).reshape(E, C)
    return EpExpertLayout(x=x, scales=scales, weights=weights, recv_row=maps[..., 0].contiguous(),
                          src=maps[..., 1].contiguous(), slot=maps[..., 2].contiguous())


def expert_rows_sum(m: ExpertMap, expert_out: torch.Tensor, total: int) -> torch.Tensor:
    """float32 ``[total, H]``: per receive row, the sum of its entries of ``expert_out [E, C, H]``,
    from +0 in top-k slot order, as the ``expert_sum`` kernel adds them (one ``index_add_`` per slot,
    each adding at most one entry per row). Padding entries are never read."""
    E, C, H = expert_out.shape
    flat = expert_out.reshape(E * C, H).float()
    dest = m.dest[: total * m.topk].view(total, m.topk)
    acc = torch.zeros(total, H, dtype=torch.float32, device=expert_out.device)
    for p in range(m.topk):
        rows = (dest[:, p] < E * C).nonzero()[:, 0]
        acc.index_add_(0, rows, flat[dest[rows, p]])
    return acc


def reference_replay(group, routing: TorchMoeRouting, x: torch.Tensor, weights: Optional[torch.Tensor],
                     scales: Optional[torch.Tensor], exchange: Optional[Exchange] = None):
    """Move a new payload of the same tokens along ``routing`` (no routing, no counts exchange).

    Collective, like the dispatch. Returns ``(out [cap, H], out_weights [cap, k] | None,
    out_scales [cap, S] | None)``; row i is the payload of the token whose original dispatch row i was.
    """
    fields = [row_bytes(x)]
    if weights is not None:
        fields.append(row_bytes(weights.to(torch.float32)))
    if scales is not None:
        fields.append(row_bytes(scales))
    send = pack_rows(fields, routing.send_tok)
    total = routing.total_recv
    recv = torch.empty(total, send.shape[1], dtype=torch.uint8, device=x.device)
    ex = exchange if exchange is not None else Exchange.plain(group)
    ex.all_to_all(recv, send, routing.recv_counts, routing.send_counts)
    outs, off = [], 0
    for f, t in zip(fields, [x] + [v for v in (weights, scales) if v is not None]):
        dtype = torch.float32 if t is weights else t.dtype
        cols = t.shape[1]
        o = torch.empty(routing.recv_capacity, cols, dtype=dtype, device=x.device)
        o[:total] = from_row_bytes(recv[:, off:off + f.shape[1]], dtype, cols)
        outs.append(o)
        off += f.shape[1]
    out = outs.pop(0)
    out_w = outs.pop(0) if weights is not None else None
    out_s = outs.pop(0) if scales is not None else None
    return out, out_w, out_s
