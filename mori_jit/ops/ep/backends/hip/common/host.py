"""What the ``hip`` backend's intranode and internode kernel sets share on the host: the routing
combine takes, the views of the received rows, the weights pointer, fresh combine outputs, the
host-mapped error words, the args every launch starts from, the combine call, the combine input
buffer, the split legs' launches and the collective reset."""
from __future__ import annotations

import ctypes
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from mori_jit.ops.ep import knobs
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, DISPATCH, SPLIT_PHASES

__all__ = ["HipRouting", "ReceiveViews", "receive_views", "_weights_ptr", "CombineOutputs", "ErrorWords", "base_args", "make_combine", "make_combine_send",
           "SendStream", "split_launches", "InputBuffer", "collective_reset", "mask_views"]


class HipRouting(NamedTuple):
    """What combine needs from a dispatch: the token count; ``recv_src`` is the reverse map view
    (``srcRank*M + srcTok`` per received row, valid below ``total_recv``). A NamedTuple: it is
    built on every dispatch, so it must be cheap."""

    num_tokens: int
    recv_src: torch.Tensor
    total_recv: torch.Tensor


class ReceiveViews(NamedTuple):
    """The dispatch's outputs as views of the arena, made once: ``out`` ``[cap, hidden]`` (dispatch
    dtype), ``weights`` ``[cap, k]`` float32, ``indices`` ``[cap, k]`` (index dtype), ``recv_src``
    ``[cap]`` int32 (the reverse map) and ``total_recv`` ``[1]`` int32."""

    out: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor
    recv_src: torch.Tensor
    total_recv: torch.Tensor


def receive_views(arena, cfg, cap: int) -> ReceiveViews:
    """The :class:`ReceiveViews` of ``arena`` for ``cfg`` and a receive capacity of ``cap`` rows
    (the intranode and internode arenas name these regions alike)."""
    hidden, k = cfg.hidden_dim, cfg.num_experts_per_token
    return ReceiveViews(arena.view("disp_out", cfg.dispatch_dtype, (cap, hidden)),
                        arena.view("out_wts", torch.float32, (cap, k)),
                        arena.view("out_idx", cfg.index_dtype, (cap, k)),
                        arena.view("recv_to_src", torch.int32, (cap,)),
                        arena.view("total_recv", torch.int32, (1,)))


def mask_views(arena, world_size: int) -> dict:
    """The KernelSet's rank masking over the arena's ``MASK_REGIONS`` (``common.cfg``): ``rank_mask``
    int32 ``[world_size]`` and ``masked_pairs``, the last dispatch's count (the region's third word)."""
    return {"rank_mask": arena.view("rank_mask", torch.int32, (world_size,)),
            "masked_pairs": arena.view("masked_pairs", torch.int32, (3,))[2:]}


def _weights_ptr(t: Optional[torch.Tensor], given: int) -> int:
    """The kernels' pointer for an optional weights tensor: 0 for None, its data otherwise.

    A null pointer tells the kernels "no weights" (the combine then neither sends nor sums them).
    A tensor with no rows is still weights given, but torch reports ``data_ptr() == 0`` for every
    empty tensor, so it passes ``given``, a valid device address the kernels never dereference
    (there are no rows to read or write): a rank that received no rows still sends nothing and
    sums its own tokens' weights from the peers."""
    if t is None:
        return 0
    return t.data_ptr() or given


class CombineOutputs:
    """Fresh combine outputs on ``device``: ``y(n)`` ``[n, hidden]`` of the combine dtype, ``w(n)``
    ``[n, k]`` float32, allocated with the least host time. ``torch.empty_like`` of a zero-stride
    template (one element expanded to the shape, cached by n) skips ``torch.empty``'s size and dtype
    parsing: 2.1 µs per tensor on the benchmark machine, against 3.1 for ``new_empty`` and 3.9 for
    ``torch.empty`` (docs/performance.md). ``empty_like`` gives an overlapping input contiguous strides."""

    _MAX_CACHED = 256  # token counts kept (a template pair is two tensor headers)

    def __init__(self, dtype: torch.dtype, hidden: int, k: int, device: torch.device):
        self._y_one = torch.empty(1, 1, dtype=dtype, device=device)
        self._w_one = torch.empty(1, 1, dtype=torch.float32, device=device)
        self._hidden, self._k = hidden, k
        self._like: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _templates(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._like.get(n)
        if t is None:
            if len(self._like) >= self._MAX_CACHED:
                self._like.clear()
            if n == 0:  # (empty_like keeps an empty tensor's zero strides, which no dtype view accepts)
                t = self._like[n] = (self._y_one.new_empty(0, self._hidden), self._w_one.new_empty(0, self._k))
            else:
                t = self._like[n] = (self._y_one.expand(n, self._hidden), self._w_one.expand(n, self._k))
        return t

    def y(self, n: int) -> torch.Tensor:
        """A new, uninitialized, contiguous ``[n, hidden]`` tensor of the combine dtype."""
        return torch.empty_like(self._templates(n)[0])

    def w(self, n: int) -> torch.Tensor:
        """A new, uninitialized, contiguous ``[n, k]`` float32 tensor."""
        return torch.empty_like(self._templates(n)[1])


class ErrorWords:
    """The kernels' error words (code, detail, extra, spare) in pinned host-mapped memory: a kernel
    writes them and every call reads them without a sync."""

    def __init__(self):
        self.tensor = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        self.words = (ctypes.c_uint64 * 4).from_address(self.tensor.data_ptr())

    def release(self) -> None:
        """Free the pinned words (after a device sync: no kernel may still write them)."""
        self.tensor = torch.empty(0)


def base_args(schema, rank: int, err: ErrorWords, offsets: dict[str, int], regions) -> ctypes.Structure:
    """An args struct of ``schema`` with what no call changes: the rank, the wait bound, the error
    words and the offset ``off_<name>`` of every region in ``regions``."""
    base = schema.ctype()
    base.rank = rank
    base.timeoutNs = int(knobs.ep.timeout_s * 1e9)
    base.errWord = err.tensor.data_ptr()
    for name in regions:
        setattr(base, f"off_{name}", offsets[name])
    return base


def make_combine(cargs, launches: Sequence[Callable[[], None]], new_outputs: CombineOutputs, given: int):
    """The KernelSet's ``combine``: fill ``cargs`` (the args struct ``launches[v]`` reads) and
    launch bucket v; outputs the caller does not pass are fresh (``new_outputs``)."""

    def combine(v, inp, weights, routing, y, y_w):
        y, y_w = _fill_combine(cargs, new_outputs, given, inp, weights, routing, y, y_w)
        launches[v]()
        return y, y_w

    return combine


class SendStream:
    """Where a split leg's send kernel runs, so that the caller's work between the send and the
    receive runs beside it (docs/design.md §6, "Send and receive").

    Eagerly, the send runs on the op's side stream, after everything queued on the caller's stream
    (its inputs are ready), and the receive makes the caller's stream wait for it: a grouped GEMM
    queued in between runs concurrently with the send's copies, on the SMs the send does not hold.
    While a graph is being captured the send runs on the capturing stream: a stream forked in a
    capture must rejoin it in the same capture, and a send and its receive may be captured in two
    graphs (the graph then hides the waiting for the peers, not the send's own copies)."""

    def __init__(self, device: torch.device):
        self._device = device
        self._side: Optional[torch.cuda.Stream] = None  # (made on the first eager send)
        self._pending = False  # a send ran on the side stream and no receive has joined it yet

    def send(self, launch: Callable[[], None], inputs: Sequence[Optional[torch.Tensor]]) -> None:
        """Run ``launch`` (the send kernel) as described above; ``inputs``: the tensors it reads,
        kept from the caching allocator's reuse until the side stream is done with them."""
        if torch.cuda.is_current_stream_capturing():
            launch()
            return
        cur = torch.cuda.current_stream(self._device)
        side = self._side
        if side is None:
            side = self._side = torch.cuda.Stream(self._device)
        side.wait_stream(cur)
        for t in inputs:
            if t is not None:
                t.record_stream(side)
        torch.cuda.set_stream(side)
        try:
            launch()
        finally:
            torch.cuda.set_stream(cur)
        self._pending = True

    def join(self) -> None:
        """Before a receive: the caller's stream waits for the side stream's send."""
        if self._pending:
            self._pending = False
            torch.cuda.current_stream(self._device).wait_stream(self._side)


def make_combine_send(cargs, sends: Sequence[Callable[[], None]], receives: Sequence[Callable[[], None]],
                      new_outputs: CombineOutputs, given: int, stream: SendStream):
    """The KernelSet's ``combine_send``: :func:`make_combine`'s, launching bucket v's send kernel
    (on ``stream``'s terms; ``sends`` is empty where the variants have none: one rank); returns
    ``((y, y_w), receive)``, the receive kernel of bucket v on the same ``cargs`` (which the op
    leaves alone until the receive: no other call runs while a leg is in flight)."""

    def combine_send(v, inp, weights, routing, y, y_w):
        y, y_w = _fill_combine(cargs, new_outputs, given, inp, weights, routing, y, y_w)
        if sends:
            stream.send(sends[v], (inp, weights))

        def receive():
            stream.join()
            receives[v]()

        return (y, y_w), receive

    return combine_send


def split_launches(half: Callable, bind: Callable) -> dict:
    """Each half's launches of the split legs, by bucket: ``{(leg, phase): [launch of bucket v]}``
    for both legs and :data:`~.cfg.SPLIT_PHASES`; ``half(leg, phase)`` is the per-bucket Cfg of that
    half (the variants' ``half``; empty without the split) and ``bind(leg, v, cfg)`` its bound
    launch (on the leg's args struct, which the op leaves alone from a send until its receive)."""
    return {(leg, ph): [bind(leg, v, c) for v, c in enumerate(half(leg, ph))]
            for leg in (DISPATCH, COMBINE) for ph in SPLIT_PHASES}


def _fill_combine(cargs, new_outputs: CombineOutputs, given: int, inp, weights, routing, y, y_w):
    """``cargs`` for a combine of ``inp`` into ``y``/``y_w`` (fresh where None); returns them."""
    n = routing.num_tokens
    if y is None:
        y = new_outputs.y(n)
    if y_w is None and weights is not None:
        y_w = new_outputs.w(n)
    cargs.inpTok = inp.data_ptr()
    cargs.inpWeights = _weights_ptr(weights, given)
    cargs.outTok = y.data_ptr()
    cargs.outWeights = _weights_ptr(y_w, given)
    cargs.numTokens = n
    cargs.inpRows = inp.shape[0]
    return y, y_w


class InputBuffer:
    """The combine input buffer (``get_combine_input_buffer``): ``[rows, hidden]`` plain memory,
    allocated on the first :meth:`get` (only this rank reads it, so it costs no symmetric memory,
    and nothing unless it is asked for)."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self._shape, self._dtype, self._device = (rows, hidden), dtype, device
        self._tensor: Optional[torch.Tensor] = None

    def get(self) -> torch.Tensor:
        """The buffer, the same tensor on every call."""
        if self._tensor is None:
            self._tensor = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        return self._tensor

    def release(self) -> None:
        """Drop the buffer."""
        self._tensor = None


def collective_reset(device: torch.device, collective, clear: Callable[[], None]) -> None:
    """Collective over ``collective`` (the op's ``(group, watch)`` now: the survivors' once a rank is
    masked): every rank's device idle, then ``clear()`` (counters, flags, error words), then every
    rank's clear complete before any rank launches again. The watch bounds both barriers."""
    group, watch = collective
    torch.cuda.synchronize(device)
    watch.wait(dist.barrier(group=group, async_op=True), "reset's barrier before clearing")
    clear()
    torch.cuda.synchronize(device)
    watch.wait(dist.barrier(group=group, async_op=True), "reset's barrier after clearing")
