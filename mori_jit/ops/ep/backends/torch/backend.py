"""The ``torch`` backend: EP dispatch/combine on ``torch.distributed`` collectives.

The parity oracle and the baseline users would otherwise write. Runs on any process group (NCCL,
RCCL, gloo on CPU). It syncs the host (token counts) and cannot be captured in a graph. It is the
reference of every MoE feature (docs/design.md §6): per-token scales, ``dispatch_quant_type``, int64 ids,
local expert counts, the expert-major layout and its combine, and routing replay.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.core.schedule import Schedule
from mori_jit.ops.ep.core.op import EpDispatchCombineOp, KernelSet
from mori_jit.ops.ep.quant import combine_quant_gap, quant_spec, quantize
from mori_jit.ops.ep.backends.torch.reference import reference_combine, reference_dispatch
from mori_jit.ops.ep.backends.torch.reference_moe import TorchMoeRouting, expert_layout, expert_map, expert_rows_sum, reference_replay
from mori_jit.ops.ep.errors import EpCapacityError

__all__ = ["EpDispatchCombineOpTorch", "TORCH_COMBINE_QUANT_TYPES"]

#: The combine-wire quantizations (mori's ``quant_type``) this backend serves.
TORCH_COMBINE_QUANT_TYPES = ("none",)


class EpDispatchCombineOpTorch(EpDispatchCombineOp):
    """EP op on ``all_to_all_single``; same contract as the ``hip`` backend."""

    def _unsupported(self, cfg: EpDispatchCombineConfig) -> list[str]:
        missing = [] if cfg.combine_mode == "gather" else [f"combine_mode={cfg.combine_mode!r} (only 'gather')"]
        combine_gap = combine_quant_gap(cfg, TORCH_COMBINE_QUANT_TYPES)
        return missing + ([combine_gap] if combine_gap else [])

    def _device(self, cfg: EpDispatchCombineConfig) -> torch.device:
        if dist.get_backend(self.group) == "gloo" or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _regions(self, cfg: EpDispatchCombineConfig) -> dict[str, int]:
        return {}  # buffers come from the collectives; no symmetric arena

    def _build_kernels(self, cfg: EpDispatchCombineConfig, arena) -> KernelSet:
        group, spec, device = self.group, quant_spec(cfg.dispatch_quant_type), self.device

        def payload(x, scales):
            # under dispatch_quant_type the op makes the fp8 rows and their scales; else they are the caller's
            return quantize(x, spec, cfg.scale_type_size) if spec is not None else (x, scales)

        def moe_outputs(routing, out, out_w, out_s):
            m = routing.experts
            if m is None:
                return None
            layout = None
            if m.capacity:
                layout = expert_layout(m, out, out_s, out_w, routing.recv_src, routing.total_recv)
            return m.counts, layout

        def dispatch(_v, x, weights, scales, indices):
            x, scales = payload(x, scales)
            w = weights if weights is not None else torch.zeros(indices.shape, dtype=torch.float32, device=x.device)
            out, out_w, out_s, out_idx, total, base = reference_dispatch(
                group, cfg.rank, cfg.world_size, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank,
                x, w, scales, indices, cfg.recv_capacity)
            experts = None
            if cfg.expert_counts:  # (raises EpCapacityError on overflow, after the exchange)
                experts = expert_map(out_idx, base.total_recv, cfg.rank, cfg.num_experts_per_rank, cfg.expert_capacity)
            routing = TorchMoeRouting(**vars(base), out_indices=out_idx, experts=experts,
                                      recv_capacity=cfg.recv_capacity)
            out_w = out_w if weights is not None else None
            return out, out_w, out_s, out_idx, total, routing, moe_outputs(routing, out, out_w, out_s)

        def replay(_v, x, weights, scales, routing):
            x, scales = payload(x, scales)
            out, out_w, out_s = reference_replay(group, routing, x, weights, scales)
            total = torch.tensor([routing.total_recv], dtype=torch.int32, device=x.device)
            return (out, out_w, out_s, routing.out_indices, total, routing,
                    moe_outputs(routing, out, out_w, out_s))

        def combine(_v, inp, weights, routing, out, out_w):
            y, y_w = reference_combine(group, routing, inp, weights, cfg.combine_dtype)
            if out is not None:
                y = out.copy_(y)
            if out_w is not None:
                y_w = out_w.copy_(y_w)
            return y, y_w

        def combine_expert_major(_v, inp, routing, out):
            # each receive row's entries summed here in float32, sent as float32: one rounding, at the end
            rows = expert_rows_sum(routing.experts, inp, routing.total_recv)
            y, _ = reference_combine(group, routing, rows, None, cfg.combine_dtype)
            return out.copy_(y) if out is not None else y

        buffer = []  # the combine input buffer, made on first request (an op that never asks costs nothing)

        def combine_input_buffer():
            if not buffer:
                buffer.append(torch.empty(cfg.recv_capacity, cfg.hidden_dim, dtype=cfg.combine_dtype, device=device))
            return buffer[0]

        return KernelSet(dispatch=dispatch, combine=combine, schedule=Schedule((None,), ((0, 0),), ((0, 0),)),
                         capabilities=frozenset({"scales", "gloo", "nccl", "host_collectives"}),
                         combine_input_buffer=combine_input_buffer, replay=replay,
                         combine_expert_major=combine_expert_major)
