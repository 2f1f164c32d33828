"""The op's three legs, ``dispatch``, ``combine`` and ``combine_expert_major``, with their checks and
the ranks' per-call agreement: a mixin of :class:`~mori_jit.ops.ep.core.op.EpDispatchCombineOp`,
which owns construction and lifecycle (``_kernels``, ``_pick``, ``_live``, the latest routing). The
split legs are :class:`~mori_jit.ops.ep.core.overlap.SplitLegs`, which call the checks here.

Each call checks its arguments (on the ``torch`` backend every rank agrees on them first:
:mod:`.agreement`), picks the token-count bucket, and launches the backend's leg. A call with an
input that requires grad goes to the differentiable path (:mod:`mori_jit.ops.ep.train`).
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from mori_jit.ops.ep.core.agreement import agree_on_arguments
from mori_jit.ops.ep.core.arguments import router_weights
from mori_jit.ops.ep.core.arguments_moe import check_expert_major_input
from mori_jit.ops.ep.core.call_options import check_call_options, pick_geometry, refuse_train_options
from mori_jit.ops.ep.core.checks import check_combine_args, check_dispatch_args
from mori_jit.ops.ep.core.kernel_set import KernelSet
from mori_jit.ops.ep.core.overlap import refuse_in_flight_then
from mori_jit.ops.ep.errors import EpStateError, EpUnsupportedError
from mori_jit.ops.ep.results import EpDispatchResult

__all__ = ["Legs"]

#: The differentiable calls (an input requires grad), named by module path like the backends.
_TRAIN = "mori_jit.ops.ep.train.hooks"


def _train():
    return importlib.import_module(_TRAIN)


class Legs:
    """``dispatch``, ``combine`` and ``combine_expert_major`` of
    :class:`~mori_jit.ops.ep.core.op.EpDispatchCombineOp` (a mixin: the op's state is its own)."""

    def dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                 indices: Optional[torch.Tensor], *, routing=None, return_routing: bool = False,
                 return_result: bool = False, return_recv_hook: bool = False, call_local_expert_count: bool = False,
                 block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1):
        """Send each token to the ranks of its top-k experts (once per distinct rank).

        Args:
            input: ``[n, hidden]`` ``cfg.input_dtype`` (the dispatch dtype; bf16 under
                ``dispatch_quant_type``, which the op casts to fp8 with block scales on the way), ``n <= M``.
            weights: ``[n, k]`` float32 top-k weights, or None (then every rank passes None).
            scales: ``[n, scale_dim]`` per-token scales of ``scale_type_size``-byte elements when the
                config declares ``scale_dim`` (and no ``dispatch_quant_type``); else None.
            indices: ``[n, k]`` ``cfg.index_dtype`` expert ids; an id ``< 0`` or out of range drops
                its slot. None on a replay (the routing has them).
            routing: replay (``cfg.routing_replay``): the routing of this op's latest dispatch; the new
                payload (``input``, ``weights``, ``scales`` of the same n tokens) lands at the same
                receive rows and expert-major entries, and no slot is claimed again. The replay's
                outputs may occupy the buffers of the dispatch it replays (a backend whose outputs
                are views of one receive buffer, as the ``hip`` backend's are, overwrites them):
                read that payload first. The routing stays valid for ``combine``.
            return_routing: also return the routing (what ``combine`` takes).
            return_result: return an :class:`~mori_jit.ops.ep.results.EpDispatchResult` (every
                output by name, with the expert counts and the expert-major layout the config asks
                for) instead of the tuple.
            return_recv_hook: run only the send (:meth:`dispatch_send`) and return its outputs
                followed by a ``hook`` that receives (:meth:`dispatch_recv`): the tuple with the
                hook appended, or ``(result, hook)`` with ``return_result``.
            call_local_expert_count: mori's request for :attr:`local_expert_count`; the op counts
                on every dispatch when ``cfg.expert_counts`` (refused by name otherwise).
            block_num, rdma_block_num, warp_per_block: mori's per-call geometry (-1: the op's
                choice): a geometry one of the op's built variants has is launched; any other is
                refused by name (nothing compiles on a call; the kernels have no network blocks).
                Not on the differentiable path (pin the geometry in the config there).

        Returns ``(out, out_weights, out_scales, out_indices, total_recv)`` (+ ``routing`` when
        ``return_routing``). ``out`` is ``[recv_capacity, hidden]``; rows ``[0, total_recv)`` are
        valid, in arrival order; ``total_recv`` is a 1-element int32 device tensor (no host sync).
        Raises :class:`EpDeviceError` if an earlier call's kernel gave up; this call's own failure
        shows only in a later call or :meth:`check` (its outputs are then garbage).

        ``weights`` may also be bf16/fp16 (a router in the model's dtype; moved as float32). With grad
        mode on and ``input`` or ``weights`` requiring grad, the call is differentiable
        (:mod:`mori_jit.ops.ep.train`: fresh outputs, a backward that sends the gradients home).
        """
        if return_recv_hook:
            return self._with_hook("dispatch", self.dispatch_send(
                input, weights, scales, indices, routing=routing, return_routing=return_routing,
                return_result=return_result, call_local_expert_count=call_local_expert_count, block_num=block_num,
                rdma_block_num=rdma_block_num, warp_per_block=warp_per_block))
        # (mori's -1 each: the common case, tested inline within the call's host budget)
        geometry = None if block_num == -1 and rdma_block_num == -1 and warp_per_block == -1 else \
            (block_num, rdma_block_num, warp_per_block)
        if ((getattr(input, "requires_grad", False) or getattr(weights, "requires_grad", False))
                and routing is None and torch.is_grad_enabled()):
            refuse_train_options(self, "dispatch", geometry, count=call_local_expert_count)
            return _train().dispatch(self, input, weights, scales, indices, return_routing, return_result)
        weights = router_weights(weights)
        if self._agree_per_call:
            k, fresh = self._kernels, routing is None  # (a replay belongs to the dispatch it replays)
            n = self._agree("dispatch" if fresh else "replay", self._dispatches + 1 if fresh else self._routing_no,
                            weights is not None, self._check_dispatch, k, input, weights, scales, indices, routing,
                            call_local_expert_count, geometry)
            self._dispatches += fresh
        else:
            k = self._live()
            n = self._check_dispatch(k, input, weights, scales, indices, routing, call_local_expert_count, geometry)
        v = self._pick(n) if geometry is None else pick_geometry(k.schedule, "dispatch", n, *geometry)
        if routing is None:
            res = k.dispatch(v, input, weights, scales, indices)
            # the only routing combine accepts until the next dispatch
            self._routing, self._routing_no = res[5], self._dispatches
        else:
            res = k.replay(v, input, weights, scales, routing)
        if self._count_experts:
            self._counts = res[6][0]
        if return_result:
            return EpDispatchResult.of(res)
        return res[:6] if return_routing else res[:5]

    def _check_dispatch(self, k: KernelSet, input, weights, scales, indices, routing, count: bool = False,
                        geometry: Optional[tuple] = None) -> int:
        """Raise TypeError/ValueError naming a bad argument (EpStateError while a leg is in flight);
        return the token count."""
        self._refuse_in_flight()
        n = check_dispatch_args(self, k, input, weights, scales, indices, routing)
        check_call_options(self, k.schedule, "dispatch", n, geometry, count=count)
        return n

    def combine(self, input: torch.Tensor, weights: Optional[torch.Tensor] = None,
                indices: Optional[torch.Tensor] = None, *, routing=None, out: Optional[torch.Tensor] = None,
                out_weights: Optional[torch.Tensor] = None, return_recv_hook: bool = False, block_num: int = -1,
                rdma_block_num: int = -1, warp_per_block: int = -1, use_external_inp_buf: int = -1,
                call_reset: bool = False):
        """Sum each token's expert outputs back on its source rank (fp32 accumulation, unweighted).

        ``input[i]`` is the expert output of dispatch row i (``[rows <= recv_capacity, hidden]``).
        ``routing``: the latest dispatch's (None: that one, the only one accepted); ``indices`` is
        unused (mori's signature; the routing carries the mapping). mori's per-call options: the
        geometry as in :meth:`dispatch`; ``use_external_inp_buf`` (-1, 0 or 1) and ``call_reset``
        are accepted with mori's meaning and need nothing done (the input is read in place
        wherever it lies, and the kernels leave the op ready for the next dispatch).
        Returns ``(out [n, hidden], out_weights [n, k] | None)``, freshly allocated unless the
        caller passes them: ``out`` (combine dtype) and ``out_weights`` (float32, only with
        ``weights``) are written in place and returned, which saves the allocations (host time)
        and gives graph captures static outputs. Collective: every rank calls it, and either every
        rank passes ``weights`` or none does (a rank sends its rows' weights to their home ranks
        even when it has no tokens of its own). Repeating a combine for the same dispatch is safe.
        Like :meth:`dispatch`, a combine whose kernel gave up returns garbage, reported by the next
        call or by :meth:`check` once the device has run it. ``return_recv_hook``: run only the send
        (:meth:`combine_send`) and return ``(out, out_weights, hook)``, the hook receiving.

        With grad mode on and ``input`` or ``weights`` requiring grad, the call is differentiable
        (its dispatch must have been: :mod:`mori_jit.ops.ep.train`).
        """
        if return_recv_hook:
            return self._with_hook("combine", self.combine_send(
                input, weights, indices, routing=routing, out=out, out_weights=out_weights, block_num=block_num,
                rdma_block_num=rdma_block_num, warp_per_block=warp_per_block,
                use_external_inp_buf=use_external_inp_buf, call_reset=call_reset))
        routing = self._routing_or_latest("combine", routing)
        geometry = None if block_num == -1 and rdma_block_num == -1 and warp_per_block == -1 else \
            (block_num, rdma_block_num, warp_per_block)
        options = None if use_external_inp_buf == -1 and call_reset is False else (use_external_inp_buf, call_reset)
        if ((getattr(input, "requires_grad", False) or getattr(weights, "requires_grad", False))
                and torch.is_grad_enabled()):
            refuse_train_options(self, "combine", geometry, options=options)
            return _train().combine(self, input, weights, routing, out, out_weights)
        if self._agree_per_call:
            k = self._kernels
            n = self._agree("combine", self._routing_no, weights is not None, self._check_combine, input, weights,
                            routing, out, out_weights, geometry, options)
        else:
            k = self._live()
            n = self._check_combine(input, weights, routing, out, out_weights, geometry, options)
        v = self._pick(n) if geometry is None else pick_geometry(k.schedule, "combine", n, *geometry)
        return k.combine(v, input, weights, routing, out, out_weights)

    def _routing_or_latest(self, call: str, routing):
        """mori's ``routing=None``: the latest dispatch's routing (EpStateError before any)."""
        if routing is not None:
            return routing
        if self._routing is None:
            if self._closed:  # (a closed op, or a group a failed exchange left unusable, says so first)
                raise EpStateError("EpDispatchCombineOp is closed")
            self._watch.check_usable()
            raise EpStateError(f"{call}: routing=None takes the latest dispatch's routing, and no dispatch has "
                               f"run on this op yet")
        return self._routing

    def combine_expert_major(self, input: torch.Tensor, *, routing, out: Optional[torch.Tensor] = None):
        """Sum each token's expert outputs given in the expert-major layout (``cfg.expert_capacity``).

        ``input`` is ``[num_experts_per_rank, expert_capacity, hidden]`` (combine dtype): entry
        ``(e, c)`` is local expert e's output for the dispatch's layout entry ``(e, c)``, **already
        multiplied by its top-k weight** (``EpExpertLayout.weights``): the expert side applies the
        weights, the combine only sums. Padding entries (``recv_row == -1``) are never read into the
        result (they may hold anything, NaN included). ``y[t]`` = the float32 sum over every entry
        of token t on every rank (one per valid top-k slot), rounded once to the combine dtype.

        Returns ``out [n, hidden]`` (combine dtype), freshly allocated unless the caller passes it
        (written in place and returned). Collective: every rank calls it after the same dispatch.
        Differentiable when grad mode is on and ``input`` requires grad (:mod:`mori_jit.ops.ep.train`).
        """
        if getattr(input, "requires_grad", False) and torch.is_grad_enabled():
            return _train().combine_expert_major(self, input, routing, out)
        self._refuse_closed()
        k = self._kernels if self._agree_per_call else self._live()
        if k.combine_expert_major is None:
            raise EpUnsupportedError(f"{type(self).__name__} has no expert-major combine")
        check = refuse_in_flight_then(self, check_expert_major_input)
        args = (self.cfg, input, routing, self._routing, out, self.device, self._arena_span)
        agreed = self._agree_per_call
        n = self._agree("combine_expert_major", self._routing_no, False, check, *args) if agreed else check(*args)
        return k.combine_expert_major(self._pick(n), input, routing, out)

    def _agree(self, call: str, of: int, weights_given: bool, check, *args) -> int:
        """The ranks' agreement on this call, at step ``(op number, call, of)`` (``of``: the dispatch it
        is or belongs to). A closed op refuses locally: its peers closed it with it (``close`` agrees)."""
        self._refuse_closed()
        group, watch = self._rank_mask.collective()
        watch.check_usable()
        return agree_on_arguments(group, (self._number, call, of), weights_given, check, *args)

    def _check_combine(self, input, weights, routing, out, out_weights, geometry: Optional[tuple] = None,
                       options: Optional[tuple] = None) -> int:
        """Raise TypeError/ValueError naming a bad argument (EpStateError while a leg is in flight);
        return the token count."""
        self._refuse_in_flight()
        n = check_combine_args(self, input, weights, routing, out, out_weights)
        check_call_options(self, self._kernels.schedule, "combine", n, geometry, options=options)
        return n
