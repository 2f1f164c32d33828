"""What the op's calls accept for the MoE features (scales, routing replay, expert-major combine
input): checks that raise TypeError/ValueError naming the argument, the value and what is allowed,
or :class:`~mori_jit.ops.ep.core.op.EpUnsupportedError` (passed in: this module imports no op)."""
from __future__ import annotations

from typing import Optional

import torch

from mori_jit.ops.ep.core.arguments import ROW_ALIGN, expect_latest_routing, expect_tensor, refuse_overlaps
from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError

__all__ = ["check_scales", "check_replay", "check_expert_major_input"]


def check_scales(cfg, scales: Optional[torch.Tensor], n: int, device, supported: bool, unsupported: type) -> None:
    """``scales``: None under ``dispatch_quant_type`` (the op makes them) or without ``scale_dim``; else a
    contiguous ``[n, scale_dim]`` tensor of ``scale_type_size``-byte elements on ``device``."""
    if scales is not None and not supported:
        raise unsupported("per-token scales are not supported by this backend")
    if cfg.dispatch_quant_type not in (None, "none"):
        if scales is not None:
            raise EpArgumentError(f"scales: the op makes them (dispatch_quant_type={cfg.dispatch_quant_type!r}); "
                                  f"pass None")
        return
    if scales is None:
        if cfg.scale_dim:
            raise EpArgumentError(f"scales: None, but the config declares scale_dim={cfg.scale_dim}; every dispatch "
                             f"passes [n, {cfg.scale_dim}] scales (every rank packs the same row)")
        return
    if not cfg.scale_dim:
        raise EpArgumentError("scales: given, but the config declares none (scale_dim=0); set scale_dim and "
                         "scale_type_size, or pass None")
    if not isinstance(scales, torch.Tensor):
        raise EpArgumentTypeError(f"scales: expected a torch.Tensor, got {type(scales).__name__}")
    if scales.element_size() != cfg.scale_type_size:
        raise EpArgumentTypeError(f"scales: {scales.dtype} has {scales.element_size()}-byte elements, the config declares "
                        f"scale_type_size={cfg.scale_type_size}")
    expect_tensor("scales", scales, scales.dtype, (n, cfg.scale_dim), device)


def check_replay(cfg, routing, latest, n: int, unsupported: type) -> None:
    """A replay (``dispatch(..., routing=routing)``) of ``n`` tokens: the op must allow replays, and
    ``routing`` must be this op's latest dispatch's, made for ``n`` tokens."""
    if not cfg.routing_replay:
        raise unsupported("routing replay (dispatch(routing=...)) needs EpDispatchCombineConfig.routing_replay=True")
    expect_latest_routing(routing, latest)
    if n != routing.num_tokens:
        raise EpArgumentError(f"input: {n} tokens, but the routing was made for {routing.num_tokens}; a replay moves a "
                         f"payload of the routed tokens, row for row")


def check_expert_major_input(cfg, input, routing, latest, out, device, arena_span: tuple[int, int]) -> int:
    """``combine_expert_major``'s arguments: ``input [num_experts_per_rank, expert_capacity, hidden]``
    (combine dtype), ``routing`` the latest dispatch's, ``out`` None or ``[n, hidden]``. Returns n."""
    if not cfg.expert_capacity:
        raise EpArgumentError("combine_expert_major needs the expert-major layout: set "
                         "EpDispatchCombineConfig.expert_capacity (and expert_counts=True)")
    expect_latest_routing(routing, latest)
    shape = (cfg.num_experts_per_rank, cfg.expert_capacity, cfg.hidden_dim)
    expect_tensor("input", input, cfg.combine_dtype, shape, device, ROW_ALIGN)
    n = routing.num_tokens
    if out is not None:
        expect_tensor("out", out, cfg.combine_dtype, (n, cfg.hidden_dim), device, ROW_ALIGN)
        refuse_overlaps((("out", out),), (("input", input),), ("the op's symmetric buffers", arena_span))
    return n
