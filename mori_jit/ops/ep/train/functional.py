"""The differentiable calls, as functions of an op's int handle: what a model traced by
``torch.compile(fullgraph=True)`` calls (the op's own methods are differentiable too, through
:mod:`.hooks`, but not traceable).

::

    h = train.register(op)                       # once; an int: a constant of the traced graph
    d = train.dispatch(h, x, weights, ids)       # TrainDispatch: every output, fresh and differentiable
    y, _ = train.combine(h, expert_rows, d)      # rows [<= cap, H] in the combine dtype
    y = train.combine_expert_major(h, expert_out, d)   # needs cfg.expert_capacity

Collective like the op's calls, forward and backward: every rank calls them in the same order, and
every rank's inputs require grad alike (each backward leg is an exchange).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from mori_jit.ops.ep.errors import EpArgumentError
from mori_jit.ops.ep.results import EpExpertLayout
from mori_jit.ops.ep.train import library  # noqa: F401  (registers the custom ops)
from mori_jit.ops.ep.train.legs import take
from mori_jit.ops.ep.train.registry import register

__all__ = ["TrainDispatch", "register", "dispatch", "combine", "combine_expert_major"]


class TrainDispatch(NamedTuple):
    """Every output of a differentiable dispatch (shorthands of :mod:`mori_jit.ops.ep.results`). Every
    tensor is fresh: it outlives the op's next dispatch, and autograd may keep it for the backward."""

    out: Tensor
    """``[cap, H]`` the input dtype (bf16 under ``dispatch_quant_type``: the received fp8 rows times their
    scales): received rows, in arrival order, zeros beyond ``total_recv``. Differentiable."""

    weights: Optional[Tensor]
    """``[cap, k]`` float32 received top-k weights (zeros beyond ``total_recv``), or None without
    weights. Differentiable: its gradient goes home to the dispatch's ``weights``."""

    scales: Optional[Tensor]
    """``[cap, S]`` the caller's scales as received, or None (no gradient)."""

    indices: Tensor
    """``[cap, k]`` the index dtype: received ids, ``-1`` beyond ``total_recv``."""

    total_recv: Tensor
    """``[1]`` int32: valid rows of ``out``."""

    src: Tensor
    """``[cap]`` int32: each received row's ``srcRank * M + srcTok``, ``-1`` beyond ``total_recv``;
    the dispatch's token, which combine takes back."""

    ids: Tensor
    """The ``[n, k]`` ids this rank dispatched: what a backward re-route sends again."""

    expert_counts: Tensor
    """``[E]`` int32: received (token, local expert) pairs per local expert."""

    expert: Optional[EpExpertLayout]
    """The expert-major layout (``cfg.expert_capacity``), ``x`` and ``weights`` gathered from ``out``
    and ``weights`` (differentiable; ``x`` in the input dtype, zeros on padding; ``scales`` None);
    else None."""


def dispatch(handle: int, x: Tensor, weights: Optional[Tensor], ids: Tensor,
             scales: Optional[Tensor] = None) -> TrainDispatch:
    """Differentiable dispatch of ``x [n, H]`` (``cfg.input_dtype``) with top-k ``weights [n, k]``
    (float32, bf16 or fp16; or None) along ``ids [n, k]`` (``cfg.index_dtype``) on the op of ``handle``.
    ``scales``: the caller's per-token scales (no gradient), when the config declares them."""
    out, w, s, idx, total, src, counts, maps = torch.ops.mori_jit.ep_dispatch(handle, x, weights, scales, ids)
    expert = None
    if maps.shape[2]:
        recv_row, esrc, slot = maps[0], maps[1], maps[2]
        cap, k = idx.shape
        E, C = recv_row.shape
        pad = recv_row < 0
        xl = take(out, torch.where(pad, cap, recv_row.long()).reshape(-1)).reshape(E, C, out.shape[1])
        wl = None
        if weights is not None:
            at = torch.where(pad, cap * k, recv_row.long() * k + slot.long()).reshape(-1)
            wl = take(w.reshape(-1, 1), at).reshape(E, C)
        expert = EpExpertLayout(xl, None, wl, recv_row, esrc, slot)
    return TrainDispatch(out, w if weights is not None else None, s if scales is not None else None, idx, total,
                         src, ids, counts, expert)


def combine(handle: int, rows: Tensor, d: TrainDispatch,
            weights: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """Differentiable combine: ``rows [r, H]`` (combine dtype, ``total_recv <= r <= cap``; row i is the
    expert output of ``d.out[i]``, weighted on the expert side) summed per token on its home rank in
    float32. With ``weights [r, k]`` (float32), also their sum. Returns ``(y [n, H], y_w | None)``.
    Runs before the op's next dispatch (the routing must still be the op's latest)."""
    y, y_w = torch.ops.mori_jit.ep_combine(handle, rows, weights, d.ids, d.src)
    return y, (y_w if weights is not None else None)


def combine_expert_major(handle: int, expert_out: Tensor, d: TrainDispatch) -> Tensor:
    """Differentiable ``combine_expert_major`` of ``expert_out [E, C, H]`` (combine dtype, weighted on
    the expert side) for the dispatch ``d``; its gradient lands on the valid entries (zeros on padding)."""
    if d.expert is None:
        raise EpArgumentError("d: a dispatch without the expert-major layout; set EpDispatchCombineConfig."
                              "expert_capacity (and expert_counts=True)")
    return torch.ops.mori_jit.ep_combine_expert_major(handle, expert_out, d.ids, d.src, d.expert.recv_row)
