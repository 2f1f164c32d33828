"""The ``hip`` backend's MoE outputs around the kernels: views of the scale and expert-major layout
regions, made once per dtype, and ``combine_expert_major`` (a local float32 sum per received row, then
the combine moving float32 rows, rounded once). Host work only: the kernels are in ``kernels/ep/``."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mori_jit.ops.ep.memory.arena import SymmArena
from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, EP_ARGS, EXPERT_SUM, EpMaxRecv
from mori_jit.ops.ep.results import EpExpertLayout

__all__ = ["ScaleViews", "ExpertLayouts", "expert_major_combine"]


class ScaleViews:
    """The ``out_scales`` region as ``[cap, scale_dim]`` in the dtype of the scales a dispatch passed
    (float32, UE8M0 bytes, ...: the kernels move bytes), one view per dtype, made once. Under in-op
    quantization the kernels make the scales: ``made`` is their dtype."""

    def __init__(self, arena: SymmArena, cap: int, scale_dim: int, made: Optional[torch.dtype] = None):
        self._arena, self._shape = arena, (cap, scale_dim)
        self._views: dict[torch.dtype, torch.Tensor] = {}
        self._made = None if made is None else arena.view("out_scales", made, self._shape)

    def of(self, scales: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The view in ``scales``' dtype (None: the kernels' own scales, or no scales)."""
        if scales is None:
            return self._made
        view = self._views.get(scales.dtype)
        if view is None:
            view = self._views[scales.dtype] = self._arena.view("out_scales", scales.dtype, self._shape)
        return view


class ExpertLayouts:
    """The expert-major layout regions as an :class:`EpExpertLayout` of views, one per (scales dtype,
    weights given or not), made once: ``x [E, C, H]``, ``scales [E, C, S]``, ``weights [E, C]`` and
    the maps ``recv_row``/``src``/``slot [E, C]``."""

    def __init__(self, arena: SymmArena, cfg: EpDispatchCombineConfig):
        E, C = cfg.num_experts_per_rank, cfg.expert_capacity
        self._arena, self._shape, self._scale_dim = arena, (E, C), cfg.scale_dim
        self._x = arena.view("exp_x", cfg.dispatch_dtype, (E, C, cfg.hidden_dim))
        self._w = arena.view("exp_wts", torch.float32, (E, C))
        self._maps = arena.view("exp_maps", torch.int32, (3, E, C))
        self._made: dict[tuple, EpExpertLayout] = {}

    def of(self, scales: Optional[torch.Tensor], weighted: bool) -> EpExpertLayout:
        """The layout of a dispatch whose ``out_scales`` are ``scales`` (None: none; their dtype is the
        layout's) and that got weights or not."""
        key = (None if scales is None else scales.dtype, weighted)
        lay = self._made.get(key)
        if lay is None:
            s = None if scales is None else self._arena.view("exp_scales", scales.dtype, (*self._shape, self._scale_dim))
            lay = self._made[key] = EpExpertLayout(self._x, s, self._w if weighted else None, *self._maps)
        return lay


def expert_major_combine(cfg: EpDispatchCombineConfig, var, plans: dict, base, dev: torch.device
                         ) -> Optional[Callable[..., torch.Tensor]]:
    """``combine_expert_major(v, inp, routing, y)`` on the prepared ``plans`` of ``var`` (the op's
    EpVariants), with ``base`` the filled args struct; None without the expert-major layout.

    The ``expert_sum`` kernel sums each received row's entries of ``inp [E, C, H]`` in float32 into a
    ``[recv_capacity, H]`` float32 buffer (allocated here, outside the arena); the float32 combine
    sends those rows home and sums them there; the result is cast to the combine dtype once.
    """
    if not cfg.expert_capacity:
        return None
    cap, hidden = EpMaxRecv(var.dispatch[0]), cfg.hidden_dim
    sargs, eargs = EP_ARGS.ctype.from_buffer_copy(base), EP_ARGS.ctype.from_buffer_copy(base)
    sum_launch = [plans[(EXPERT_SUM, c)].bind_struct(sargs) for c in var.combine]
    f32_launch = [plans[(COMBINE, c)].bind_struct(eargs) for c in var.expert_combine]
    rows32 = torch.empty((cap, hidden), dtype=torch.float32, device=dev)  # each received row's sum
    sargs.outTok = eargs.inpTok = rows32.data_ptr()
    eargs.inpRows = cap
    in_f32 = cfg.combine_dtype == torch.float32

    def combine_expert_major(v, inp, routing, y):
        n = routing.num_tokens
        sargs.inpTok = inp.data_ptr()
        sum_launch[v]()
        # one rounding: the float32 combine's sums are cast once (or are the output already)
        y32 = y if in_f32 and y is not None else torch.empty((n, hidden), dtype=torch.float32, device=dev)
        eargs.outTok = y32.data_ptr()
        eargs.numTokens = n
        f32_launch[v]()
        if in_f32:
            return y32
        return y.copy_(y32) if y is not None else y32.to(cfg.combine_dtype)

    combine_expert_major.rows32 = rows32  # (kept alive with the callable)
    return combine_expert_major
