"""The ``hip`` backend's internode kernel set: the ``v2_ll`` and ``v2`` passes on an NVSHMEM arena.

Each leg is one :class:`~mori_jit.jit.plan.LaunchGroup` per bucket (its family's passes of that
leg, ``internode_cfg.FAMILY_PASSES``) over one args struct per leg, rewritten per call: no
compile, no host sync, so a whole step can be captured in a CUDA graph.
Device errors (timed-out waits, a short combine input) land in host-mapped words that the next
call reads without syncing. Outputs and the routing are the intranode op's (same contract).
"""
from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from mori_jit.jit.compile import build_many
from mori_jit.jit.plan import LaunchGroup, prepare

from . import knobs
from .arena import SymmArena
from .backend_hip import CombineOutputs, HipRouting, _weights_ptr
from .config import EpDispatchCombineConfig
from .internode_cfg import EP_NET_ARGS, EP_NET_REGIONS, FAMILY_PASSES, ErrCode, NetMaxRecv, NetWaitId, net_region_bytes
from .internode_spec import net_spec
from .internode_variants import NetVariants
from .op import EpDeviceError, KernelSet

__all__ = ["build_net_kernels", "net_regions", "decode_net_error", "NET_WAIT_MESSAGES", "NET_SYNC_REGIONS"]

#: What each spin-wait of the internode kernels waits for (every NetWaitId has one; a CPU test checks).
NET_WAIT_MESSAGES = {
    NetWaitId.kNetWaitPeerCombine: "dispatch: waiting for a peer to finish reading its previous combine input",
    NetWaitId.kNetWaitPeerSlots: "dispatch: waiting for a peer to free its receive slots after its previous dispatch",
    NetWaitId.kNetWaitDispatchDone: "dispatch: waiting for a peer's rows (its dispatch-done signal)",
    NetWaitId.kNetWaitCombineDone: "combine: waiting for a peer's rows (its combine-done signal)",
    NetWaitId.kNetWaitRelayFree: "dispatch: waiting for a forwarder to free its relay rows after its previous dispatch",
    NetWaitId.kNetWaitForwardDone: "dispatch: waiting for a forwarder of this node (its forward-done signal)",
    NetWaitId.kNetWaitCombineForwardDone: "combine: waiting for a forwarder's partial sums (its forward-done signal)",
}
#: Counters, signals, epoch tags and error claims: zeroed by reset().
NET_SYNC_REGIONS = ("recv_cnt", "total_recv", "signals", "comb_short", "sync", "relay_meta", "relay_out_cnt")


def decode_net_error(words: list[int]) -> str:
    """A readable message for the internode kernels' error words (code, detail, extra)."""
    code, detail, extra = words[0], words[1], words[2]
    if code == ErrCode.kErrTimeout:
        wait, peer, who = detail >> 48, (detail >> 32) & 0xFFFF, (detail >> 16) & 0xFFFF
        return (f"rank {who}: {NET_WAIT_MESSAGES.get(wait, f'wait {wait}')} from rank {peer} timed out after "
                f"MORI_EP_TIMEOUT_S (signal never reached {extra}); a peer skipped or is stuck in a collective")
    if code == ErrCode.kErrShortInput:
        return (f"rank {(detail >> 16) & 0xFFFF}: combine input had {extra & 0xFFFFFFFF} rows but dispatch "
                f"received {extra >> 32}; the missing rows were not combined (their home ranks report it)")
    if code == ErrCode.kErrPeerShortInput:
        who, peer = (detail >> 16) & 0xFFFF, detail >> 32
        return (f"rank {who}: rank {peer}'s combine input was short (that rank reports its row counts), so "
                f"tokens of rank {who} were summed without some of rank {peer}'s rows: this combine's output on "
                f"rank {who} is wrong")
    return f"unknown device error code {code:#x} (detail {detail:#x})"


def build_net_kernels(cfg: EpDispatchCombineConfig, arena: SymmArena, var: NetVariants, toolchain,
                      device: torch.device, group) -> KernelSet:
    """Compile and load every pass of every bucket of ``var`` and return the op's KernelSet."""
    requests = var.requests()
    build_many(requests, toolchain)  # misses compile in parallel; loading stays on this thread
    plans = {(spec.name, c): prepare(spec, c, toolchain, device) for spec, c in requests}

    def group_of(family, leg, cfgs):  # one LaunchGroup per (bucket, leg): its passes in order
        return LaunchGroup(plans[(net_spec(family, p).name, c)] for p, c in zip(FAMILY_PASSES[family][leg], cfgs))

    disp_groups = [group_of(f, 0, d) for f, d in zip(var.families, var.dispatch)]
    comb_groups = [group_of(f, 1, c) for f, c in zip(var.families, var.combine)]

    err = torch.zeros(4, dtype=torch.int64, pin_memory=True)  # host-mapped: read without a sync
    err_words = (ctypes.c_uint64 * 4).from_address(err.data_ptr())
    base = EP_NET_ARGS.ctype()
    base.rank = cfg.rank
    base.timeoutNs = int(knobs.ep.timeout_s * 1e9)
    base.errWord = err.data_ptr()
    base.base = arena.tensor.data_ptr()
    for name in EP_NET_REGIONS:
        setattr(base, f"off_{name}", arena.offsets[name])
    dargs, cargs = EP_NET_ARGS.ctype.from_buffer_copy(base), EP_NET_ARGS.ctype.from_buffer_copy(base)

    cap, hidden, k = NetMaxRecv(var.dispatch[0][0]), cfg.hidden_dim, cfg.num_experts_per_token
    out = arena.view("disp_out", cfg.dispatch_dtype, (cap, hidden))
    out_w = arena.view("out_wts", torch.float32, (cap, k))
    out_idx = arena.view("out_idx", torch.int32, (cap, k))
    recv_src = arena.view("recv_to_src", torch.int32, (cap,))
    total_recv = arena.view("total_recv", torch.int32, (1,))
    given = arena.tensor.data_ptr()  # (see backend_hip._weights_ptr)
    inp_buffer = None

    def dispatch(v, x, weights, scales, indices):
        dargs.inpTok = x.data_ptr()
        dargs.inpWeights = _weights_ptr(weights, given)
        dargs.inpIndices = indices.data_ptr()
        dargs.numTokens = x.shape[0]
        disp_groups[v].launch_struct(dargs)
        return (out, out_w if weights is not None else None, None, out_idx, total_recv,
                HipRouting(x.shape[0], recv_src, total_recv))

    new_outputs = CombineOutputs(cfg.combine_dtype, hidden, k, device)

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
        comb_groups[v].launch_struct(cargs)
        return y, y_w

    def combine_input_buffer():
        nonlocal inp_buffer
        if inp_buffer is None:  # plain memory: the combine stages what it puts
            inp_buffer = torch.empty((cap, hidden), dtype=cfg.combine_dtype, device=device)
        return inp_buffer

    def check():
        if err_words[0]:
            raise EpDeviceError(decode_net_error(list(err_words)) + "; call op.reset() (collective)")

    def reset():
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        arena.zero(*NET_SYNC_REGIONS)
        err.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def close():
        nonlocal err, inp_buffer
        torch.cuda.synchronize(device)
        err, inp_buffer = torch.empty(0), None

    return KernelSet(dispatch=dispatch, combine=combine, schedule=var.schedule,
                     capabilities=frozenset({"graph", "zero_copy_combine", "internode"}),
                     check=check, reset=reset, combine_input_buffer=combine_input_buffer, close=close,
                     bound_launches={})


def net_regions(var: NetVariants) -> dict[str, int]:
    """Region sizes of the internode arena for ``var`` (every bucket shares one shape)."""
    return net_region_bytes(var.dispatch[0][0], var.combine[0][0], var.families)
