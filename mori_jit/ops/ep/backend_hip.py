"""The ``hip`` backend: the JIT kernels of ``kernels/ep/`` (AMD via hipcc, NVIDIA via nvcc).

Every variant of the schedule is compiled and loaded at construction; ``dispatch``/``combine`` fill
a preallocated args struct and launch on the current stream: no compile, no host sync, so a whole
step can be captured in a CUDA/HIP graph. Device errors (timed-out waits) land in a host-mapped
word that the next call reads without syncing.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from . import knobs
from mori_jit.jit.compile import build_many
from mori_jit.jit.plan import prepare
from mori_jit.jit.toolchain import get_toolchain

from .arena import SymmArena
from .kernel_cfg import (COMBINE, DISPATCH, EP_ARGS, EP_REGIONS, LAYOUT, CombWord, EpMaxRecv, ErrCode, FlagUnit,
                  WaitId)
from .config import EpDispatchCombineConfig
from .op import EpDeviceError, EpDispatchCombineOp, KernelSet
from .backend_hip_moe import ExpertLayouts, ScaleViews, expert_major_combine
from .quant import ue8m0_dtype
from .results import EpCapacityError
from .unverified import unverified_paths
from .variants import ep_variants, hip_gaps

__all__ = ["EpDispatchCombineOpHip", "HipRouting", "CombineOutputs", "WAIT_MESSAGES", "decode_error"]

#: What each spin-wait of the kernels waits for (every WaitId has one; a CPU test checks).
WAIT_MESSAGES = {WaitId.kWaitDispatchDone: "dispatch: waiting for a peer's dispatch-done count",
                 WaitId.kWaitCombineDone: "waiting for a peer to finish its previous combine (combine-done count)",
                 WaitId.kWaitCombineRange: "combine: waiting for a peer's rows of a token range (range-ready flag)",
                 WaitId.kWaitCombineRows: "combine (low latency): waiting for a peer's row of a token (its words "
                                          "never arrived)"}
# Counters, epochs and every word compared against an epoch (flags, epoch-tagged slots and weights).
_SYNC_REGIONS = ("recv_num", "total_recv", "src_to_recv", "comb_flags", "xdb", "sync", "expert_adds", "exp_cursor")
# Low latency: regions whose every 32-bit word starts as CombWord.kEmptyWord (filled with this byte),
# and the weights, which carry an epoch.
_EMPTY_REGIONS, _EPOCH_REGIONS = ("comb_recv",), ("comb_recv_wts",)
_EMPTY_BYTE = 0xFF
assert int.from_bytes(bytes([_EMPTY_BYTE]) * 4, "little") == CombWord.kEmptyWord


class HipRouting(NamedTuple):
    """What combine needs from a dispatch: the token count; ``recv_src`` is the reverse map view
    (``srcRank*M + srcTok`` per received row, valid below ``total_recv``). A NamedTuple: it is
    built on every dispatch, so it must be cheap."""

    num_tokens: int
    recv_src: torch.Tensor
    total_recv: torch.Tensor


def decode_error(words: list[int], rank: int) -> str:
    """A readable message for the device error words (code, detail, extra)."""
    code, detail, extra = words[0], words[1], words[2]
    if code == ErrCode.kErrTimeout:
        wait, peer, who = detail >> 48, (detail >> 32) & 0xFFFF, (detail >> 16) & 0xFFFF
        said = f"rank {who}: {WAIT_MESSAGES.get(wait, f'wait {wait}')} from rank {peer} timed out after MORI_EP_TIMEOUT_S"
        if wait == WaitId.kWaitCombineRows:
            return f"{said} (token {extra}); a peer skipped or is stuck in a collective"
        # how far each word moves per epoch: a range flag 2 (its low bit carries a short input), a
        # done count kDoneUnit
        unit, what = {WaitId.kWaitCombineRange: (2, "combine"), WaitId.kWaitCombineDone: (FlagUnit.kDoneUnit, "combine"),
                      WaitId.kWaitDispatchDone: (FlagUnit.kDoneUnit, "dispatch")}.get(wait, (1, ""))
        goal = f"{extra} = {int(unit)} x {what} epoch {extra // unit}" if unit > 1 else f"{extra}"
        return f"{said} (flag never reached {goal}); a peer skipped or is stuck in a collective"
    if code == ErrCode.kErrShortInput:
        return (f"rank {(detail >> 16) & 0xFFFF}: combine input had {extra & 0xFFFFFFFF} rows but dispatch "
                f"received {extra >> 32}; the missing rows were not combined")
    if code == ErrCode.kErrCapacity:
        who, expert, count, cap = (detail >> 16) & 0xFFFF, detail >> 32, extra >> 32, extra & 0xFFFFFFFF
        return (f"rank {who}: local expert {expert} received {count} (token, expert) pairs, more than "
                f"expert_capacity={cap}; the expert-major layout holds the first {cap} (the receive rows and the "
                f"counts are whole); raise expert_capacity to at least {count}")
    if code == ErrCode.kErrPeerShortInput:
        who, peer = (detail >> 16) & 0xFFFF, detail >> 32
        # (a range flag reports its range's first token, the low-latency path the token itself)
        return (f"rank {who}: rank {peer}'s combine input was short (that rank reports its row counts), so "
                f"tokens of rank {who} (first reported at token {extra}) were summed without rank {peer}'s "
                f"rows: this combine's output on rank {who} is wrong")
    return f"unknown device error code {code:#x} (detail {detail:#x})"


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
            t = self._like[n] = (self._y_one.expand(n, self._hidden), self._w_one.expand(n, self._k))
        return t

    def y(self, n: int) -> torch.Tensor:
        """A new, uninitialized, contiguous ``[n, hidden]`` tensor of the combine dtype."""
        return torch.empty_like(self._templates(n)[0])

    def w(self, n: int) -> torch.Tensor:
        """A new, uninitialized, contiguous ``[n, k]`` float32 tensor."""
        return torch.empty_like(self._templates(n)[1])


class EpDispatchCombineOpHip(EpDispatchCombineOp):
    """EP op on the JIT kernels."""

    def _unsupported(self, cfg: EpDispatchCombineConfig) -> list[str]:
        missing = hip_gaps(cfg)  # (shared with mori-jit precompile --ep)
        if not knobs.ep.unverified:
            missing += [f"{p}: built, not yet verified on a GPU (MORI_EP_UNVERIFIED=1 runs it)"
                        for p in unverified_paths(cfg)]
        if not torch.cuda.is_available():
            missing.append("a CUDA/ROCm device (none visible)")
        elif cfg.is_internode and not missing:
            from .nvshmem_memory import nvshmem_gap
            why = nvshmem_gap(self.group)
            if why:
                missing.append(f"internode: the NVSHMEM arena: {why}")
        return missing

    def _memory_kind(self, cfg: EpDispatchCombineConfig, cards) -> str:
        # the internode kernels address peers through NVSHMEM: their arena is its symmetric heap
        return "nvshmem" if cfg.is_internode else super()._memory_kind(cfg, cards)

    def _regions(self, cfg: EpDispatchCombineConfig) -> dict[str, int]:
        # Building the variants validates every EpCfg, so a bad config fails before any allocation.
        self._toolchain = get_toolchain()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self._num_cus = props.multi_processor_count
        if cfg.is_internode:
            from .backend_internode import net_regions
            from .internode_variants import net_variants
            self._variants = net_variants(cfg, self._toolchain.arch, self._num_cus, self.ranks_per_device)
            return net_regions(self._variants)
        self._variants = ep_variants(cfg, self._toolchain.arch, self._num_cus, self.ranks_per_device)
        return self._variants.region_bytes()

    def _build_kernels(self, cfg: EpDispatchCombineConfig, arena: Optional[SymmArena]) -> KernelSet:
        assert arena is not None
        if cfg.is_internode:
            from .backend_internode import build_net_kernels
            return build_net_kernels(cfg, arena, self._variants, self._toolchain, self.device, self.group)
        var, tc, dev = self._variants, self._toolchain, self.device
        low = var.combine[0].lowLatency  # (one value for every variant: it sizes regions)
        if low:  # before any peer's first combine pushes here (construction is collective)
            arena.fill(_EMPTY_BYTE, *_EMPTY_REGIONS)
            torch.cuda.synchronize(dev)
            dist.barrier(group=self.group)
        # every variant is compiled and loaded here, before the first _pick (precompile walks the same list)
        requests = var.requests()
        build_many(requests, tc)  # misses compile in parallel; loading stays on this thread (its context)
        plans = {(spec.kind, c): prepare(spec, c, tc, dev) for spec, c in requests}
        disp_plans = [plans[(DISPATCH, c)] for c in var.dispatch]
        layout_plans = [plans[(LAYOUT, c)] for c in var.dispatch] if cfg.expert_capacity else []
        comb_plans = [plans[(COMBINE, c)] for c in var.combine]

        err = torch.zeros(4, dtype=torch.int64, pin_memory=True)  # host-mapped: read without a sync
        err_words = (ctypes.c_uint64 * 4).from_address(err.data_ptr())
        base = EP_ARGS.ctype()
        base.rank = cfg.rank
        base.timeoutNs = int(knobs.ep.timeout_s * 1e9)
        base.errWord = err.data_ptr()
        for pe, ptr in enumerate(arena.peer_bases):
            base.peerBase[pe] = ptr
        for name in EP_REGIONS:
            setattr(base, f"off_{name}", arena.offsets[name])
        dargs, cargs = EP_ARGS.ctype.from_buffer_copy(base), EP_ARGS.ctype.from_buffer_copy(base)
        largs = EP_ARGS.ctype.from_buffer_copy(base)  # the layout kernel's (after each dispatch)
        # one args struct per leg, rewritten per call; each variant's launch is bound to it
        disp_launch = [p.bind_struct(dargs) for p in disp_plans]
        comb_launch = [p.bind_struct(cargs) for p in comb_plans]
        layout_launch = [p.bind_struct(largs) for p in layout_plans]

        cap, hidden, k = EpMaxRecv(var.dispatch[0]), cfg.hidden_dim, cfg.num_experts_per_token
        out = arena.view("disp_out", cfg.dispatch_dtype, (cap, hidden))
        out_w = arena.view("out_wts", torch.float32, (cap, k))
        out_idx = arena.view("out_idx", cfg.index_dtype, (cap, k))
        recv_src = arena.view("recv_to_src", torch.int32, (cap,))
        total_recv = arena.view("total_recv", torch.int32, (1,))
        made = None  # the dtype of the scales the kernels make (in-op quantization)
        if cfg.quant_type not in (None, "none"):
            made = torch.float32 if cfg.scale_type_size == 4 else ue8m0_dtype()
        scale_views = ScaleViews(arena, cap, cfg.scale_dim, made)
        counts = arena.view("expert_counts", torch.int32, (cfg.num_experts_per_rank,)) if cfg.expert_counts else None
        layouts = ExpertLayouts(arena, cfg) if cfg.expert_capacity else None
        out_w_ptr = out_w.data_ptr()

        def moe_outputs(v, out_s, weights, replay):
            # EpDispatchResult's last two: the local expert counts and the expert-major layout, which
            # the layout kernel builds (a replay: refills) from the received rows
            if counts is None:
                return None
            if layouts is None:
                return counts, None
            largs.inpWeights = out_w_ptr if weights is not None else 0  # (the received weights)
            largs.replay = replay
            layout_launch[v]()
            return counts, layouts.of(out_s, weights is not None)

        inp_buffer = None  # get_combine_input_buffer(): allocated on first use (only this rank reads it)

        given = arena.tensor.data_ptr()  # (see _weights_ptr)

        def dispatch(v, x, weights, scales, indices):
            dargs.inpTok = x.data_ptr()
            dargs.inpWeights = _weights_ptr(weights, given)
            dargs.inpIndices = indices.data_ptr()
            dargs.numTokens = x.shape[0]
            dargs.inpScales = scales.data_ptr() if scales is not None else 0
            disp_launch[v]()
            out_s = scale_views.of(scales)
            return (out, out_w if weights is not None else None, out_s, out_idx, total_recv,
                    HipRouting(x.shape[0], recv_src, total_recv), moe_outputs(v, out_s, weights, 0))

        def replay(v, x, weights, scales, routing):
            # the dispatch's launch with the replay flag: the rows go where routing's dispatch put them
            dargs.inpTok = x.data_ptr()
            dargs.inpWeights = _weights_ptr(weights, given)
            dargs.numTokens = x.shape[0]
            dargs.inpScales = scales.data_ptr() if scales is not None else 0
            dargs.replay = 1
            try:
                disp_launch[v]()
            finally:
                dargs.replay = 0  # (the args struct is the dispatch's too)
            out_s = scale_views.of(scales)
            return (out, out_w if weights is not None else None, out_s, out_idx, total_recv, routing,
                    moe_outputs(v, out_s, weights, 1))

        # from the default allocator (never from inp, which may lie in the symmetric arena)
        new_outputs = CombineOutputs(cfg.combine_dtype, hidden, k, dev)

        def combine(v, inp, weights, routing, y, y_w):
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
            comb_launch[v]()
            return y, y_w

        expert_combine = expert_major_combine(cfg, var, plans, base, dev)  # (None without the layout)

        def combine_input_buffer():
            # A plain allocation, not arena: the push combine reads its input only locally, so this
            # costs no symmetric memory (world_size * M rows), and nothing unless it is asked for.
            nonlocal inp_buffer
            if inp_buffer is None:
                inp_buffer = torch.empty((cap, hidden), dtype=cfg.combine_dtype, device=dev)
            return inp_buffer

        def check():
            if err_words[0]:
                error = EpCapacityError if err_words[0] == ErrCode.kErrCapacity else EpDeviceError
                raise error(decode_error(list(err_words), cfg.rank) + "; call op.reset() (collective)")

        def reset():
            torch.cuda.synchronize(dev)
            dist.barrier(group=self.group)
            arena.zero(*_SYNC_REGIONS, *(_EPOCH_REGIONS if low else ()))
            if low:
                arena.fill(_EMPTY_BYTE, *_EMPTY_REGIONS)  # a failed combine may have left words unread
            err.zero_()
            torch.cuda.synchronize(dev)
            dist.barrier(group=self.group)

        def close():
            nonlocal err, inp_buffer
            torch.cuda.synchronize(dev)  # no kernel may still write the error words or the arena
            err, inp_buffer = torch.empty(0), None

        return KernelSet(dispatch=dispatch, combine=combine, schedule=var.schedule,
                         capabilities=frozenset({"graph", "zero_copy_combine", "scales"}),
                         check=check, reset=reset, combine_input_buffer=combine_input_buffer, close=close,
                         bound_launches={DISPATCH: tuple(disp_launch), COMBINE: tuple(comb_launch)},
                         replay=replay if cfg.routing_replay else None, combine_expert_major=expert_combine)
