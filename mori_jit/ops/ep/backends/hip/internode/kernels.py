"""The ``hip`` backend's internode kernel set: the ``v2_ll`` and ``v2`` kernels on an NVSHMEM arena.

Each leg of each bucket is one kernel (its family's phases of that leg), bound to one args struct
per leg that each call rewrites: one driver launch per call, no compile, no host sync, so a
whole step can be captured in a CUDA graph. The split legs launch each bucket's send kernel and
hand back its receive kernel, on the same struct (``common.host``: ``split_launches``,
``make_combine_send``; the op's ``core.overlap`` does the rest, as for the intranode kernels).
Device errors (timed-out waits, a short combine input) land in host-mapped words that the next
call reads without syncing. Outputs and the routing are the intranode op's (same contract).
Rank masking (``core.mask``) is served by an op whose every bucket is ``v2_ll``
(``variants.mask_refusal`` says why another is not); the reset runs on the op's host group of the
moment, the survivors' once a rank is masked: a torch process group, never an NVSHMEM collective,
which would wait for every PE, a dead one included.
"""
from __future__ import annotations

from typing import Callable

import torch

from mori_jit.jit.compile import build_many
from mori_jit.jit.plan import prepare

from mori_jit.ops.ep.memory.arena import SymmArena
from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.internode.errors import NET_WAIT_MESSAGES, decode_net_error
from mori_jit.ops.ep.backends.hip.common.host import CombineOutputs, ErrorWords, HipRouting, InputBuffer, SendStream, _weights_ptr, base_args, collective_reset, make_combine, make_combine_send, mask_views, receive_views, split_launches
from mori_jit.ops.ep.backends.hip.internode.cfg import EP_NET_ARGS, EP_NET_REGIONS, NetMaxRecv, net_region_bytes
from mori_jit.ops.ep.backends.hip.internode.specs import net_spec
from mori_jit.ops.ep.backends.hip.internode.variants import NetVariants, mask_refusal
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, DISPATCH
from mori_jit.ops.ep.backends.hip.common.consts import EpPhase, ErrCode
from mori_jit.ops.ep.backends.hip.common.wait_errors import waited_for
from mori_jit.ops.ep.core.op import KernelSet
from mori_jit.ops.ep.errors import EpDeviceError

__all__ = ["build_net_kernels", "net_regions", "decode_net_error", "NET_WAIT_MESSAGES", "NET_SYNC_REGIONS"]

#: Counters, signals, epoch tags and error claims: zeroed by reset().
NET_SYNC_REGIONS = ("recv_cnt", "total_recv", "signals", "comb_short", "sync", "relay_meta", "relay_out_cnt",
                    "masked_pairs")  # (not rank_mask: the mask outlives a reset, which runs among the survivors)


def build_net_kernels(cfg: EpDispatchCombineConfig, arena: SymmArena, var: NetVariants, toolchain,
                      device: torch.device, op_mask: Callable) -> KernelSet:
    """Compile and load both legs of every bucket of ``var`` and return the op's KernelSet;
    ``op_mask()`` is the op's ``core.mask.RankMask`` (made after this returns; the KernelSet's
    ``rank_mask`` is the device tensor it writes)."""
    requests = var.requests()
    build_many(requests, toolchain)  # misses compile in parallel; loading stays on this thread
    plans = {(spec.name, c): prepare(spec, c, toolchain, device) for spec, c in requests}

    err = ErrorWords()
    err_words = err.words
    base = base_args(EP_NET_ARGS, cfg.rank, err, arena.offsets, EP_NET_REGIONS)
    base.base = arena.tensor.data_ptr()
    dargs, cargs = EP_NET_ARGS.ctype.from_buffer_copy(base), EP_NET_ARGS.ctype.from_buffer_copy(base)

    def bound(family, leg, c, args):  # one kernel per (bucket, leg), launched with its leg's struct
        return plans[(net_spec(family, leg).name, c)].bind_struct(args)

    disp_launches = [bound(f, DISPATCH, d, dargs) for f, d in zip(var.families, var.dispatch)]
    comb_launches = [bound(f, COMBINE, c, cargs) for f, c in zip(var.families, var.combine)]

    cap, hidden, k = NetMaxRecv(var.dispatch[0]), cfg.hidden_dim, cfg.num_experts_per_token
    out, out_w, out_idx, recv_src, total_recv = receive_views(arena, cfg, cap)  # (ids: int32, no MoE options)
    given = arena.tensor.data_ptr()  # (see common.host._weights_ptr)

    def fill_dispatch(x, weights, indices):  # dargs for a dispatch of x; its outputs
        dargs.inpTok = x.data_ptr()
        dargs.inpWeights = _weights_ptr(weights, given)
        dargs.inpIndices = indices.data_ptr()
        dargs.numTokens = x.shape[0]
        return (out, out_w if weights is not None else None, None, out_idx, total_recv,
                HipRouting(x.shape[0], recv_src, total_recv))

    def dispatch(v, x, weights, scales, indices):
        res = fill_dispatch(x, weights, indices)
        disp_launches[v]()
        return res

    halves = split_launches(var.half, lambda leg, v, c: bound(var.families[v], leg, c,
                                                              dargs if leg == DISPATCH else cargs))

    stream = SendStream(device)  # (both legs' sends: one leg is in flight at a time)

    def dispatch_send(v, x, weights, scales, indices, routing):  # (no replay here: routing is None)
        res = fill_dispatch(x, weights, indices)
        stream.send(halves[DISPATCH, EpPhase.Send][v], (x, weights, indices))

        def receive():
            stream.join()
            halves[DISPATCH, EpPhase.Recv][v]()

        return res, receive

    new_outputs = CombineOutputs(cfg.combine_dtype, hidden, k, device)

    combine = make_combine(cargs, comb_launches, new_outputs, given)
    combine_send = make_combine_send(cargs, halves[COMBINE, EpPhase.Send], halves[COMBINE, EpPhase.Recv],
                                     new_outputs, given, stream)
    inp_buffer = InputBuffer(cap, hidden, cfg.combine_dtype, device)  # (plain memory: the combine stages what it puts)

    def check():
        if err_words[0]:
            peer = waited_for(err_words[1]) if err_words[0] == ErrCode.kErrTimeout else None
            op_mask().saw_timeout(peer)  # (MORI_EP_MASK_ON_TIMEOUT; core/mask.py)
            raise EpDeviceError(decode_net_error(list(err_words)) + "; call op.reset() (collective)", peer=peer)

    def clear():
        arena.zero(*NET_SYNC_REGIONS)
        err.tensor.zero_()

    def close():
        torch.cuda.synchronize(device)
        err.release()
        inp_buffer.release()

    refusal = mask_refusal(cfg, var.families)
    masking = {} if refusal else mask_views(arena, cfg.world_size)
    return KernelSet(dispatch=dispatch, combine=combine, schedule=var.schedule,
                     capabilities=frozenset({"graph", "zero_copy_combine", "internode"}),
                     check=check, reset=lambda: collective_reset(device, op_mask().collective(), clear),
                     combine_input_buffer=inp_buffer.get, close=close,
                     bound_launches={DISPATCH: tuple(disp_launches), COMBINE: tuple(comb_launches)},
                     dispatch_send=dispatch_send if var.split else None,
                     combine_send=combine_send if var.split else None, mask_refusal=refusal, **masking)


def net_regions(var: NetVariants) -> dict[str, int]:
    """Region sizes of the internode arena for ``var`` (every bucket shares one shape)."""
    return net_region_bytes(var.dispatch[0], var.combine[0], var.families)
