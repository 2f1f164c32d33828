"""A worked top-k MoE block on the EP op: route, dispatch, grouped GEMMs on the expert-major
layout, combine — with no host sync in the block's own code.

The op must be configured for it: ``expert_counts=True``, ``expert_capacity`` > 0 (rows per local
expert; at most ``world_size * max_num_inp_token_per_rank`` pairs can reach one expert when the
top-k picks distinct experts), ``index_dtype=torch.int64`` (what :func:`route` produces), a bf16
combine. The payload may be:

* bf16 rows (``data_type=torch.bfloat16``);
* fp8 rows the op casts on the way (``dispatch_quant_type="fp8_e4m3_block128"``): the block passes bf16;
* fp8 rows with the block's own scales (``dispatch_data_type=float8_e4m3fn``, ``scale_dim =
  hidden / 128``, no ``dispatch_quant_type``): the block quantizes before the dispatch.

Each expert is ``f_e(v) = silu(v @ w_up[e]) @ w_down[e]`` (bf16 weights); the experts of a rank run
as two grouped GEMMs over ``[E, capacity, ...]`` (``torch._grouped_mm`` where torch has it, else one
matmul per expert), so padding rows are computed and then masked by ``expert_counts``; the top-k
weights are applied on the expert side, and :meth:`~mori_jit.ops.ep.core.op.EpDispatchCombineOp.combine_expert_major`
sums. Every step is a device tensor op: with a backend that does not sync (the JIT backend), a step
can be captured in a graph.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mori_jit.ops.ep.quant import DISPATCH_QUANT_TYPES, dequantize, quantize
from mori_jit.ops.ep.results import EpExpertLayout

__all__ = ["MoeExperts", "MoeBlock", "route", "grouped_mm", "run_experts"]

#: the block quantization of fp8 payloads (the op's own under dispatch_quant_type, the block's otherwise)
FP8_BLOCK = DISPATCH_QUANT_TYPES["fp8_e4m3_block128"]


@dataclasses.dataclass(frozen=True)
class MoeExperts:
    """One rank's experts: ``w_up [E, hidden, ffn]`` and ``w_down [E, ffn, hidden]``, bf16, where
    ``E = num_experts_per_rank`` (rank r holds global experts ``r * E ... r * E + E - 1``)."""

    w_up: torch.Tensor
    w_down: torch.Tensor


def route(x: torch.Tensor, gate: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``(weights [n, k] float32, ids [n, k] int64)`` from ``x [n, hidden]`` and
    ``gate [hidden, num_experts]``: softmax over the experts, the k largest, renormalized to sum 1."""
    probs = torch.softmax(x.float() @ gate.float(), dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.contiguous()


def grouped_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[E, C, K] @ [E, K, N] -> [E, C, N]`` (bf16), one GEMM per group: ``torch._grouped_mm``
    where torch has it, else a matmul per expert."""
    mm = getattr(torch, "_grouped_mm", None)
    if mm is not None:
        return mm(a, b)
    return torch.stack([a[e] @ b[e] for e in range(a.shape[0])])


def expert_inputs(layout: EpExpertLayout) -> torch.Tensor:
    """The layout's rows as bf16 ``[E, C, hidden]``: fp8 rows times their block scales, else as they are."""
    if layout.scales is not None and layout.x.element_size() == 1:
        return dequantize(layout.x, layout.scales, FP8_BLOCK.block, torch.bfloat16)
    return layout.x.to(torch.bfloat16)


def run_experts(layout: EpExpertLayout, counts: torch.Tensor, experts: MoeExperts,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Every local expert on its entries: ``[E, C, hidden]`` ``out_dtype``, each valid entry's
    ``weight * f_e(row)``, zeros on padding (whatever the padding rows held). No host sync."""
    v = expert_inputs(layout)
    h = torch.nn.functional.silu(grouped_mm(v, experts.w_up).float()).to(torch.bfloat16)
    y = grouped_mm(h, experts.w_down).float()
    if layout.weights is not None:
        y = y * layout.weights.unsqueeze(-1)
    valid = torch.arange(layout.recv_row.shape[1], device=counts.device) < counts.unsqueeze(1)
    return torch.where(valid.unsqueeze(-1), y, 0.0).to(out_dtype)


class MoeBlock:
    """``y = MoeBlock(op, gate, experts)(x)``: the top-k MoE block of this rank's tokens ``x [n, hidden]``
    (bf16); returns ``[n, hidden]`` bf16. Collective: every rank calls it (with n = 0 if it has no tokens)."""

    def __init__(self, op, gate: torch.Tensor, experts: MoeExperts):
        cfg = op.cfg
        needs = {"expert_counts": cfg.expert_counts is True, "expert_capacity > 0": cfg.expert_capacity > 0,
                 "index_dtype=torch.int64": cfg.index_dtype == torch.int64,
                 "combine dtype bf16": cfg.combine_dtype == torch.bfloat16}
        missing = [what for what, ok in needs.items() if not ok]
        if missing:
            raise ValueError(f"MoeBlock: the op's config lacks {', '.join(missing)}")
        self.op, self.gate, self.experts, self.k = op, gate, experts, cfg.num_experts_per_token
        # fp8 rows without the op's cast: the block quantizes them itself
        self._self_quantize = cfg.dispatch_quant_type in (None, "none") and cfg.dispatch_dtype == FP8_BLOCK.wire_dtype
        self._scale_type_size = cfg.scale_type_size

    def __call__(self, x: torch.Tensor, routing: Optional[tuple] = None) -> torch.Tensor:
        """The block on ``x``; ``routing`` = ``(weights, ids)`` replaces :func:`route`'s."""
        weights, ids = routing if routing is not None else route(x, self.gate, self.k)
        payload, scales = x, None
        if self._self_quantize:
            payload, scales = quantize(x, FP8_BLOCK, self._scale_type_size)
        res = self.op.dispatch(payload, weights, scales, ids, return_result=True)
        expert_out = run_experts(res.expert, res.expert_counts, self.experts)
        return self.op.combine_expert_major(expert_out, routing=res.routing)
