"""The op's own calls when they must be differentiable (``EpDispatchCombineOp.dispatch``/``combine``/
``combine_expert_major`` name this module when grad mode is on and an input requires grad).

They return what the plain calls return (the tuple, or :class:`~mori_jit.ops.ep.results.EpDispatchResult`),
built from :mod:`.functional`: fresh differentiable tensors, and as ``routing`` the backend's routing
of the dispatch (so ``combine`` checks it as always). The op remembers the latest differentiable
dispatch by that routing: a differentiable ``combine`` of another routing is refused.
"""
from __future__ import annotations

from typing import Optional

import torch

from mori_jit.ops.ep.errors import EpArgumentError
from mori_jit.ops.ep.results import EpDispatchResult
from mori_jit.ops.ep.train import functional
from mori_jit.ops.ep.train.registry import entry, handle_of

__all__ = ["dispatch", "combine", "combine_expert_major"]


def dispatch(op, input, weights, scales, indices, return_routing: bool, return_result: bool):
    """``op.dispatch(...)`` with an input that requires grad (same arguments, same returns)."""
    h = handle_of(op)
    d = functional.dispatch(h, input, weights, indices, scales=scales)
    e = entry(h)
    routing = e.forward.routing
    e.by_routing = (routing, d)
    if return_result:
        return EpDispatchResult(d.out, d.weights, d.scales, d.indices, d.total_recv, routing, d.expert_counts,
                                d.expert)
    res = (d.out, d.weights, d.scales, d.indices, d.total_recv)
    return res + (routing,) if return_routing else res


def _dispatch_of(op, routing) -> tuple[int, functional.TrainDispatch]:
    h = handle_of(op)
    known = entry(h).by_routing
    if known is None or known[0] is not routing:
        raise EpArgumentError("routing: a differentiable combine (its input requires grad) takes the routing of this "
                              "op's latest differentiable dispatch (one whose input or weights required grad); that "
                              "dispatch keeps what the backward needs")
    return h, known[1]


def combine(op, input, weights, routing, out: Optional[torch.Tensor], out_weights: Optional[torch.Tensor]):
    """``op.combine(...)`` with an input that requires grad: ``(y, y_w)``, written into ``out`` /
    ``out_weights`` when given."""
    h, d = _dispatch_of(op, routing)
    y, y_w = functional.combine(h, input, d, weights=weights)
    if out is not None:
        y = out.copy_(y)
    if out_weights is not None and y_w is not None:
        y_w = out_weights.copy_(y_w)
    return y, y_w


def combine_expert_major(op, input, routing, out: Optional[torch.Tensor]):
    """``op.combine_expert_major(...)`` with an input that requires grad."""
    h, d = _dispatch_of(op, routing)
    y = functional.combine_expert_major(h, input, d)
    return out.copy_(y) if out is not None else y
