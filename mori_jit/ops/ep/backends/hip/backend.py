"""The ``hip`` backend: the JIT kernels of ``kernels/ep/`` (AMD via hipcc, NVIDIA via nvcc).

Every variant of the schedule is compiled and loaded at construction; ``dispatch``/``combine`` fill
a preallocated args struct and launch on the current stream: no compile, no host sync, so a whole
step can be captured in a CUDA/HIP graph. Device errors (timed-out waits) land in a host-mapped
word that the next call reads without syncing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mori_jit.jit.compile import build_many
from mori_jit.jit.plan import prepare
from mori_jit.jit.toolchain import get_toolchain

from mori_jit.ops.ep.memory.arena import SymmArena
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, DISPATCH, EP_ARGS, EP_REGIONS, LAYOUT, CombWord, EpMaxRecv, EpPhase, ErrCode
from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.errors import WAIT_MESSAGES, decode_error
from mori_jit.ops.ep.backends.hip.common.wait_errors import waited_for
from mori_jit.ops.ep.backends.hip.common.grid import ranks_dividing_cus
from mori_jit.ops.ep.backends.hip.common.host import CombineOutputs, ErrorWords, HipRouting, InputBuffer, SendStream, _weights_ptr, base_args, collective_reset, make_combine, make_combine_send, mask_views, receive_views, split_launches
from mori_jit.ops.ep.core.op import EpDispatchCombineOp, KernelSet
from mori_jit.ops.ep.backends.hip.intranode.moe_views import ExpertLayouts, ScaleViews, expert_major_combine
from mori_jit.ops.ep.quant import ue8m0_dtype

from mori_jit.ops.ep.backends.hip.variants import ep_variants, hip_gaps
from mori_jit.ops.ep.errors import EpCapacityError, EpDeviceError

__all__ = ["EpDispatchCombineOpHip", "HipRouting", "CombineOutputs", "WAIT_MESSAGES", "decode_error", "_weights_ptr"]

# Counters, epochs and every word compared against an epoch (flags, epoch-tagged slots and weights).
# (rank_mask is not one: the mask outlives a reset, which runs among the survivors)
_SYNC_REGIONS = ("recv_num", "total_recv", "src_to_recv", "comb_flags", "xdb", "sync", "expert_adds", "exp_cursor",
                 "masked_pairs")
# Low latency: regions whose every 32-bit word starts as CombWord.kEmptyWord (filled with this byte),
# and the weights, which carry an epoch.
_EMPTY_REGIONS, _EPOCH_REGIONS = ("comb_recv",), ("comb_recv_wts",)
_EMPTY_BYTE = 0xFF
assert int.from_bytes(bytes([_EMPTY_BYTE]) * 4, "little") == CombWord.kEmptyWord


class EpDispatchCombineOpHip(EpDispatchCombineOp):
    """EP op on the JIT kernels."""

    def _unsupported(self, cfg: EpDispatchCombineConfig) -> list[str]:
        missing = hip_gaps(cfg)  # (shared with mori-jit precompile --ep)
        if not torch.cuda.is_available():
            missing.append("a CUDA/ROCm device (none visible; kernel_backend='torch' runs the same op on "
                           "torch.distributed collectives, on the CPU too)")
        elif cfg.is_internode and not missing:
            from mori_jit.ops.ep.memory.nvshmem import nvshmem_gap
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
        sharing = ranks_dividing_cus(self.ranks_per_device)
        if cfg.is_internode:
            from mori_jit.ops.ep.backends.hip.internode.kernels import net_regions
            from mori_jit.ops.ep.backends.hip.internode.variants import net_variants
            self._variants = net_variants(cfg, self._toolchain.arch, self._num_cus, sharing)
            return net_regions(self._variants)
        self._variants = ep_variants(cfg, self._toolchain.arch, self._num_cus, sharing)
        return self._variants.region_bytes()

    def _build_kernels(self, cfg: EpDispatchCombineConfig, arena: Optional[SymmArena]) -> KernelSet:
        assert arena is not None
        if cfg.is_internode:
            from mori_jit.ops.ep.backends.hip.internode.kernels import build_net_kernels
            return build_net_kernels(cfg, arena, self._variants, self._toolchain, self.device, lambda: self._rank_mask)
        var, tc, dev = self._variants, self._toolchain, self.device
        low = var.combine[0].lowLatency  # (one value for every variant: it sizes regions)
        if low:  # before any peer's first combine pushes here (construction is collective)
            arena.fill(_EMPTY_BYTE, *_EMPTY_REGIONS)
            torch.cuda.synchronize(dev)
            self._watch.wait(dist.barrier(group=self.group, async_op=True),
                             "the barrier after filling the combine's regions at construction")
        # every variant is compiled and loaded here, before the first _pick (precompile walks the same list)
        requests = var.requests()
        build_many(requests, tc)  # misses compile in parallel; loading stays on this thread (its context)
        plans = {(spec.kind, c): prepare(spec, c, tc, dev) for spec, c in requests}
        disp_plans = [plans[(DISPATCH, c)] for c in var.dispatch]
        layout_plans = [plans[(LAYOUT, c)] for c in var.dispatch] if cfg.expert_capacity else []
        comb_plans = [plans[(COMBINE, c)] for c in var.combine]

        err = ErrorWords()
        err_words = err.words
        base = base_args(EP_ARGS, cfg.rank, err, arena.offsets, EP_REGIONS)
        for pe, ptr in enumerate(arena.peer_bases):
            base.peerBase[pe] = ptr
        dargs, cargs = EP_ARGS.ctype.from_buffer_copy(base), EP_ARGS.ctype.from_buffer_copy(base)
        largs = EP_ARGS.ctype.from_buffer_copy(base)  # the layout kernel's (after each dispatch)
        # one args struct per leg, rewritten per call; each variant's launch is bound to it
        disp_launch = [p.bind_struct(dargs) for p in disp_plans]
        comb_launch = [p.bind_struct(cargs) for p in comb_plans]
        layout_launch = [p.bind_struct(largs) for p in layout_plans]

        cap, hidden, k = EpMaxRecv(var.dispatch[0]), cfg.hidden_dim, cfg.num_experts_per_token
        out, out_w, out_idx, recv_src, total_recv = receive_views(arena, cfg, cap)
        made = None  # the dtype of the scales the kernels make (in-op quantization)
        if cfg.dispatch_quant_type not in (None, "none"):
            made = torch.float32 if cfg.scale_type_size == 4 else ue8m0_dtype()
        scale_views = ScaleViews(arena, cap, cfg.scale_dim, made)
        counts = arena.view("expert_counts", torch.int32, (cfg.num_experts_per_rank,)) if cfg.expert_counts else None
        layouts = ExpertLayouts(arena, cfg) if cfg.expert_capacity else None
        out_w_ptr = out_w.data_ptr()

        def moe_views(out_s, weights):
            # EpDispatchResult's last two: the local expert counts and the expert-major layout
            return counts, layouts.of(out_s, weights is not None) if layouts is not None else None

        def lay_out(v, weights, replay):
            # the layout kernel builds the layout (a replay: refills it) from the received rows
            if layouts is not None:
                largs.inpWeights = out_w_ptr if weights is not None else 0  # (the received weights)
                largs.replay = replay
                layout_launch[v]()

        def moe_outputs(v, out_s, weights, replay):
            if counts is None:
                return None
            lay_out(v, weights, replay)
            return moe_views(out_s, weights)

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
            launch(disp_launch, v, 1)
            out_s = scale_views.of(scales)
            return (out, out_w if weights is not None else None, out_s, out_idx, total_recv, routing,
                    moe_outputs(v, out_s, weights, 1))

        def launch(launches, v, replay):
            # with the replay flag set for this launch only (the args struct is every dispatch's)
            dargs.replay = replay
            try:
                launches[v]()
            finally:
                dargs.replay = 0

        # the split legs: each bucket's send and receive kernels, on the legs' own args structs
        # (the op runs nothing else on them between a send and its receive)
        halves = split_launches(var.half, lambda kind, v, c: plans[(kind, c)].bind_struct(
            dargs if kind == DISPATCH else cargs))

        stream = SendStream(dev)  # (both legs' sends: one leg is in flight at a time)

        def dispatch_send(v, x, weights, scales, indices, routing):
            replay = int(routing is not None)
            dargs.inpTok = x.data_ptr()
            dargs.inpWeights = _weights_ptr(weights, given)
            if not replay:  # (a replay keeps the dispatch's ids)
                dargs.inpIndices = indices.data_ptr()
            dargs.numTokens = x.shape[0]
            dargs.inpScales = scales.data_ptr() if scales is not None else 0
            stream.send(lambda: launch(halves[DISPATCH, EpPhase.Send], v, replay), (x, weights, scales, indices))
            out_s = scale_views.of(scales)

            def receive():
                stream.join()
                launch(halves[DISPATCH, EpPhase.Recv], v, replay)
                lay_out(v, weights, replay)

            return (out, out_w if weights is not None else None, out_s, out_idx, total_recv,
                    routing if replay else HipRouting(x.shape[0], recv_src, total_recv),
                    moe_views(out_s, weights) if counts is not None else None), receive

        # from the default allocator (never from inp, which may lie in the symmetric arena)
        new_outputs = CombineOutputs(cfg.combine_dtype, hidden, k, dev)

        combine = make_combine(cargs, comb_launch, new_outputs, given)
        combine_send = make_combine_send(cargs, halves[COMBINE, EpPhase.Send], halves[COMBINE, EpPhase.Recv],
                                         new_outputs, given, stream)

        expert_combine = expert_major_combine(cfg, var, plans, base, dev)  # (None without the layout)

        # (the push combine reads its input only locally, so the buffer need not be symmetric)
        inp_buffer = InputBuffer(cap, hidden, cfg.combine_dtype, dev)

        def check():
            if err_words[0]:
                error = EpCapacityError if err_words[0] == ErrCode.kErrCapacity else EpDeviceError
                peer = waited_for(err_words[1]) if err_words[0] == ErrCode.kErrTimeout else None
                self._rank_mask.saw_timeout(peer)  # (MORI_EP_MASK_ON_TIMEOUT; core/mask.py)
                raise error(decode_error(list(err_words), cfg.rank) + "; call op.reset() (collective)", peer=peer)

        def clear():
            arena.zero(*_SYNC_REGIONS, *(_EPOCH_REGIONS if low else ()))
            if low:
                arena.fill(_EMPTY_BYTE, *_EMPTY_REGIONS)  # a failed combine may have left words unread
            err.tensor.zero_()

        def close():
            torch.cuda.synchronize(dev)  # no kernel may still write the error words or the arena
            err.release()
            inp_buffer.release()

        return KernelSet(dispatch=dispatch, combine=combine, schedule=var.schedule,
                         capabilities=frozenset({"graph", "zero_copy_combine", "scales"}),
                         check=check, reset=lambda: collective_reset(dev, self._rank_mask.collective(), clear),
                         combine_input_buffer=inp_buffer.get, close=close,
                         bound_launches={DISPATCH: tuple(disp_launch), COMBINE: tuple(comb_launch)},
                         replay=replay if cfg.routing_replay else None, combine_expert_major=expert_combine,
                         dispatch_send=dispatch_send if var.split else None,
                         combine_send=combine_send if var.split else None,
                         **mask_views(arena, cfg.world_size))
