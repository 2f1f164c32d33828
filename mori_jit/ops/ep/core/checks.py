"""The argument checks of the op's ``dispatch`` and ``combine`` (before any launch): each names the
bad argument, its value and what is allowed."""
from __future__ import annotations

import torch

from mori_jit.ops.ep.core.arguments import ROW_ALIGN, expect_latest_routing, expect_tensor, refuse_overlaps
from mori_jit.ops.ep.core.arguments_moe import check_replay, check_scales
from mori_jit.ops.ep.core.kernel_set import KernelSet
from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError, EpUnsupportedError

__all__ = ["check_dispatch_args", "check_combine_args"]


def check_dispatch_args(op, k: KernelSet, input, weights, scales, indices, routing) -> int:
    """The checks of :meth:`EpDispatchCombineOp.dispatch` on ``op``: raise TypeError/ValueError (or
    EpUnsupportedError) naming a bad argument; return the token count."""
    cfg, dev = op.cfg, op.device
    if routing is not None and k.replay is None:
        raise EpUnsupportedError("routing replay (dispatch(routing=...)) is not supported")
    if not isinstance(input, torch.Tensor):
        raise EpArgumentTypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    n = input.shape[0] if input.dim() == 2 else -1
    if n > cfg.max_num_inp_token_per_rank:
        raise EpArgumentError(f"input: {n} tokens exceed max_num_inp_token_per_rank={cfg.max_num_inp_token_per_rank}")
    expect_tensor("input", input, op._in_dtype, (n, cfg.hidden_dim), dev, ROW_ALIGN)
    if routing is not None:
        check_replay(cfg, routing, op._routing, n, EpUnsupportedError)
    if weights is not None:
        expect_tensor("weights", weights, torch.float32, (n, cfg.num_experts_per_token), dev)
    if scales is not None or op._scales_required:
        check_scales(cfg, scales, n, dev, "scales" in k.capabilities, EpUnsupportedError)
    if routing is None or indices is not None:
        expect_tensor("indices", indices, cfg.index_dtype, (n, cfg.num_experts_per_token), dev)
    return n


def check_combine_args(op, input, weights, routing, out, out_weights) -> int:
    """The checks of :meth:`EpDispatchCombineOp.combine` on ``op``: raise TypeError/ValueError naming
    a bad argument; return the token count."""
    cfg, dev, dtype = op.cfg, op.device, op._comb_dtype
    expect_latest_routing(routing, op._routing)
    if not isinstance(input, torch.Tensor) or input.dim() != 2:
        raise EpArgumentError(f"input: expected a 2-D tensor [rows, {cfg.hidden_dim}]")
    rows = input.shape[0]
    if rows > op._cap:
        raise EpArgumentError(f"input: {rows} rows exceed the receive capacity {op._cap}")
    expect_tensor("input", input, dtype, (rows, cfg.hidden_dim), dev, ROW_ALIGN)
    if weights is not None:
        expect_tensor("weights", weights, torch.float32, (rows, cfg.num_experts_per_token), dev)
    total = getattr(routing, "total_recv", None)
    if type(total) is int and rows < total:  # (a host count: backends whose routing knows it)
        raise EpArgumentError(f"input: {rows} rows, but dispatch received {total}; pass every received row's output")
    n = routing.num_tokens
    if out is not None or out_weights is not None:
        if out is not None:
            expect_tensor("out", out, dtype, (n, cfg.hidden_dim), dev, ROW_ALIGN)
        if out_weights is not None:
            if weights is None:
                raise EpArgumentError("out_weights: given without weights (there are no weights to combine)")
            expect_tensor("out_weights", out_weights, torch.float32, (n, cfg.num_experts_per_token), dev)
        # the kernel reads the inputs, and the peers the arena, while it writes the outputs
        refuse_overlaps((("out", out), ("out_weights", out_weights)),
                         (("input", input), ("weights", weights)), ("the op's symmetric buffers", op._arena_span))
    return n
