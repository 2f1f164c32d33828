"""The real work behind the custom ops (``library``): the differentiable dispatch and combine, and
the exchanges of their backward passes.

**Rows.** A differentiable dispatch returns fresh tensors (never views of the op's buffers, which
the next dispatch of any rank overwrites): ``out [recv_capacity, H]`` in the input dtype (under
``dispatch_quant_type`` the received fp8 rows times their block scales: what the experts compute on), zeros
beyond ``total_recv``; ids ``-1`` there; and its token ``src`` (see ``registry``).

**The backward legs.** dispatch's backward sends the received rows' gradients home and sums them per
token (:func:`rows_home`, a combine); combine's backward sends the output gradient out to the rows
(:func:`rows_out`, a dispatch-direction exchange). Each finds where the dispatch's routing lives now
(``Entry.find``):

* the dispatch's own routing, still its op's latest: ``combine`` along it; a replay
  (``dispatch(routing=)``, ``cfg.routing_replay``) for the way out;
* the latest re-route of the same tokens: the same, rows permuted by source id;
* neither (a later dispatch replaced it, as every later layer's does): a **re-route**, a fresh
  dispatch of the saved ids on the exchange op, whose routing becomes that op's latest. It carries
  combine's backward payload; a dispatch's backward that finds no routing sends zeros once.

Rows of two routings of the same tokens are matched by source id (``srcRank * M + srcTok``, unique
per receiving rank). **Gradient dtypes**: a gradient travels in the dtype of the leg that carries
it: dispatch's backward in the combine dtype, combine's backward in the exchange op's dispatch dtype
(the op's own when it moves a plain bf16/fp32 payload; otherwise the registered gradient op's, bf16
behind an fp8 forward) and returns to each input in that input's dtype. Every leg is collective: all
ranks run the same legs in the same order (they do when every rank runs the same model).
"""
from __future__ import annotations

from typing import Optional

import torch

from mori_jit.ops.ep.errors import EpArgumentError, EpUnsupportedError
from mori_jit.ops.ep.quant import dequantize, quant_spec
from mori_jit.ops.ep.train.registry import Entry, Placement

__all__ = ["forward_dispatch", "forward_combine", "forward_combine_expert_major", "rows_home", "rows_out",
           "carries_gradients", "exchange_op", "take", "order_map", "row_mask"]


def row_mask(total_recv: torch.Tensor, rows: int) -> torch.Tensor:
    """bool ``[rows]``: row i is below ``total_recv`` (device tensors only: no host sync)."""
    return torch.arange(rows, device=total_recv.device) < total_recv


def take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for ``index`` in ``[0, len(rows)]``; the value ``len(rows)`` gives a zero row.
    Differentiable in ``rows`` (its gradient is an index_add).

    One gather from ``rows`` with a zero row appended: the copy is of ``len(rows)`` rows, where
    masking the gathered rows would pass over ``len(index)`` rows twice (forward and backward), and
    the packed layout gathers ``k`` times as many rows as it reads."""
    zero = rows.new_zeros((1, *rows.shape[1:]))
    return torch.cat((rows, zero)).index_select(0, index)


def order_map(src_from: torch.Tensor, src_to: torch.Tensor, space: int) -> torch.Tensor:
    """int64 ``[len(src_to)]``: for each row of ``src_to``, the row of ``src_from`` with the same
    source id, or ``len(src_from)`` for none. Source ids lie in ``[0, space)``; ``-1`` is no row."""
    a = src_from.shape[0]
    spare = torch.full((), space, dtype=torch.int64, device=src_from.device)
    table = torch.full((space + 1,), a, dtype=torch.int64, device=src_from.device)
    table.scatter_(0, torch.where(src_from >= 0, src_from.long(), spare), torch.arange(a, device=src_from.device))
    found = table.index_select(0, torch.where(src_to >= 0, src_to.long(), spare))
    return torch.where(src_to >= 0, found, a)


def _masked(t: torch.Tensor, keep: torch.Tensor, fill) -> torch.Tensor:
    """A fresh ``t`` with the rows outside ``keep`` set to ``fill`` (byte-wise for 1-byte dtypes).
    One kernel: the fill is a scalar operand, not a tensor made for it."""
    if t.dtype.itemsize == 1:  # (fp8 and UE8M0 scales: compared and filled as bytes)
        return torch.where(keep.unsqueeze(1), t.view(torch.uint8), 0).view(t.dtype)
    return torch.where(keep.unsqueeze(1), t, fill)


def _src_of(routing, keep: torch.Tensor) -> torch.Tensor:
    """A fresh int32 ``[cap]`` copy of a routing's source ids (every backend's routing has ``recv_src``,
    valid below ``total_recv``), ``-1`` beyond; ``keep``: :func:`row_mask` of the dispatch (``[cap]``)."""
    src, cap = routing.recv_src, keep.shape[0]
    if src.shape[0] >= cap:  # (a view of the whole receive side: one kernel)
        return torch.where(keep, src[:cap].to(torch.int32), -1)
    full = torch.full((cap,), -1, dtype=torch.int32, device=keep.device)
    full[:src.shape[0]] = src
    return torch.where(keep, full, -1)


def carries_gradients(op) -> bool:
    """Whether ``op``'s dispatch can carry a gradient out along a routing: a plain bf16/fp32 payload
    (no ``dispatch_quant_type``, no scales to pass)."""
    cfg = op.cfg
    return (cfg.dispatch_quant_type in (None, "none") and not cfg.scale_dim
            and cfg.dispatch_dtype in (torch.bfloat16, torch.float32))


def exchange_op(entry: Entry):
    """The op whose dispatch carries combine's backward: the op itself when it can, else the gradient op."""
    op = entry.op
    if carries_gradients(op):
        return op
    g = entry.gradient_op
    if g is None:
        cfg = op.cfg
        raise EpUnsupportedError(
            f"combine's backward sends the {cfg.combine_dtype} output gradient out along the routing, which this op's "
            f"dispatch (dispatch_data_type={cfg.dispatch_dtype}, dispatch_quant_type={cfg.dispatch_quant_type!r}, scale_dim="
            f"{cfg.scale_dim}) cannot carry; register a gradient op: mori_jit.ops.ep.train.register(op, gradient_op="
            f"an op of the same geometry with data_type={cfg.combine_dtype})")
    return g


def _space(op) -> int:
    return op.cfg.world_size * op.cfg.max_num_inp_token_per_rank


def _reroute(entry: Entry, token: torch.Tensor, ids: torch.Tensor, x: torch.Tensor,
             weights: Optional[torch.Tensor]):
    """A fresh dispatch of ``ids`` carrying ``x`` (and ``weights``) on the exchange op: it becomes
    ``token``'s placement. Returns ``(placement, result)``."""
    ex = exchange_op(entry)
    res = ex.dispatch(x, weights, None, ids, return_result=True)
    keep = row_mask(res.total_recv, ex.cfg.recv_capacity)
    p = Placement(token, ex, res.routing, _src_of(res.routing, keep), False)
    entry.reroute = p
    return p, res


def forward_dispatch(entry: Entry, x, weights, scales, ids) -> tuple:
    """The differentiable dispatch's forward: ``(out, out_w, out_s, out_idx, total, src, counts, maps)``
    (see ``library.ep_dispatch``); records the forward placement."""
    op = entry.op
    cfg = op.cfg
    cap, k, E = cfg.recv_capacity, cfg.num_experts_per_token, cfg.num_experts_per_rank
    if cfg.input_dtype.itemsize == 1:
        raise EpUnsupportedError(f"a differentiable dispatch of {cfg.input_dtype} rows: no gradient reaches a 1-byte "
                                 f"input; quantize in the op (dispatch_quant_type) with a bf16 input instead")
    with torch.no_grad():  # (a compiled graph may hand over strided inputs: the op takes dense rows)
        res = op.dispatch(x.contiguous(), None if weights is None else weights.contiguous(),
                          None if scales is None else scales.contiguous(), ids.contiguous(), return_result=True)
        keep = row_mask(res.total_recv, cap)
        out = res.out
        if out.dtype != cfg.input_dtype:  # quantized on the way
            out = dequantize(out, res.out_scales, quant_spec(cfg.dispatch_quant_type).block, cfg.input_dtype)
        out = _masked(out, keep, 0)
        dev = out.device
        out_w = (_masked(res.out_weights, keep, 0) if weights is not None
                 else torch.zeros((cap, k), dtype=torch.float32, device=dev))
        out_s = (_masked(res.out_scales, keep, 0) if scales is not None
                 else torch.empty((cap, 0), dtype=torch.float32, device=dev))
        out_idx = _masked(res.out_indices, keep, -1)
        src = _src_of(res.routing, keep)
        if res.expert_counts is not None:
            counts = res.expert_counts.clone()
        else:
            local = out_idx.long() - cfg.rank * E
            key = torch.where((local >= 0) & (local < E), local, E).reshape(-1)
            counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
            counts = counts[:E].to(torch.int32)
        lay = res.expert
        maps = (torch.stack([lay.recv_row, lay.src, lay.slot]) if lay is not None
                else torch.empty((3, E, 0), dtype=torch.int32, device=dev))
    entry.forward = Placement(src, op, res.routing, src, True)
    return out, out_w, out_s, out_idx, res.total_recv.clone(), src, counts, maps


class _Replaced:
    """A routing no op accepts: what a forward call passes when its dispatch's routing was replaced."""


def _refuse(entry: Entry, call: str, *args) -> None:
    """Let the op refuse a combine whose dispatch's routing is gone: its own check raises (with the
    ``torch`` backend's agreement, on every rank: no peer waits in the exchange)."""
    with torch.no_grad():
        getattr(entry.op, call)(*args, routing=_Replaced())
    raise EpArgumentError(f"routing: the dispatch this {call} belongs to is no longer its op's latest")  # (unreached)


def _find(entry: Entry, token: torch.Tensor, call: str, *args) -> Placement:
    p = entry.find(token, by_value=True)
    if p is None:
        _refuse(entry, call, *args)
    return p


def forward_combine(entry: Entry, rows, weights, ids, token) -> tuple:
    """The differentiable combine's forward: ``(y [n, H], y_w [n, k] float32, zeros without weights)``."""
    exchange_op(entry)  # (refused here, before the backward needs it)
    p = _find(entry, token, "combine", rows, weights)
    ex = p.op
    with torch.no_grad():
        if not p.same_order:
            at = order_map(token, p.src, _space(ex))
            rows = take(rows, at)
            weights = take(weights, at) if weights is not None else None
        y, y_w = ex.combine(rows.contiguous(), None if weights is None else weights.contiguous(), routing=p.routing)
    if y_w is None:
        y_w = torch.zeros((ids.shape[0], ids.shape[1]), dtype=torch.float32, device=y.device)
    return y, y_w


def forward_combine_expert_major(entry: Entry, inp, ids, token, recv_row) -> torch.Tensor:
    """The differentiable expert-major combine's forward: ``y [n, H]``. Along the dispatch's own routing,
    the op's ``combine_expert_major``; along a re-route of it (its layout is gone), each receive row's
    entries summed in float32 and combined as rows (one more rounding, to the combine dtype)."""
    exchange_op(entry)
    p = _find(entry, token, "combine_expert_major", inp)
    with torch.no_grad():
        if p.same_order:
            return p.op.combine_expert_major(inp.contiguous(), routing=p.routing)
        cap, H = token.shape[0], inp.shape[-1]
        at = torch.where(recv_row >= 0, recv_row.long(), cap).reshape(-1)
        rows = torch.zeros((cap + 1, H), dtype=torch.float32, device=inp.device)
        rows = rows.index_add_(0, at, inp.reshape(-1, H).float())[:cap].to(inp.dtype)
        return forward_combine(entry, rows, None, ids, token)[0]


def rows_home(entry: Entry, token, ids, grad_rows, grad_weights) -> tuple:
    """dispatch's backward leg: ``grad_rows [cap, H]`` (and ``grad_weights [cap, k]``), in the forward's
    row order, summed per source token on its home rank: ``(grad_x [n, H], grad_w [n, k] | None)``
    in the combine dtype and float32."""
    with torch.no_grad():
        p = entry.find(token)
        if p is None:  # no routing holds the tokens: send them again (zeros: nothing rides out)
            ex = exchange_op(entry)
            zeros = torch.zeros((ids.shape[0], ex.cfg.hidden_dim), dtype=ex.cfg.input_dtype, device=ids.device)
            p, _ = _reroute(entry, token, ids.contiguous(), zeros, None)
        ex = p.op
        if not p.same_order:
            at = order_map(token, p.src, _space(ex))
            grad_rows = take(grad_rows, at)
            grad_weights = take(grad_weights, at) if grad_weights is not None else None
        rows = grad_rows.to(ex.cfg.combine_dtype).contiguous()
        w = None if grad_weights is None else grad_weights.float().contiguous()
        return ex.combine(rows, w, routing=p.routing)


def rows_out(entry: Entry, token, ids, grad_y, grad_yw, num_rows: int) -> tuple:
    """combine's backward leg: ``grad_y [n, H]`` (and ``grad_yw [n, k]``) sent to every received row of
    its token, in the forward's row order: ``(rows [num_rows, H], w_rows [num_rows, k] | None)``,
    zeros beyond ``total_recv``, in the exchange op's dispatch dtype and float32."""
    with torch.no_grad():
        ex = exchange_op(entry)
        x = grad_y.to(ex.cfg.input_dtype).contiguous()
        w = None if grad_yw is None else grad_yw.float().contiguous()
        p = entry.find(token)
        if p is not None and p.op is ex and ex.cfg.routing_replay:
            res = ex.dispatch(x, w, None, None, routing=p.routing, return_result=True)
        else:
            p, res = _reroute(entry, token, ids.contiguous(), x, w)
        cap = ex.cfg.recv_capacity
        keep = row_mask(res.total_recv, cap)
        rows = _masked(res.out, keep, 0)
        w_rows = _masked(res.out_weights, keep, 0) if w is not None else None
        if not p.same_order:
            at = order_map(p.src, token, _space(ex))
            rows = take(rows, at)
            w_rows = take(w_rows, at) if w_rows is not None else None
        return rows[:num_rows], (w_rows[:num_rows] if w_rows is not None else None)
