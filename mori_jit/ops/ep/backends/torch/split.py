"""The ``torch`` backend's legs in two halves (:mod:`mori_jit.ops.ep.core.overlap`).

A send does everything up to the payload exchange: routing, the counts exchange (a blocking
collective: it sizes the payload, and every rank raises an overflow it shows, :mod:`.counts`), the
packing, and then posts the payload exchange
(``all_to_all_single(..., async_op=True)``); it returns the leg's outputs, allocated but not yet
filled, and a ``receive`` that waits for the exchange and unpacks into them. The collectives run
through an :class:`~mori_jit.ops.ep.core.watch.Exchange` (the op passes one that bounds their
waits, the receive's included). The algorithm, its
order and its byte layout are :mod:`.reference`'s (``reference_dispatch``, ``reference_combine``,
``reference_replay``), whose helpers these use; ``tests/test_ep_overlap_cpu.py`` holds both
against each other and against the golden checks.

The payload is packed (copied) by the send, so the caller's inputs are free once it returns.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mori_jit.ops.ep.backends.torch.reference import TorchRouting, plan_dispatch
from mori_jit.ops.ep.backends.torch.rows import pack_rows, row_bytes, unpack_rows
from mori_jit.ops.ep.backends.torch.wire import CombineWire, pack_combine
from mori_jit.ops.ep.core.watch import Exchange
from mori_jit.ops.ep.results import EpExpertLayout

__all__ = ["post_dispatch", "post_replay", "post_combine", "empty_moe_outputs", "fill_moe_outputs"]

Receive = Callable[[], None]


def post_dispatch(group, rank: int, world_size: int, max_tokens_per_rank: int, num_experts_per_rank: int,
                  x: torch.Tensor, weights: torch.Tensor, scales: Optional[torch.Tensor], indices: torch.Tensor,
                  recv_capacity: int, exchange: Optional[Exchange] = None, expert_capacity: int = 0,
                  route_indices: Optional[torch.Tensor] = None) -> tuple[tuple, Receive]:
    """:func:`~.reference.reference_dispatch` as a send and a receive (same arguments, same outputs,
    filled by the receive; the same errors, from the send, on every rank): its plan, with the
    payload exchange posted."""
    plan = plan_dispatch(group, rank, world_size, max_tokens_per_rank, num_experts_per_rank, x, weights, scales,
                         indices, recv_capacity, exchange, expert_capacity, route_indices)
    wait = plan.exchange.post_all_to_all(plan.recv, plan.send, plan.routing.recv_counts, plan.routing.send_counts)

    def receive() -> None:
        wait()
        plan.unpack()

    return plan.outputs, receive


def post_replay(group, routing, x: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                exchange: Optional[Exchange] = None) -> tuple[tuple, Receive]:
    """:func:`~.reference_moe.reference_replay` as a send and a receive: ``(out, out_weights,
    out_scales)`` (filled by the receive) and the receive."""
    payload = [x] + [t for t in (weights, scales) if t is not None]
    fields = [row_bytes(t if t is not weights else t.to(torch.float32)) for t in payload]
    send = pack_rows(fields, routing.send_tok)
    total = routing.total_recv
    recv = torch.empty(total, send.shape[1], dtype=torch.uint8, device=x.device)
    ex = exchange if exchange is not None else Exchange.plain(group)
    wait = ex.post_all_to_all(recv, send, routing.recv_counts, routing.send_counts)

    def like(t):
        if t is None:
            return None
        dtype = torch.float32 if t is weights else t.dtype
        return torch.empty(routing.recv_capacity, t.shape[1], dtype=dtype, device=x.device)

    outs = (like(x), like(weights), like(scales))

    def receive() -> None:
        wait()
        unpack_rows(recv, list(outs), total)

    return outs, receive


def post_combine(group, routing: TorchRouting, expert_out: torch.Tensor, weights: Optional[torch.Tensor],
                 out_dtype: torch.dtype, out: Optional[torch.Tensor], out_weights: Optional[torch.Tensor],
                 exchange: Optional[Exchange] = None, wire: CombineWire = CombineWire()) -> tuple[tuple, Receive]:
    """:func:`~.reference.reference_combine` as a send and a receive: ``(y, y_w)`` (``out`` /
    ``out_weights`` when given, else new; filled by the receive) and the receive."""
    total, device, hidden = routing.total_recv, expert_out.device, expert_out.shape[1]
    fields, unpack = pack_combine(expert_out, weights, total, wire)
    send = pack_rows(fields, None)
    back = torch.empty(sum(routing.send_counts), send.shape[1], dtype=torch.uint8, device=device)
    ex = exchange if exchange is not None else Exchange.plain(group)
    wait = ex.post_all_to_all(back, send, routing.send_counts, routing.recv_counts)
    n = routing.num_tokens
    y = out if out is not None else torch.empty(n, hidden, dtype=out_dtype, device=device)
    y_w = None
    if weights is not None:
        y_w = out_weights if out_weights is not None else torch.empty(n, weights.shape[1], dtype=torch.float32,
                                                                      device=device)

    def receive() -> None:
        wait()
        y32, w32 = unpack(back, routing.send_tok.to(device), routing.send_pos.to(device), n)
        y.copy_(y32)
        if y_w is not None:
            y_w.copy_(w32)

    return (y, y_w), receive


def empty_moe_outputs(cfg, out: torch.Tensor, out_weights: Optional[torch.Tensor],
                      out_scales: Optional[torch.Tensor]):
    """The MoE outputs a send returns before its receive fills them (:func:`fill_moe_outputs`):
    ``(expert_counts, expert_layout | None)`` shaped as the dispatch's would be, or None without
    ``cfg.expert_counts``."""
    if not cfg.expert_counts:
        return None
    E, C, dev = cfg.num_experts_per_rank, cfg.expert_capacity, out.device
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    if not C:
        return counts, None
    ints = [torch.empty(E, C, dtype=torch.int32, device=dev) for _ in range(3)]
    return counts, EpExpertLayout(
        x=torch.empty(E, C, out.shape[1], dtype=out.dtype, device=dev),
        scales=None if out_scales is None else torch.empty(E, C, out_scales.shape[1], dtype=out_scales.dtype,
                                                           device=dev),
        weights=None if out_weights is None else torch.empty(E, C, dtype=torch.float32, device=dev),
        recv_row=ints[0], src=ints[1], slot=ints[2])


def fill_moe_outputs(empty, got) -> None:
    """Copy the MoE outputs ``got`` (``(counts, layout | None)``) into ``empty`` (the send's)."""
    if empty is None:
        return
    empty[0].copy_(got[0])
    if empty[1] is not None:
        for dst, src in zip(empty[1], got[1]):
            if dst is not None:
                dst.copy_(src)
