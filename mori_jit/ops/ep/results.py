"""What ``dispatch(..., return_result=True)`` returns: every output by name, with the MoE outputs.

Shorthands in the shapes below: ``cap = cfg.recv_capacity``, ``H = cfg.hidden_dim``,
``k = cfg.num_experts_per_token``, ``S = cfg.scale_dim``, ``E = cfg.num_experts_per_rank``,
``C = cfg.expert_capacity``, ``M = cfg.max_num_inp_token_per_rank``. Every tensor lives on the op's
device. No field needs a host sync to produce or to use (a backend that syncs anyway says so).

Why a result object beside the tuple: ``dispatch()`` keeps returning the 5-tuple (6 with
``return_routing``) that existing code unpacks by position; outputs the tuple never had (the expert
counts, the expert-major layout) come only by name, and only when asked for, so a caller that does
not ask pays nothing for building them.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

__all__ = ["EpDispatchResult", "EpExpertLayout"]


class EpExpertLayout(NamedTuple):
    """The received (token, local expert) pairs laid out expert by expert (``cfg.expert_capacity > 0``).

    Entry ``(e, c)`` is valid iff ``c < expert_counts[e]``; the valid entries of an expert are
    packed at its front, in no order the contract fixes (the ``torch`` backend: receive row
    ascending, then top-k slot). A token whose top-k names one expert twice has two entries. This
    is what a masked or grouped GEMM consumes directly (DeepEP's low-latency layout, mori's StdMoE).
    """

    x: torch.Tensor
    """``[E, C, H]`` dispatch dtype (fp8 e4m3 under ``dispatch_quant_type``): the token row of each entry.
    Padding rows hold unspecified values (the ``torch`` backend: zeros): mask them, never read them."""

    scales: Optional[torch.Tensor]
    """``[E, C, S]`` the scales of each entry's row (dtype of the scales), or None without scales."""

    weights: Optional[torch.Tensor]
    """``[E, C]`` float32: the top-k weight of the entry's slot (0 on padding), or None when dispatch
    got no weights. The expert side applies it (see ``combine_expert_major``)."""

    recv_row: torch.Tensor
    """``[E, C]`` int32: the entry's row in the receive buffer ``out``; ``-1`` marks padding."""

    src: torch.Tensor
    """``[E, C]`` int32: the entry's source token ``srcRank * M + srcTok``; ``-1`` marks padding."""

    slot: torch.Tensor
    """``[E, C]`` int32: which of the token's k top-k slots names this expert; ``-1`` marks padding."""


class EpDispatchResult(NamedTuple):
    """Every output of one dispatch (``dispatch(..., return_result=True)``); the first six are the
    tuple ``dispatch(..., return_routing=True)`` returns, in the same order."""

    out: torch.Tensor
    """``[cap, H]`` dispatch dtype: received token rows, valid below ``total_recv``, in arrival order."""

    out_weights: Optional[torch.Tensor]
    """``[cap, k]`` float32: each received token's top-k weights, or None when dispatch got none."""

    out_scales: Optional[torch.Tensor]
    """``[cap, S]`` (the scales' dtype: float32, or UE8M0 bytes when ``scale_type_size=1``): each
    received row's scales (the caller's, or the op's own under ``dispatch_quant_type``); None when ``S == 0``."""

    out_indices: torch.Tensor
    """``[cap, k]`` ``cfg.index_dtype``: each received token's expert ids, as its source sent them."""

    total_recv: torch.Tensor
    """``[1]`` int32: how many rows of ``out`` are valid."""

    routing: Any
    """The backend's routing: what ``combine``, ``combine_expert_major`` and a replay
    (``dispatch(..., routing=)``) take back. Valid until this op's next dispatch that is not a replay."""

    expert_counts: Optional[torch.Tensor]
    """``[E]`` int32: received (token, local expert) pairs per local expert, one per top-k slot
    (``cfg.expert_counts``; else None). The true count even when it exceeds ``C`` (then
    :class:`EpCapacityError` is raised)."""

    expert: Optional[EpExpertLayout]
    """The expert-major layout (``cfg.expert_capacity > 0``; else None)."""

    @classmethod
    def of(cls, outputs: tuple) -> "EpDispatchResult":
        """From a backend's dispatch tuple ``(out, out_w, out_s, out_idx, total, routing[, moe])``,
        where ``moe`` is ``(expert_counts, expert)`` or absent (a backend without either)."""
        counts, expert = outputs[6] if len(outputs) > 6 and outputs[6] is not None else (None, None)
        return cls(*outputs[:6], counts, expert)
