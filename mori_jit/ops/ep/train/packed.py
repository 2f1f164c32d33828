"""The packed expert-sorted layout: what prefill and training feed grouped GEMMs.

The received (token, local expert) pairs, one per valid top-k slot, laid out contiguously expert by
expert, receive row ascending then slot within an expert; each expert's group padded with zero rows
to a multiple of ``alignment`` (DeepEP's ``expert_alignment``), with the groups' end offsets on the
device (what ``torch._grouped_mm(x, w, offs=offsets)`` and DeepGEMM's contiguous grouped GEMM take)
and the map back (each packed row's receive row and slot). No capacity per expert: the layout has
``rows_bound(cap, k, E, alignment) = cap * k + E * (alignment - 1)`` rows, the most that any routing
of ``cap`` received rows needs, so its shape is static (graph-capturable) and nothing overflows.

Built from a differentiable dispatch's outputs with device tensor ops only (a stable sort, scatters,
gathers: no host sync, no new kernel), so it serves both backends and is differentiable: gradients
of ``x`` and ``weights`` flow back to the dispatch's ``out`` and ``weights``. :func:`unpack` sums each
receive row's expert outputs in float32 (the way back); :func:`combine_packed` then combines.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from mori_jit.ops.ep.errors import EpArgumentError
from mori_jit.ops.ep.train.functional import TrainDispatch, combine
from mori_jit.ops.ep.train.legs import row_mask, take

__all__ = ["EpPackedLayout", "rows_bound", "pack", "unpack", "combine_packed"]


class EpPackedLayout(NamedTuple):
    """The packed layout of one dispatch's received pairs (``P = rows_bound(...)`` rows)."""

    x: Tensor
    """``[P, H]`` the dispatch's ``out`` dtype: each pair's token row; zeros on padding. Differentiable."""

    weights: Optional[Tensor]
    """``[P]`` float32: each pair's top-k weight, 0 on padding (None when dispatch got no weights).
    Differentiable."""

    offsets: Tensor
    """``[E]`` int32: end of each local expert's group (cumulative, each group a multiple of the
    alignment): expert e owns rows ``[offsets[e-1], offsets[e])``. Rows from ``offsets[-1]`` on
    are padding too."""

    counts: Tensor
    """``[E]`` int32: valid pairs per local expert (before padding)."""

    row: Tensor
    """``[P]`` int32: each packed row's receive row in ``out``; ``-1`` marks padding."""

    slot: Tensor
    """``[P]`` int32: which top-k slot of its row names the expert; ``-1`` marks padding."""

    pair_at: Tensor
    """``[cap, k]`` int32: the packed row of each receive row's top-k slot, ``-1`` where the slot
    names no local expert (the inverse of ``row`` and ``slot``: what :func:`unpack` gathers by)."""

    def mask(self, y: Tensor) -> Tensor:
        """``y [P, ...]`` with every padding row zero, whatever it held (NaN included): a grouped GEMM
        leaves rows past ``offsets[-1]`` unspecified."""
        keep = (self.row >= 0).reshape(-1, *([1] * (y.dim() - 1)))
        return torch.where(keep, y, torch.zeros((), dtype=y.dtype, device=y.device))


def rows_bound(cap: int, k: int, experts_per_rank: int, alignment: int) -> int:
    """Rows of the packed layout: every received row's k slots, plus each expert's padding."""
    return cap * k + experts_per_rank * (alignment - 1)


def pack(d: TrainDispatch, rank: int, experts_per_rank: int, alignment: int = 1) -> EpPackedLayout:
    """The packed layout of dispatch ``d`` on ``rank`` (local experts ``rank * E ... rank * E + E - 1``)."""
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise EpArgumentError(f"alignment: {alignment!r}; allowed: an int >= 1 (rows per expert group are padded "
                              f"to a multiple of it)")
    if not isinstance(experts_per_rank, int) or experts_per_rank < 1:
        raise EpArgumentError(f"experts_per_rank: {experts_per_rank!r}; allowed: the op's num_experts_per_rank")
    out, idx, dev = d.out, d.indices, d.out.device
    cap, k = idx.shape
    E, A = experts_per_rank, alignment
    P, pairs = rows_bound(cap, k, E, A), cap * k
    local = idx.long() - rank * E
    ok = (local >= 0) & (local < E) & row_mask(d.total_recv, cap).unsqueeze(1)
    key = torch.where(ok, local, E).reshape(-1)  # E: no local expert (a spare group, dropped)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + (A - 1)) // A * A
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends - padded, ends.new_full((1,), P)])  # the spare group starts past the layout
    # each pair's place in its group: its rank in a stable sort by expert
    sorted_key, order = torch.sort(key, stable=True)
    first = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(key).scatter_(0, order, torch.arange(pairs, device=dev) - first[sorted_key])
    dest = torch.where(key < E, starts[key] + pos, P)
    pair_of = torch.full((P + 1,), pairs, dtype=torch.int64, device=dev)
    pair_of = pair_of.scatter_(0, dest, torch.arange(pairs, device=dev))[:P]  # (spare pairs land on row P)
    used = pair_of < pairs
    row = torch.where(used, pair_of // k, -1)
    x = take(out, torch.where(used, row, cap))
    w = None if d.weights is None else take(d.weights.reshape(-1, 1), pair_of).reshape(P)
    slot = torch.where(used, pair_of % k, -1)
    pair_at = torch.where(dest < P, dest, -1).reshape(cap, k)
    return EpPackedLayout(x, w, ends.to(torch.int32), counts[:E].to(torch.int32), row.to(torch.int32),
                          slot.to(torch.int32), pair_at.to(torch.int32))


def unpack(layout: EpPackedLayout, y: Tensor, num_rows: int) -> Tensor:
    """float32 ``[num_rows, H]``: per receive row, the sum of its packed rows of ``y [P, H]`` (the
    experts' outputs, weighted on the expert side), in slot order; padding rows never reach a sum.
    ``num_rows``: the dispatch's receive rows (``cap``). Differentiable.

    A gather by ``pair_at`` and a float32 sum over the ``k`` slots: deterministic, and no pass over
    the padding, no float32 copy of ``y`` and no atomics (a scatter-add would have all three)."""
    P = layout.row.shape[0]
    if y.dim() != 2 or y.shape[0] != P:
        raise EpArgumentError(f"y: shape {list(y.shape)}; allowed: [{P}, hidden] (one row per packed row)")
    cap, k = layout.pair_at.shape
    if num_rows != cap:
        raise EpArgumentError(f"num_rows: {num_rows!r}; allowed: {cap} (the dispatch's receive rows)")
    at = torch.where(layout.pair_at >= 0, layout.pair_at.long(), P).reshape(-1)
    return take(y, at).reshape(cap, k, y.shape[1]).sum(1, dtype=torch.float32)


def combine_packed(handle: int, y: Tensor, layout: EpPackedLayout, d: TrainDispatch,
                   dtype: Optional[torch.dtype] = None) -> Tensor:
    """Differentiable combine of packed expert outputs ``y [P, H]`` (weighted on the expert side):
    :func:`unpack`, rounded once to ``dtype`` (the op's combine dtype; default ``y.dtype``), then
    :func:`~.functional.combine`. Returns ``[n, H]``."""
    rows = unpack(layout, y, d.out.shape[0]).to(dtype or y.dtype)
    return combine(handle, rows, d)[0]
