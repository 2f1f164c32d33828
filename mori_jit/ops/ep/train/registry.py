"""Live ops by int handle, and where each differentiable dispatch's routing lives now.

A custom op takes tensors, ints and dtypes, never an op object: :func:`register` gives an op an int
handle (the same one on every call), and the custom ops look the op up by it. The registry holds the
op weakly: a handle outlives nothing.

A dispatch is known by its **token**: the ``src`` map it returns (``[recv_capacity]`` int32, each
received row's ``srcRank * M + srcTok``, ``-1`` beyond ``total_recv``), a fresh tensor per dispatch.
A routing is usable only while it is its op's latest (``op.latest_routing``): a :class:`Placement`
says which op's latest routing holds a token's rows, and in which row order. There are at most two
per op: the latest forward dispatch (its own rows, its own order) and the latest backward re-route
(the same tokens sent again by a fresh dispatch, rows in that dispatch's order: see ``legs``).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch

from mori_jit.ops.ep.core.op import EpDispatchCombineOp
from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError, EpStateError

__all__ = ["Placement", "Entry", "register", "entry", "handle_of"]


class Placement:
    """Where a dispatch's rows are: ``op``'s routing ``routing``, whose received rows have the source
    ids ``src``; ``same_order``: the rows are in the dispatch's own order (``src`` is the token). The
    op is held weakly (a placement keeps no arena alive)."""

    __slots__ = ("token", "_op", "routing", "src", "same_order")

    def __init__(self, token: torch.Tensor, op: EpDispatchCombineOp, routing: Any, src: torch.Tensor,
                 same_order: bool):
        self.token, self._op, self.routing, self.src, self.same_order = token, weakref.ref(op), routing, src, same_order

    @property
    def op(self) -> EpDispatchCombineOp:
        """The op whose routing this is (EpStateError once it is gone)."""
        op = self._op()
        if op is None:
            raise EpStateError("the op of a dispatch's routing no longer exists")
        return op

    def holds(self, token: torch.Tensor, by_value: bool = False) -> bool:
        """Whether this placement is ``token``'s and its routing is still its op's latest. The token
        is compared by storage (the placement keeps it alive, so no other tensor shares its address);
        ``by_value``: a copy of it counts too (a host sync: only for copies, as opcheck makes)."""
        t = self.token
        op = self._op()
        if op is None or op.latest_routing is not self.routing or t.shape != token.shape:
            return False
        if t.data_ptr() == token.data_ptr():
            return True
        return by_value and t.device == token.device and bool(torch.equal(t, token))


class Entry:
    """One registered op: the op, its gradient op (or None) and its placements."""

    def __init__(self, handle: int, op: EpDispatchCombineOp, gradient_op: Optional[EpDispatchCombineOp]):
        self.handle = handle
        self._op = weakref.ref(op)
        self._grad_op = weakref.ref(gradient_op) if gradient_op is not None else None
        self.forward: Optional[Placement] = None  # the latest forward dispatch
        self.reroute: Optional[Placement] = None  # the latest backward re-route
        self.by_routing: Optional[tuple[Any, Any]] = None  # (routing, record) of op-method calls (hooks)

    @property
    def op(self) -> EpDispatchCombineOp:
        """The op (EpStateError once it is gone)."""
        op = self._op()
        if op is None:
            raise EpStateError(f"handle {self.handle}: its EpDispatchCombineOp no longer exists")
        return op

    @property
    def gradient_op(self) -> Optional[EpDispatchCombineOp]:
        """The op that carries gradients out along a routing when ``op``'s dispatch cannot (or None)."""
        if self._grad_op is None:
            return None
        op = self._grad_op()
        if op is None:
            raise EpStateError(f"handle {self.handle}: its gradient op no longer exists")
        return op

    def find(self, token: torch.Tensor, by_value: bool = False) -> Optional[Placement]:
        """The placement whose routing still holds ``token``'s rows, or None (then a backward leg
        sends the tokens again: see ``legs``). By storage only, unless ``by_value``: a backward leg's
        choice must be the same on every rank, and only the program's order makes it so."""
        for p in (self.forward, self.reroute):
            if p is not None and p.holds(token):
                return p
        if by_value:
            for p in (self.forward, self.reroute):
                if p is not None and p.holds(token, by_value=True):
                    return p
        return None


_entries: dict[int, Entry] = {}
_handles: "weakref.WeakKeyDictionary[EpDispatchCombineOp, int]" = weakref.WeakKeyDictionary()
_next = itertools.count(1)


def _same_geometry(op: EpDispatchCombineOp, g: EpDispatchCombineOp) -> list[str]:
    a, b = op.cfg, g.cfg
    fields = ("rank", "world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
              "num_experts_per_token", "index_dtype", "recv_capacity")
    return [f"{f}={getattr(b, f)} (the op's: {getattr(a, f)})" for f in fields if getattr(a, f) != getattr(b, f)]


def register(op: EpDispatchCombineOp, gradient_op: Optional[EpDispatchCombineOp] = None) -> int:
    """The int handle of ``op`` for the custom ops (the same handle on every call; registering again
    sets the gradient op). ``gradient_op``: a second op of the same group and geometry whose dispatch
    carries the gradient dtype (``op.cfg.combine_dtype``, no ``dispatch_quant_type``, no scales), for an
    ``op`` whose dispatch moves fp8 rows: it carries combine's backward (see ``legs``)."""
    if not isinstance(op, EpDispatchCombineOp):
        raise EpArgumentTypeError(f"op: expected an EpDispatchCombineOp, got {type(op).__name__}")
    if gradient_op is not None:
        if not isinstance(gradient_op, EpDispatchCombineOp):
            raise EpArgumentTypeError(f"gradient_op: expected an EpDispatchCombineOp, got {type(gradient_op).__name__}")
        wrong = _same_geometry(op, gradient_op)
        g, want = gradient_op.cfg, op.cfg.combine_dtype
        if g.dispatch_quant_type not in (None, "none") or g.scale_dim or g.dispatch_dtype != want or g.combine_dtype != want:
            wrong.append(f"legs of {g.dispatch_dtype}/{g.combine_dtype} (dispatch_quant_type={g.dispatch_quant_type!r}, "
                         f"scale_dim={g.scale_dim})")
        if wrong:
            raise EpArgumentError(f"gradient_op: {'; '.join(wrong)}; allowed: the op's geometry and a plain dispatch "
                                  f"of the gradient dtype {want} on both legs")
    handle = _handles.get(op)
    if handle is None:
        handle = _handles[op] = next(_next)
        _entries[handle] = Entry(handle, op, gradient_op)
        weakref.finalize(op, _entries.pop, handle, None)
    elif gradient_op is not None:
        _entries[handle]._grad_op = weakref.ref(gradient_op)
    return handle


def handle_of(op: EpDispatchCombineOp) -> int:
    """``op``'s handle, registering it (without a gradient op) on first use."""
    handle = _handles.get(op)
    return handle if handle is not None else register(op)


def entry(handle: int) -> Entry:
    """The entry of ``handle`` (EpArgumentError naming it when no op has it)."""
    try:
        return _entries[handle]
    except (KeyError, TypeError):
        raise EpArgumentError(f"handle: {handle!r} names no registered op; allowed: a value "
                              f"mori_jit.ops.ep.train.register(op) returned") from None
