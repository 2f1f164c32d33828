"""The op as ``torch.library`` custom ops (namespace ``mori_jit``), with fake implementations and
autograd formulas, so that ``torch.compile(fullgraph=True)`` traces a MoE layer through them and
AOTAutograd traces their backward passes.

An op object is not a tensor: each custom op takes the op's int handle (``registry.register``) and
tensors. A dispatch is named by its token ``src`` (and its source-side ``ids``, what a backward
re-route sends again), which the combine takes back: the data dependency also orders the calls in
a traced graph. Every output is a fresh tensor, fully defined (zeros, or ``-1`` ids, beyond
``total_recv``), so that ``torch.library.opcheck`` can compare runs.

=========================================  ==================================================
``ep_dispatch(h, x, w?, s?, ids)``           ``(out, out_w, out_s, out_idx, total, src, counts, maps)``
``ep_combine(h, rows, w?, ids, src)``        ``(y [n, H], y_w [n, k])``
``ep_combine_expert_major(h, inp, ids, src, recv_row)``  ``y [n, H]``
``ep_dispatch_backward(h, g_out, g_w?, ids, src, x_dtype, w_dtype)``  ``(g_x [n, H], g_w [n, k | 0])``
``ep_combine_backward(h, g_y, g_yw?, ids, src, rows, dtype)``  ``(g_rows [rows, H], g_w [rows, k | 0])``
=========================================  ==================================================

Shapes of ``ep_dispatch``: ``out [cap, H]`` (the input dtype), ``out_w [cap, k]`` float32 (zeros
without weights), ``out_s [cap, S]`` (``S = 0`` without caller scales), ``out_idx [cap, k]``,
``total [1]`` int32, ``src [cap]`` int32, ``counts [E]`` int32 (received pairs per local expert),
``maps [3, E, C]`` int32 (the expert-major layout's ``recv_row``, ``src``, ``slot``; ``C = 0``
without it). ``ids``, ``scales``, ``total`` and the maps get no gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mori_jit.ops.ep.train import legs
from mori_jit.ops.ep.train.registry import entry

__all__ = ["ep_dispatch", "ep_combine", "ep_combine_expert_major", "ep_dispatch_backward", "ep_combine_backward"]

_NS = "mori_jit"


def _cfg(handle: int):
    return entry(handle).op.cfg


# ---- dispatch ------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::ep_dispatch", mutates_args=())
def ep_dispatch(handle: int, x: Tensor, weights: Optional[Tensor], scales: Optional[Tensor],
                ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Differentiable dispatch of ``x [n, H]`` (weights ``[n, k]`` any float dtype, or None) along ``ids``."""
    return legs.forward_dispatch(entry(handle), x, weights, scales, ids)


@ep_dispatch.register_fake
def _(handle, x, weights, scales, ids):
    cfg = _cfg(handle)
    cap, k, E, C = cfg.recv_capacity, cfg.num_experts_per_token, cfg.num_experts_per_rank, cfg.expert_capacity
    s = x.new_empty((cap, 0), dtype=torch.float32) if scales is None else scales.new_empty((cap, scales.shape[1]))
    i32 = torch.int32
    return (x.new_empty((cap, cfg.hidden_dim), dtype=cfg.input_dtype), x.new_empty((cap, k), dtype=torch.float32), s,
            ids.new_empty((cap, k)), x.new_empty((1,), dtype=i32), x.new_empty((cap,), dtype=i32),
            x.new_empty((E,), dtype=i32), x.new_empty((3, E, C), dtype=i32))


def _dispatch_setup(ctx, inputs, output):
    handle, x, weights, _scales, ids = inputs
    ctx.save_for_backward(ids, output[5])
    ctx.handle, ctx.x_dtype = handle, x.dtype
    ctx.w_dtype = None if weights is None else weights.dtype


def _dispatch_backward(ctx, g_out, g_w, *_):
    ids, src = ctx.saved_tensors
    weighted = ctx.w_dtype is not None
    g_x, g_weights = torch.ops.mori_jit.ep_dispatch_backward(
        ctx.handle, g_out, g_w if weighted else None, ids, src, ctx.x_dtype, ctx.w_dtype or torch.float32)
    return None, g_x, (g_weights if weighted else None), None, None


torch.library.register_autograd(f"{_NS}::ep_dispatch", _dispatch_backward, setup_context=_dispatch_setup)


@torch.library.custom_op(f"{_NS}::ep_dispatch_backward", mutates_args=())
def ep_dispatch_backward(handle: int, g_out: Tensor, g_w: Optional[Tensor], ids: Tensor, src: Tensor,
                         x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """dispatch's backward: the received rows' gradients summed home (``legs.rows_home``)."""
    g_x, g_weights = legs.rows_home(entry(handle), src, ids, g_out, g_w)
    n, k = ids.shape
    g_weights = (g_weights.to(w_dtype) if g_w is not None
                 else torch.empty((n, 0), dtype=w_dtype, device=g_out.device))
    return g_x.to(x_dtype), g_weights


@ep_dispatch_backward.register_fake
def _(handle, g_out, g_w, ids, src, x_dtype, w_dtype):
    n, k = ids.shape
    return (g_out.new_empty((n, g_out.shape[1]), dtype=x_dtype),
            g_out.new_empty((n, k if g_w is not None else 0), dtype=w_dtype))


# ---- combine -------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::ep_combine", mutates_args=())
def ep_combine(handle: int, rows: Tensor, weights: Optional[Tensor], ids: Tensor, src: Tensor) -> tuple[Tensor, Tensor]:
    """Differentiable combine of ``rows [r, H]`` (combine dtype) along the dispatch named by ``ids``/``src``."""
    return legs.forward_combine(entry(handle), rows, weights, ids, src)


@ep_combine.register_fake
def _(handle, rows, weights, ids, src):
    n, k = ids.shape
    return rows.new_empty((n, rows.shape[1])), rows.new_empty((n, k), dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    handle, rows, weights, ids, src = inputs
    ctx.save_for_backward(ids, src)
    ctx.handle, ctx.rows, ctx.dtype, ctx.weighted = handle, rows.shape[0], rows.dtype, weights is not None


def _combine_backward(ctx, g_y, g_yw):
    ids, src = ctx.saved_tensors
    g_rows, g_w = torch.ops.mori_jit.ep_combine_backward(
        ctx.handle, g_y, g_yw if ctx.weighted else None, ids, src, ctx.rows, ctx.dtype)
    return None, g_rows, (g_w if ctx.weighted else None), None, None


torch.library.register_autograd(f"{_NS}::ep_combine", _combine_backward, setup_context=_combine_setup)


@torch.library.custom_op(f"{_NS}::ep_combine_backward", mutates_args=())
def ep_combine_backward(handle: int, g_y: Tensor, g_yw: Optional[Tensor], ids: Tensor, src: Tensor, rows: int,
                        dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """combine's backward: the output gradient sent out to every received row (``legs.rows_out``)."""
    g_rows, g_w = legs.rows_out(entry(handle), src, ids, g_y, g_yw, rows)
    if g_w is None:
        g_w = torch.empty((rows, 0), dtype=torch.float32, device=g_y.device)
    return g_rows.to(dtype), g_w


@ep_combine_backward.register_fake
def _(handle, g_y, g_yw, ids, src, rows, dtype):
    k = ids.shape[1] if g_yw is not None else 0
    return g_y.new_empty((rows, g_y.shape[1]), dtype=dtype), g_y.new_empty((rows, k), dtype=torch.float32)


# ---- combine of the expert-major layout ----------------------------------------------------------
@torch.library.custom_op(f"{_NS}::ep_combine_expert_major", mutates_args=())
def ep_combine_expert_major(handle: int, inp: Tensor, ids: Tensor, src: Tensor, recv_row: Tensor) -> Tensor:
    """Differentiable ``combine_expert_major`` of ``inp [E, C, H]`` (already weighted); ``recv_row [E, C]``
    is the layout's map (its gradient goes back through it)."""
    return legs.forward_combine_expert_major(entry(handle), inp, ids, src, recv_row)


@ep_combine_expert_major.register_fake
def _(handle, inp, ids, src, recv_row):
    return inp.new_empty((ids.shape[0], inp.shape[2]))


def _major_setup(ctx, inputs, output):
    handle, inp, ids, src, recv_row = inputs
    ctx.save_for_backward(ids, src, recv_row)
    ctx.handle, ctx.dtype = handle, inp.dtype


def _major_backward(ctx, g_y):
    ids, src, recv_row = ctx.saved_tensors
    cap = src.shape[0]
    g_rows, _ = torch.ops.mori_jit.ep_combine_backward(ctx.handle, g_y, None, ids, src, cap, ctx.dtype)
    at = torch.where(recv_row >= 0, recv_row.long(), cap).reshape(-1)
    g_inp = legs.take(g_rows, at).reshape(*recv_row.shape, g_rows.shape[1])  # padding entries: zeros
    return None, g_inp, None, None, None


torch.library.register_autograd(f"{_NS}::ep_combine_expert_major", _major_backward, setup_context=_major_setup)
