"""The ``torch`` backend: EP dispatch/combine on ``torch.distributed`` collectives.

The parity oracle and the baseline users would otherwise write. Runs on any process group (NCCL,
RCCL, gloo on CPU). It syncs the host (token counts) and cannot be captured in a graph. It is the
reference of every MoE feature (docs/design.md §6): per-token scales, ``dispatch_quant_type``, int64 ids,
local expert counts, the expert-major layout and its combine, and routing replay; and each leg
as a send and a receive (``split``).

Each call's collectives are waited for with a bound (:mod:`~mori_jit.ops.ep.core.watch`): a rank
that raises between the ranks' agreement and its call's last collective records that, so its peers
raise too instead of waiting in an exchange it left.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.core.schedule import Schedule
from mori_jit.ops.ep.core.op import EpDispatchCombineOp, KernelSet
from mori_jit.ops.ep.quant import COMBINE_WIRE_QUANTS, combine_quant_gap, quant_spec, quantize
from mori_jit.ops.ep.backends.torch.reference import reference_combine, reference_dispatch
from mori_jit.ops.ep.backends.torch.reference_moe import TorchMoeRouting, expert_layout, expert_map, expert_rows_sum, reference_replay
from mori_jit.ops.ep.backends.torch.wire import CombineWire
from mori_jit.ops.ep.backends.torch.split import empty_moe_outputs, fill_moe_outputs, post_combine, post_dispatch, post_replay
from mori_jit.ops.ep.core.watch import Exchange
from mori_jit.ops.ep.errors import EpCapacityError

__all__ = ["EpDispatchCombineOpTorch", "TORCH_COMBINE_QUANT_TYPES", "live_ids"]

#: The combine-wire quantizations (mori's ``quant_type``) this backend serves: none, and each cast
#: :mod:`~mori_jit.ops.ep.quant` defines.
TORCH_COMBINE_QUANT_TYPES = ("none", *COMBINE_WIRE_QUANTS)


def live_ids(indices: torch.Tensor, rank_mask: torch.Tensor, experts_per_rank: int,
             pairs: torch.Tensor) -> torch.Tensor:
    """``indices`` with every valid id of a masked rank's expert (``rank_mask[rank] != 0``) as -1,
    the dispatch's routing ids; ``pairs`` (int32 ``[1]``) gets how many were dropped so."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < experts_per_rank * rank_mask.numel())
    dropped = valid & (rank_mask[torch.where(valid, idx // experts_per_rank, 0)] != 0)
    pairs.copy_(dropped.sum().reshape(1))
    return indices.masked_fill(dropped, -1)


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
        group, spec, watch, device = self.group, quant_spec(cfg.dispatch_quant_type), self._watch, self.device

        def exchange(call: str, collectives: int) -> Exchange:
            # ``collectives``: how many the call makes (a peer may wait in any not yet made); over
            # the live ranks' group once some are masked (core/mask.py)
            return self._rank_mask.exchange(f"{call} of op #{self._number}", collectives)

        rank_mask = torch.zeros(cfg.world_size, dtype=torch.int32, device=device)
        masked_pairs = torch.zeros(1, dtype=torch.int32, device=device)

        def route_ids(indices):
            # the ids the routing goes by: a masked rank's experts dropped as -1 (the payload keeps them)
            if not self._rank_mask.masked:
                masked_pairs.zero_()
                return indices
            return live_ids(indices, rank_mask, cfg.num_experts_per_rank, masked_pairs)

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

        def leg_args(x, weights, scales, indices):
            w = weights if weights is not None else torch.zeros(indices.shape, dtype=torch.float32, device=x.device)
            return (group, cfg.rank, cfg.world_size, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank,
                    x, w, scales, indices, cfg.recv_capacity)

        wire = CombineWire.of(cfg)

        def capacity_of(indices):  # (an overflow: every rank raises, nothing is sent)
            return dict(expert_capacity=cfg.expert_capacity, route_indices=route_ids(indices))

        def experts_of(out_idx, total):
            if not cfg.expert_counts:
                return None
            return expert_map(out_idx, total, cfg.rank, cfg.num_experts_per_rank, cfg.expert_capacity)

        def dispatch(_v, x, weights, scales, indices):
            with exchange("dispatch", 2) as ex:
                x, scales = payload(x, scales)
                out, out_w, out_s, out_idx, total, base = reference_dispatch(*leg_args(x, weights, scales, indices),
                                                                             exchange=ex, **capacity_of(indices))
            experts = experts_of(out_idx, base.total_recv)
            routing = TorchMoeRouting(**vars(base), out_indices=out_idx, experts=experts,
                                      recv_capacity=cfg.recv_capacity)
            out_w = out_w if weights is not None else None
            return out, out_w, out_s, out_idx, total, routing, moe_outputs(routing, out, out_w, out_s)

        def replay(_v, x, weights, scales, routing):
            with exchange("replay", 1) as ex:
                x, scales = payload(x, scales)
                out, out_w, out_s = reference_replay(group, routing, x, weights, scales, exchange=ex)
            total = torch.tensor([routing.total_recv], dtype=torch.int32, device=x.device)
            return (out, out_w, out_s, routing.out_indices, total, routing,
                    moe_outputs(routing, out, out_w, out_s))

        def combine(_v, inp, weights, routing, out, out_w):
            with exchange("combine", 1) as ex:
                y, y_w = reference_combine(group, routing, inp, weights, cfg.combine_dtype, exchange=ex, wire=wire)
            if out is not None:
                y = out.copy_(y)
            if out_w is not None:
                y_w = out_w.copy_(y_w)
            return y, y_w

        def combine_expert_major(_v, inp, routing, out):
            # each receive row's entries summed here in float32, sent as float32: one rounding, at the end
            with exchange("combine_expert_major", 1) as ex:
                rows = expert_rows_sum(routing.experts, inp, routing.total_recv)
                y, _ = reference_combine(group, routing, rows, None, cfg.combine_dtype, exchange=ex, wire=wire)
            return out.copy_(y) if out is not None else y

        buffer = []  # the combine input buffer, made on first request (an op that never asks costs nothing)

        def combine_input_buffer():
            if not buffer:
                buffer.append(torch.empty(cfg.recv_capacity, cfg.hidden_dim, dtype=cfg.combine_dtype, device=device))
            return buffer[0]

        def dispatch_send(_v, x, weights, scales, indices, routing):
            # the legs above as a send that posts the payload exchange and a receive that unpacks it
            fresh = routing is None  # (a replay keeps its dispatch's expert map)
            # (the counts, then the payload's post: the receive waits for it, with the same bound)
            with exchange("dispatch_send", 2 if fresh else 1) as ex:
                x, scales = payload(x, scales)
                if not fresh:
                    (out, out_w, out_s), receive = post_replay(group, routing, x, weights, scales, exchange=ex)
                else:
                    (out, out_w, out_s, out_idx, total, base), receive = post_dispatch(
                        *leg_args(x, weights, scales, indices), exchange=ex, **capacity_of(indices))
            if not fresh:
                total = torch.tensor([routing.total_recv], dtype=torch.int32, device=x.device)
                outputs = (out, out_w, out_s, routing.out_indices, total, routing)
            else:
                routing = TorchMoeRouting(**vars(base), out_indices=out_idx, recv_capacity=cfg.recv_capacity)
                out_w = out_w if weights is not None else None
                outputs = (out, out_w, out_s, out_idx, total, routing)
            moe = empty_moe_outputs(cfg, out, out_w, out_s)

            def finish():
                receive()
                if fresh:
                    routing.experts = experts_of(routing.out_indices, routing.total_recv)
                fill_moe_outputs(moe, moe_outputs(routing, out, out_w, out_s))

            return (*outputs, moe), finish

        def combine_send(_v, inp, weights, routing, out, out_w):
            with exchange("combine_send", 1) as ex:
                return post_combine(group, routing, inp, weights, cfg.combine_dtype, out, out_w, exchange=ex,
                                    wire=wire)

        return KernelSet(dispatch=dispatch, combine=combine, schedule=Schedule((None,), ((0, 0),), ((0, 0),)),
                         capabilities=frozenset({"scales", "gloo", "nccl", "host_collectives"}),
                         combine_input_buffer=combine_input_buffer, replay=replay,
                         combine_expert_major=combine_expert_major, dispatch_send=dispatch_send,
                         combine_send=combine_send, rank_mask=rank_mask, masked_pairs=masked_pairs)
