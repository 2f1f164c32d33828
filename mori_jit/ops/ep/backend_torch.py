"""The ``torch`` backend: EP dispatch/combine on ``torch.distributed`` collectives.

The parity oracle and the baseline users would otherwise write. Runs on any process group (NCCL,
RCCL, gloo on CPU). It syncs the host (token counts) and cannot be captured in a graph.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .config import EpDispatchCombineConfig
from .schedule import Schedule
from .op import EpDispatchCombineOp, KernelSet, gather_unquantized_gaps
from .reference import reference_combine, reference_dispatch

__all__ = ["EpDispatchCombineOpTorch"]


class EpDispatchCombineOpTorch(EpDispatchCombineOp):
    """EP op on ``all_to_all_single``; same contract as the ``hip`` backend."""

    def _unsupported(self, cfg: EpDispatchCombineConfig) -> list[str]:
        return gather_unquantized_gaps(cfg)

    def _device(self, cfg: EpDispatchCombineConfig) -> torch.device:
        if dist.get_backend(self.group) == "gloo" or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _regions(self, cfg: EpDispatchCombineConfig) -> dict[str, int]:
        return {}  # buffers come from the collectives; no symmetric arena

    def _build_kernels(self, cfg: EpDispatchCombineConfig, arena) -> KernelSet:
        group = self.group

        def dispatch(_v, x, weights, scales, indices):
            w = weights if weights is not None else torch.zeros(indices.shape, dtype=torch.float32, device=x.device)
            out, out_w, out_s, out_idx, total, routing = reference_dispatch(
                group, cfg.rank, cfg.world_size, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank,
                x, w, scales, indices, cfg.recv_capacity)
            return out, (out_w if weights is not None else None), out_s, out_idx, total, routing

        def combine(_v, inp, weights, routing, out, out_w):
            y, y_w = reference_combine(group, routing, inp, weights, cfg.combine_dtype)
            if out is not None:
                y = out.copy_(y)
            if out_w is not None:
                y_w = out_w.copy_(y_w)
            return y, y_w

        return KernelSet(dispatch=dispatch, combine=combine, schedule=Schedule((None,), ((0, 0),), ((0, 0),)),
                         capabilities=frozenset({"scales", "gloo", "nccl", "host_collectives"}))
