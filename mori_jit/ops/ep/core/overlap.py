"""A leg in two halves, for overlapping its exchange with other work (docs/design.md §6, "Send and
receive").

``dispatch_send`` / ``dispatch_recv`` and ``combine_send`` / ``combine_recv`` split each leg where its
kernels stop storing into peers and start waiting for them: the send launches what moves this
rank's rows and signals their arrival, and returns the leg's outputs at once; the receive waits for
every peer's rows and finishes the leg (``total_recv``, the counts and the expert-major layout; the
combine's sums). Between the two, the stream is free for other work (another micro-batch's GEMMs),
and no SM waits for a peer. ``dispatch(..., return_recv_hook=True)`` and ``combine(...,
return_recv_hook=True)`` are the same mechanism in DeepEP's spelling: the send's outputs, then a
``hook`` that receives.

One leg is in flight per op at a time: from a send until its receive, every other call on the op
raises :class:`EpStateError` on the calling rank before anything is launched (the leg's kernels
and buffers belong to it until the receive). Two micro-batches in flight take one op each.

The backend half is :class:`~mori_jit.ops.ep.core.kernel_set.KernelSet`'s ``dispatch_send`` and
``combine_send``: each launches or posts the send and returns the leg's outputs with a
zero-argument ``receive``, which the op keeps until the receive call.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from mori_jit.ops.ep.core.arguments import router_weights
from mori_jit.ops.ep.core.call_options import pick_geometry
from mori_jit.ops.ep.results import EpDispatchResult
from mori_jit.ops.ep.errors import EpStateError, EpUnsupportedError

__all__ = ["SplitLegs", "InFlight", "refuse_in_flight_then"]

#: The config field that asks for the split legs.
FIELD = "split_send_recv"


class InFlight(NamedTuple):
    """A leg whose send has run and whose receive has not: ``leg`` (``"dispatch"`` or ``"combine"``)
    and the backend's ``receive``. Each send makes a new one; its identity is the hook's ticket."""

    leg: str
    receive: Callable[[], None]


class SplitLegs:
    """The send/receive calls of :class:`~mori_jit.ops.ep.core.op.EpDispatchCombineOp` (a mixin: the
    op's checks, agreement and bucket pick are its own)."""

    #: the leg whose receive is due, or None
    _in_flight: Optional[InFlight] = None

    # -- the state ---------------------------------------------------------------------------------
    def _refuse_in_flight(self) -> None:
        """Raise :class:`EpStateError` while a leg's send awaits its receive (every call but that
        receive is refused; nothing is launched)."""
        f = self._in_flight
        if f is not None:
            what = "outputs and routing are" if f.leg == "dispatch" else "outputs are"
            raise EpStateError(f"a {f.leg}_send is in flight on this op: the next call must be {f.leg}_recv() (or the "
                               f"hook that send returned); its {what} not valid before that receive")

    def _split_kernels(self, call: str):
        k = self._live()
        if not self.cfg.split_send_recv:
            raise EpUnsupportedError(f"{call}: the op was built without the split legs; set "
                                     f"EpDispatchCombineConfig.{FIELD}=True (every rank)")
        return k

    def _begin(self, leg: str, receive: Callable[[], None]) -> None:
        self._in_flight = InFlight(leg, receive)

    def _receive(self, leg: str, ticket: Optional[InFlight]) -> None:
        """Run the receive of ``leg``'s send (``ticket``: a hook's send; None: whichever is in flight)."""
        self._refuse_closed()
        f = self._in_flight
        if f is None or f.leg != leg or (ticket is not None and ticket is not f):
            if ticket is not None:
                raise EpStateError(f"{leg} hook: its {leg}_send has already been received (a hook receives once) "
                                   f"or ended by reset()")
            other = f" (a {f.leg}_send is: call {f.leg}_recv())" if f is not None else ""
            raise EpStateError(f"{leg}_recv: no {leg}_send is in flight on this op{other}; a receive follows its send")
        self._live()  # (an earlier call's device error: raised before this receive launches)
        self._in_flight = None  # (cleared first: a receive that raises still ends the leg)
        try:
            f.receive()
        except BaseException:
            if leg == "dispatch":  # (no combine may follow a dispatch whose receive failed)
                self._routing = None
            raise

    def _hook(self, leg: str, ticket: InFlight) -> Callable[[], None]:
        def hook() -> None:
            """Receive this hook's send (once)."""
            self._receive(leg, ticket)
        return hook

    # -- the calls ---------------------------------------------------------------------------------
    def dispatch_send(self, input, weights, scales, indices, *, routing=None, return_routing: bool = False,
                      return_result: bool = False, call_local_expert_count: bool = False, block_num: int = -1,
                      rdma_block_num: int = -1, warp_per_block: int = -1):
        """:meth:`dispatch`'s first half: checks its arguments as ``dispatch`` does, sends this rank's
        rows and returns ``dispatch``'s outputs (same arguments, same returns, mori's per-call
        options included), which hold the received rows only once :meth:`dispatch_recv` has run on
        the stream. Until then every other call on the op raises :class:`EpStateError`. ``input``,
        ``weights``, ``scales`` and ``indices`` must stay alive and unchanged until the receive."""
        k = self._split_kernels("dispatch_send")
        weights = router_weights(weights)  # (the backend keeps the cast alive until the receive)
        geometry = None if block_num == -1 and rdma_block_num == -1 and warp_per_block == -1 else \
            (block_num, rdma_block_num, warp_per_block)
        if self._agree_per_call:  # (the same step as dispatch's: a send meets a peer's dispatch)
            fresh = routing is None
            n = self._agree("dispatch" if fresh else "replay", self._dispatches + 1 if fresh else self._routing_no,
                            weights is not None, self._check_dispatch, k, input, weights, scales, indices, routing,
                            call_local_expert_count, geometry)
            self._dispatches += fresh
        else:
            n = self._check_dispatch(k, input, weights, scales, indices, routing, call_local_expert_count, geometry)
        v = self._pick(n) if geometry is None else pick_geometry(k.schedule, "dispatch", n, *geometry)
        res, receive = k.dispatch_send(v, input, weights, scales, indices, routing)
        if routing is None:  # the only routing combine accepts (after the receive)
            self._routing, self._routing_no = res[5], self._dispatches
        if self._count_experts:  # (local_expert_count: valid, like every output, after the receive)
            self._counts = res[6][0]
        self._begin("dispatch", receive)
        if return_result:
            return EpDispatchResult.of(res)
        return res[:6] if return_routing else res[:5]

    def dispatch_recv(self) -> None:
        """:meth:`dispatch`'s second half: waits (on the stream) for every peer's rows of the
        in-flight :meth:`dispatch_send` and finishes the dispatch (``total_recv``, the expert counts
        and layout). Raises :class:`EpStateError` when no dispatch_send is in flight."""
        self._receive("dispatch", None)

    def combine_send(self, input, weights=None, indices=None, *, routing=None, out=None, out_weights=None,
                     block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1,
                     use_external_inp_buf: int = -1, call_reset: bool = False):
        """:meth:`combine`'s first half: checks its arguments as ``combine`` does (``routing=None``:
        the latest dispatch's; mori's per-call options as ``combine`` takes them), pushes this rank's
        rows to their home ranks and returns ``combine``'s outputs ``(out, out_weights)``, valid once
        :meth:`combine_recv` has run on the stream. ``input`` and ``weights`` must stay alive and
        unchanged until the receive (it sums this rank's own rows from them)."""
        k = self._split_kernels("combine_send")
        routing = self._routing_or_latest("combine_send", routing)
        geometry = None if block_num == -1 and rdma_block_num == -1 and warp_per_block == -1 else \
            (block_num, rdma_block_num, warp_per_block)
        options = None if use_external_inp_buf == -1 and call_reset is False else (use_external_inp_buf, call_reset)
        if self._agree_per_call:
            n = self._agree("combine", self._routing_no, weights is not None, self._check_combine, input, weights,
                            routing, out, out_weights, geometry, options)
        else:
            n = self._check_combine(input, weights, routing, out, out_weights, geometry, options)
        v = self._pick(n) if geometry is None else pick_geometry(k.schedule, "combine", n, *geometry)
        res, receive = k.combine_send(v, input, weights, routing, out, out_weights)
        self._begin("combine", receive)
        return res

    def combine_recv(self) -> None:
        """:meth:`combine`'s second half: waits for every peer's rows of the in-flight
        :meth:`combine_send` and sums them. Raises :class:`EpStateError` when none is in flight."""
        self._receive("combine", None)

    def _with_hook(self, leg: str, outputs):
        """A send's outputs, then the hook that receives it: a tuple gets the hook appended, a result
        object becomes ``(result, hook)``."""
        hook = self._hook(leg, self._in_flight)
        return (*outputs, hook) if type(outputs) is tuple else (outputs, hook)


def refuse_in_flight_then(op: SplitLegs, check: Callable[..., int]) -> Callable[..., int]:
    """``check`` preceded by the op's in-flight refusal (a check for the ranks' agreement,
    :mod:`.agreement`, so that a rank out of step makes every rank refuse the call)."""
    def checked(*args) -> int:
        op._refuse_in_flight()
        return check(*args)
    return checked
