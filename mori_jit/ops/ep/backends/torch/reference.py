"""Reference EP dispatch/combine on ``torch.distributed`` collectives (docs/design.md §6).

This is the algorithm of the ``torch`` backend: it runs on any process group (NCCL/RCCL on GPUs,
gloo on CPU) and serves as the parity oracle for the JIT kernels. It is written for clarity, not
speed: it syncs the host (token counts become Python ints) and allocates freely.

Semantics, exactly as the op's contract:

* ``indices[t, j]`` is an expert id ``e``; its destination rank is ``e // num_experts_per_rank``.
  An id ``< 0`` or ``>= num_experts_per_rank * world_size`` drops that slot.
* A token is sent **once** to each distinct destination rank, carrying its whole row ``x[t]``,
  its full ``weights[t, :]`` and ``indices[t, :]`` (and ``scales[t]`` when given).
* Send order is grouped by destination rank ascending, tokens ascending within a group; received
  rows therefore come grouped by source rank ascending, tokens ascending within a source.
* Combine sends every received row back to its source (cast under ``quant_type``) and sums the
  returned rows of each token in float32 in top-k slot order (an *unweighted* sum; the expert side
  applies the top-k weights): :mod:`.wire`.
* Every rank learns every rank's send counts (one ``all_gather``, :mod:`.counts`), so an error
  that the counts decide (a rank would receive more rows than its capacity, an expert more pairs
  than ``expert_capacity``) is raised on every rank, before any row moves. The collectives run
  through an :class:`~mori_jit.ops.ep.core.watch.Exchange` (plain blocking ones by default; the op
  passes one that bounds its waits).

Every payload travels as raw bytes (``uint8``), packed into one row per sent token, so that dtypes
a backend cannot reduce or even transport (bf16 and fp8 on gloo) move bit-exactly and each leg
costs one counts exchange plus one payload exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from mori_jit.ops.ep.backends.torch.counts import gather_counts
from mori_jit.ops.ep.backends.torch.rows import pack_rows, row_bytes, unpack_rows
from mori_jit.ops.ep.backends.torch.wire import CombineWire, pack_combine, send_positions
from mori_jit.ops.ep.core.watch import Exchange
from mori_jit.ops.ep.errors import EpArgumentError

__all__ = ["TorchRouting", "reference_dispatch", "reference_combine", "DispatchPlan", "plan_dispatch"]


@dataclass
class TorchRouting:
    """Everything :func:`reference_combine` needs to undo one :func:`reference_dispatch` call."""

    recv_src: torch.Tensor
    """int32 ``[recv_rows]``: flat source id ``srcRank * M + srcTok`` of each received row, in
    receive order (source rank ascending, source token ascending within a source)."""

    send_counts: list[int]
    """Rows this rank sent to each peer rank (index = destination rank)."""

    recv_counts: list[int]
    """Rows this rank received from each peer rank (index = source rank)."""

    send_tok: torch.Tensor
    """int64 ``[sum(send_counts)]``: local token index of each sent row, grouped by destination
    rank ascending (tokens ascending within a group). Combine's returned rows arrive in this order."""

    num_tokens: int
    """``n``, the number of local tokens of the dispatch call (rows of combine's output)."""

    send_pos: torch.Tensor
    """int64 ``[sum(send_counts)]``: for each sent row, the token's first top-k slot on its
    destination: where the returned row falls in the token's sum (:mod:`.wire`)."""

    @property
    def total_recv(self) -> int:
        """Number of rows received by dispatch (valid rows of the dispatch output)."""
        return sum(self.recv_counts)


def _destination_mask(indices: torch.Tensor, world_size: int, num_experts_per_rank: int) -> torch.Tensor:
    """bool ``[n, world_size]``: ``mask[t, r]`` is True iff some valid slot of token t lives on rank r."""
    n = indices.shape[0]
    idx = indices.long()
    valid = (idx >= 0) & (idx < num_experts_per_rank * world_size)
    # Invalid slots are routed to a spare column that is cut off afterwards.
    dest = torch.where(valid, idx // num_experts_per_rank, torch.full_like(idx, world_size))
    mask = torch.zeros(n, world_size + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(1, dest, True)
    return mask[:, :world_size]


def reference_dispatch(
    group,
    rank: int,
    world_size: int,
    max_tokens_per_rank: int,
    num_experts_per_rank: int,
    x: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor | None,
    indices: torch.Tensor,
    recv_capacity: int,
    exchange: Exchange | None = None,
    expert_capacity: int = 0,
    route_indices: torch.Tensor | None = None,
):
    """Send each token to every distinct rank that holds one of its experts.

    Collective: every rank of ``group`` must call it, with the same ``H``, ``k``, dtypes and the
    same choice of ``scales`` being None or not (they fix the packed row layout).

    Args:
        group: process group (None = default group); ``rank``/``world_size`` are group-relative.
        max_tokens_per_rank: ``M``; ``n`` must be ``<= M`` (flat source ids are ``rank * M + t``).
        x: ``[n, H]`` tokens, any dtype (bf16, f32, fp8, uint8, ...); moved bit-exactly.
        weights: ``[n, k]`` float32 top-k weights (forwarded unchanged).
        scales: ``[n, S]`` per-token scales of any dtype, or None.
        indices: ``[n, k]`` integer expert ids; int32 and int64 travel as they are, other integer
            dtypes as int32.
        recv_capacity: rows of the output buffers.
        exchange: runs the collectives (None: plain blocking ones on ``group``).
        expert_capacity: > 0: every rank refuses a dispatch in which an expert would receive more
            (token, expert) pairs (the op's ``expert_capacity``).
        route_indices: the ids the routing goes by, when they differ from the ``indices`` sent
            (a masked rank's experts as -1: core/mask.py); None: ``indices``.

    Returns:
        ``(out [cap, H] x.dtype, out_weights [cap, k] f32, out_scales [cap, S] | None,
        out_indices [cap, k] int32 | int64 (as indices), total_recv int32 [1] on x.device, routing)``. Only rows
        ``[0, total_recv)`` are valid; the rest are uninitialised.

    Raises:
        ValueError: malformed inputs (checked before any collective, so every rank raises alike).
        EpDeviceError (a RuntimeError): some rank would receive more rows than ``recv_capacity``;
            every rank raises it, after the counts and before any row moves. EpCapacityError (an
            EpDeviceError): likewise for an expert beyond ``expert_capacity``.
    """
    plan = plan_dispatch(group, rank, world_size, max_tokens_per_rank, num_experts_per_rank, x, weights, scales,
                         indices, recv_capacity, exchange, expert_capacity, route_indices)
    plan.exchange.all_to_all(plan.recv, plan.send, plan.routing.recv_counts, plan.routing.send_counts)
    plan.unpack()
    return plan.outputs


class DispatchPlan(NamedTuple):
    """A dispatch up to its payload exchange (:func:`plan_dispatch`): the packed rows to send and
    the buffer they arrive in, the leg's outputs (allocated, filled by ``unpack`` once ``recv`` holds
    the exchange) and the collectives' runner. The blocking reference exchanges then unpacks; the
    split send posts the exchange and its receive unpacks (:mod:`.split`)."""

    send: torch.Tensor
    recv: torch.Tensor
    routing: "TorchRouting"
    outputs: tuple
    unpack: Callable[[], None]
    exchange: Exchange


def plan_dispatch(group, rank: int, world_size: int, max_tokens_per_rank: int, num_experts_per_rank: int,
                  x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor | None, indices: torch.Tensor,
                  recv_capacity: int, exchange: Exchange | None = None, expert_capacity: int = 0,
                  route_indices: torch.Tensor | None = None) -> DispatchPlan:
    """Everything of :func:`reference_dispatch` (same arguments, same checks and errors) but its
    payload exchange: the routing, the counts exchange (collective), the packed send rows and the
    outputs ``(out, out_weights, out_scales, out_indices, total_recv, routing)``."""
    if x.dim() != 2 or indices.dim() != 2 or weights.dim() != 2:
        raise EpArgumentError("x, weights and indices must be 2-D")
    n, hidden = x.shape
    k = indices.shape[1]
    if indices.shape[0] != n or tuple(weights.shape) != (n, k):
        raise EpArgumentError(f"shape mismatch: x {tuple(x.shape)}, weights {tuple(weights.shape)}, "
                         f"indices {tuple(indices.shape)}")
    if n > max_tokens_per_rank:
        raise EpArgumentError(f"n = {n} tokens exceeds max_tokens_per_rank = {max_tokens_per_rank}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise EpArgumentError(f"indices must be an integer tensor, got {indices.dtype}")
    if scales is not None and (scales.dim() != 2 or scales.shape[0] != n):
        raise EpArgumentError(f"scales must be [n, S] with n = {n}, got {tuple(scales.shape)}")
    device = x.device
    ex = exchange if exchange is not None else Exchange.plain(group)

    # --- routing: which (destination, token) pairs to send, in send order ------------------------
    route = indices if route_indices is None else route_indices
    mask = _destination_mask(route.to(device), world_size, num_experts_per_rank)
    # nonzero() on the transposed mask yields (dest, tok) in row-major order: grouped by
    # destination ascending, tokens ascending inside a group -- exactly the send order.
    pairs = mask.t().nonzero()
    send_tok = pairs[:, 1].contiguous()
    send_pos = send_positions(route, pairs, world_size, num_experts_per_rank)
    send_counts, recv_counts = gather_counts(mask, route, rank, world_size, num_experts_per_rank, recv_capacity,
                                             expert_capacity, ex)
    total = sum(recv_counts)

    # --- payload: one packed byte row per sent token ---------------------------------------------
    src_id = (rank * max_tokens_per_rank
              + torch.arange(n, device=device, dtype=torch.int64)).to(torch.int32).unsqueeze(1)
    # int64 ids travel whole: an out-of-range id cast to int32 could wrap into a valid one
    id_dtype = indices.dtype if indices.dtype in (torch.int32, torch.int64) else torch.int32
    fields = [
        row_bytes(src_id),
        row_bytes(indices.to(device=device, dtype=id_dtype)),
        row_bytes(weights.to(device=device, dtype=torch.float32)),
        row_bytes(x),
    ]
    if scales is not None:
        fields.append(row_bytes(scales.to(device)))
    send = pack_rows(fields, send_tok)
    recv = torch.empty(total, send.shape[1], dtype=torch.uint8, device=device)
    out_indices = torch.empty(recv_capacity, k, dtype=id_dtype, device=device)
    out_weights = torch.empty(recv_capacity, k, dtype=torch.float32, device=device)
    out = torch.empty(recv_capacity, hidden, dtype=x.dtype, device=device)
    out_scales = None
    if scales is not None:
        out_scales = torch.empty(recv_capacity, scales.shape[1], dtype=scales.dtype, device=device)
    recv_src = torch.empty(total, 1, dtype=torch.int32, device=device)
    total_recv = torch.empty(1, dtype=torch.int32, device=device)
    routing = TorchRouting(recv_src=recv_src.view(total), send_counts=send_counts, recv_counts=recv_counts,
                           send_tok=send_tok, num_tokens=n, send_pos=send_pos)

    def unpack() -> None:
        unpack_rows(recv, [recv_src, out_indices, out_weights, out, out_scales], total)
        total_recv.fill_(total)

    return DispatchPlan(send, recv, routing, (out, out_weights, out_scales, out_indices, total_recv, routing), unpack,
                        ex)


def reference_combine(
    group,
    routing: TorchRouting,
    expert_out: torch.Tensor,
    weights: torch.Tensor | None,
    out_dtype: torch.dtype,
    exchange: Exchange | None = None,
    wire: CombineWire = CombineWire(),
):
    """Return each received row to its source and sum the rows of every token in float32.

    Collective: every rank must call it with the same ``H``, dtype and choice of ``weights``
    being None or not.

    Args:
        routing: from the matching :func:`reference_dispatch` call.
        expert_out: ``[>= total_recv, H]``; row i is the expert output of dispatch row i. Only
            rows ``[0, total_recv)`` are read.
        weights: ``[>= total_recv, k]`` weights to sum alongside (converted to float32), or None.
        out_dtype: dtype of ``y``. Byte dtypes (fp8, uint8, ...) are refused: they can be moved
            but not summed.
        exchange: runs the collective (None: a plain blocking one on ``group``).
        wire: the combine wire (``quant_type``): rows travel as it casts them (:mod:`.wire`).

    Returns:
        ``(y [n, H] out_dtype, y_w [n, k] f32 | None)``: ``y[t]`` is the float32 sum of the rows
        returned for token t (zeros for a token with no destination), cast to ``out_dtype``;
        ``y_w`` likewise for the weights.
    """
    total = routing.total_recv
    if expert_out.dim() != 2 or expert_out.shape[0] < total:
        raise EpArgumentError(f"expert_out must be [>= {total}, H], got {tuple(expert_out.shape)}")
    if weights is not None and (weights.dim() != 2 or weights.shape[0] < total):
        raise EpArgumentError(f"weights must be [>= {total}, k], got {tuple(weights.shape)}")
    for what, dt in (("expert_out", expert_out.dtype), ("out_dtype", out_dtype)):
        if not dt.is_floating_point or dt.itemsize == 1:
            raise EpArgumentError(f"combine sums rows; {what} dtype {dt} cannot be summed")
    device = expert_out.device
    fields, unpack = pack_combine(expert_out, weights, total, wire)
    send = pack_rows(fields, None)
    # Reverse exchange: what we received from peer r goes back to r, and we get back exactly the
    # rows we sent, in our send order (which is routing.send_tok's order).
    back = torch.empty(sum(routing.send_counts), send.shape[1], dtype=torch.uint8, device=device)
    ex = exchange if exchange is not None else Exchange.plain(group)
    ex.all_to_all(back, send, routing.send_counts, routing.recv_counts)
    y, y_w = unpack(back, routing.send_tok.to(device), routing.send_pos.to(device), routing.num_tokens)
    return y.to(out_dtype), y_w
