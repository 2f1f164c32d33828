"""Internode EP kernels: their config (``EpNetCfg``), shared arithmetic, args struct and arena regions.

The one declaration of each: ``kernels/ep/ep_net_generated.hpp`` is generated from this module, and
:func:`make_net_cfg` is the one place that turns a request into an EpNetCfg. The internode kernels
reach peers through the SHMEM engine (``kernels/transport/``), so their arena is the engine's
symmetric memory and addresses are this rank's (the engine maps them to a peer's); region offsets
and the rank are runtime arguments, never Cfg fields (docs/design.md §11).

Each family has one kernel per leg (:data:`LEGS`; its own spec, entry name and key), launched
with one host call: ``v2_ll`` sends then receives, ``v2`` sends, forwards inside the node, then
receives, as phases of that one kernel. The split legs (``phase``, as the intranode EpCfg's) cut
it in two: a send kernel (the send phase) and a receive kernel (``v2``: forward and receive). A phase waits for the earlier phases of its own rank's
blocks through the same signals it waits on for its peers, so a leg's grid must be resident as a
whole: it never exceeds the rank's share of the SMs (``common.grid``), as for the intranode kernels.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mori_jit.jit.args import ArgsSchema, u64
from mori_jit.jit.codegen import GeneratedHeader, register_header
from mori_jit.jit.expr import C, Derived, max_
from mori_jit.jit.fields import CConst, ConfigError, apply_request
from mori_jit.jit.toolchain import vendor_of, wave_size_for_arch

from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE_QUANT_RULE, ELEM_BYTES, MASK_REGIONS, MAX_RECV, SUMMABLE, all_of, leg_io_args, mask_region_bytes, rule_problems, wire_bytes
from mori_jit.ops.ep.contract import ROW_ALIGN
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, DISPATCH
from mori_jit.ops.ep.backends.hip.common.consts import EpCombineQuant, EpDType, EpPhase, ErrCode, FlagUnit

__all__ = ["EpNetCfg", "NetWaitId", "NetSignal", "EP_NET_ARGS", "EP_NET_REGIONS", "EP_NET_MAX_RANKS", "LEGS",
           "TRANSPORTS", "make_net_cfg", "net_region_bytes", "net_cfg_problems",
           "NetTokenBytes", "NetWireBytes", "NetBlockThreads", "NetMaxRecv", "NetNumExperts", "NetIsValid",
           "EpCombineQuant"]

#: Most ranks an internode op spans (the signal rows are one word per rank).
EP_NET_MAX_RANKS = 1024
#: The legs; each family has one kernel per leg.
LEGS = (DISPATCH, COMBINE)
#: The transport header (``kernels/transport/<name>.hpp``) of each vendor that has one.
TRANSPORTS = {"nvidia": "nvshmem"}


class NetWaitId(CConst):
    """Which spin-wait of the internode kernels timed out (the high bits of the error detail word)."""

    kNetWaitPeerCombine = 11  # dispatch send: a peer has not finished reading its previous combine input
    kNetWaitPeerSlots = 12  # dispatch send: a peer has not reset its receive slots after its previous dispatch
    kNetWaitDispatchDone = 13  # dispatch receive (v2: forward): a peer's dispatch send has not signalled done
    kNetWaitCombineDone = 14  # combine receive (v2: forward): a peer's combine send has not signalled done
    kNetWaitRelayFree = 15  # v2 dispatch send: a forwarder has not forwarded its previous relay rows
    kNetWaitForwardDone = 16  # v2 dispatch receive: a forwarder of this node has not signalled done
    kNetWaitCombineForwardDone = 17  # v2 combine receive: a forwarder has not sent its node's partial sums


class NetSignal(CConst):
    """Rows of the `signals` region: one u64 word per writing rank in each row."""

    kSigDispDone = 0  # a source's dispatch send is done (FlagUnit.kDoneUnit per epoch, shared by its blocks)
    kSigSlotsFree = 1  # a destination reset its receive slot counter (1 per dispatch)
    kSigCombDone = 2  # a rank's combine send is done (FlagUnit.kDoneUnit per epoch): its input is read
    kSigRelayFree = 3  # v2: a forwarder has forwarded its relay rows (kDoneUnit per epoch)
    kSigFwdDone = 4  # v2: a forwarder's rows are written on its node (kDoneUnit per epoch)
    kSigCombFwdDone = 5  # v2: a forwarder's partial sums are written on the sources (kDoneUnit per epoch)


@dataclasses.dataclass(frozen=True)
class EpNetCfg:
    """One leg of an internode EP kernel family. Geometry is in here, so in the key."""

    worldSize: int = 16
    gpuPerNode: int = 8
    hiddenDim: int = 7168
    maxTokPerRank: int = 128
    numExpertPerRank: int = 8
    numExpertPerToken: int = 8
    maxRecv: int = 0  # 0 = worldSize * maxTokPerRank
    dtype: EpDType = EpDType.Bf16
    blockNum: int = 32
    warpPerBlock: int = 8
    waveSize: int = 32
    # the whole leg, or its send or its receive kernel (the split legs; a v2 receive also forwards)
    phase: EpPhase = EpPhase.Whole
    # combine: the wire's cast (the op's quant_type, EpCombineQuant): the rank holding a row casts it
    # to e4m3 (with its block scales) as it sends it, and the home rank sums the decoded values in
    # top-k slot order, as quant.py does, bit for bit. v2's forwarders pass the rows on as they are
    # (no partial sum: it would round the node's terms into one and change the result). Plain moves
    # the rows as they are.
    combineQuant: EpCombineQuant = EpCombineQuant.Plain
    # combine, Fp8Block: the scale rule's bytes, 4 (float32) or 1 (UE8M0: a power of two); either
    # travels as one 32-bit word per block
    combineScaleBytes: int = 4

    def __post_init__(self):
        if not NetIsValid(self):
            raise ConfigError(f"invalid EpNetCfg: {'; '.join(net_cfg_problems(self))}")


NetElemBytes = Derived("NetElemBytes", "EpNetCfg", ELEM_BYTES, doc="bytes per payload element")
NetTokenBytes = Derived("NetTokenBytes", "EpNetCfg", C.hiddenDim * NetElemBytes, doc="bytes per token row")
NetWireBytes = Derived("NetWireBytes", "EpNetCfg", wire_bytes(NetTokenBytes),
                       doc="bytes of a combine row on the wire (comb_recv's, comb_stage's and comb_relay's row)")
NetBlockThreads = Derived("NetBlockThreads", "EpNetCfg", C.warpPerBlock * C.waveSize, doc="threads per block")
NetMaxRecv = Derived("NetMaxRecv", "EpNetCfg", MAX_RECV, doc="receive capacity in rows")
NetNumExperts = Derived("NetNumExperts", "EpNetCfg", C.numExpertPerRank * C.worldSize, doc="experts in total")
NetSummable = Derived("NetSummable", "EpNetCfg", SUMMABLE, ctype="bool", doc="the dtype can be reduced (combine)")

_RULES: list[tuple[Any, str]] = [
    (C.worldSize >= 2, "worldSize must be >= 2 (internode)"),
    (C.worldSize <= EP_NET_MAX_RANKS, f"worldSize must be <= {EP_NET_MAX_RANKS}"),
    (C.gpuPerNode >= 1, "gpuPerNode must be >= 1"),
    (C.gpuPerNode <= 32, "gpuPerNode must be <= 32 (a node's ranks are a 32-bit mask)"),
    ((C.worldSize % max_(C.gpuPerNode, 1)).eq(0), "worldSize must be a multiple of gpuPerNode (every node holds as many ranks)"),
    (C.hiddenDim >= 1, "hiddenDim must be >= 1"),
    ((NetTokenBytes % ROW_ALIGN).eq(0), f"token bytes (hiddenDim * element bytes) must be a multiple of {ROW_ALIGN}"),
    (C.maxTokPerRank >= 1, "maxTokPerRank must be >= 1"),
    (C.numExpertPerRank >= 1, "numExpertPerRank must be >= 1"),
    (C.numExpertPerToken >= 1, "numExpertPerToken must be >= 1"),
    (C.numExpertPerToken <= C.waveSize, "numExpertPerToken (topk) must fit in one warp"),
    (C.maxRecv.eq(0) | (C.maxRecv >= C.worldSize * C.maxTokPerRank),
     "maxRecv must be 0 or cover the worst case worldSize*maxTokPerRank"),
    (C.waveSize.eq(32), "waveSize must be 32 (the NVIDIA transport)"),
    (C.blockNum >= 1, "blockNum must be >= 1"),
    (C.blockNum < int(FlagUnit.kDoneUnit), f"blockNum must be < {int(FlagUnit.kDoneUnit)} (a done count's unit)"),
    (C.warpPerBlock >= 1, "warpPerBlock must be >= 1"),
    (NetBlockThreads <= 1024, "warpPerBlock*waveSize must be <= 1024"),
    COMBINE_QUANT_RULE,
]


NetIsValid = Derived("NetIsValid", "EpNetCfg", all_of(_RULES), ctype="bool",
                     doc="the internode kernels can be built and are correct for this config")


def net_cfg_problems(cfg: EpNetCfg) -> list[str]:
    """Every violated rule, with the offending values."""
    return rule_problems(cfg, _RULES)


#: Internode arena regions (name → doc), in layout order. Offsets are runtime args ``off_<name>``.
EP_NET_REGIONS: dict[str, str] = {
    "disp_out": "received token rows [maxRecv, tokenBytes] (written by peers)",
    "out_wts": "received weights [maxRecv, k] f32 (written by peers)",
    "out_idx": "received expert ids [maxRecv, k] i32 (written by peers)",
    "recv_to_src": "reverse map [maxRecv] i32: srcRank*M + srcTok (written by peers)",
    "recv_cnt": "receive slot counter [1] i32 (peers claim slots with a remote fetch-add; reset by the dispatch)",
    "total_recv": "rows received by the last dispatch [1] i32 (local)",
    "tok_dest": "each token's distinct destination ranks [M, k] i32, -1 for none (local: combine reads it)",
    "disp_stage": "token rows staged for puts [M, tokenBytes] (local: a put's source is symmetric)",
    "disp_stage_meta": "weights and ids staged for puts [M, 2k] i32 (local)",
    "comb_recv": "combine rows by sender [worldSize, M, wireBytes] (v2 without a wire cast: partial sums by node "
                 "[nodes, M, combTokenBytes]; written by peers)",
    "comb_recv_wts": "combine weights by sender [worldSize, M, k] f32 (v2 without a wire cast: by node; written "
                     "by peers)",
    "comb_stage": "combine rows staged for puts [maxRecv, wireBytes] (local)",
    "comb_stage_wts": "combine weights staged for puts [maxRecv, k] f32 (local)",
    "signals": "done and free signals [NetSignal rows, worldSize] u64, by writing rank (written by peers)",
    "comb_short": "combine epoch of a sender's short input that dropped rows of this rank's tokens [worldSize] i32 "
                  "(written by peers)",
    "sync": "local words [4] u64: word 0 the error-report claim",
    # v2 only (empty otherwise); relay index j = source node * M + relay slot
    "relay": "v2: rows to forward [nodes, M, tokenBytes] (written by the sources of this local index)",
    "relay_meta": "v2: their metadata [nodes, M, 2k+3] i32: weights, ids, source, node mask, epoch (written by sources)",
    "relay_stage_meta": "v2: metadata staged for puts [M, nodes, 2k+3] i32 (local)",
    "relay_out_cnt": "v2: relay slots claimed per destination node [nodes] i32 (local; reset by the dispatch)",
    "recv_relay": "v2: relay index of each received row [maxRecv] i32 (written by this node's forwarders)",
    "comb_relay": "v2: combine rows to sum (fp8 wire: to forward) [nodes * M, gpuPerNode, wireBytes] (written by "
                  "this node's ranks)",
    "comb_relay_wts": "v2: their weights [nodes * M, gpuPerNode, k] f32 (written by this node's ranks)",
    **MASK_REGIONS,  # (v2_ll reads them; an op that builds v2 refuses masking: docs/design.md §6)
}

EP_NET_ARGS = ArgsSchema("EpNetArgs", [
    *leg_io_args("dispatch: expert ids [n, k]", "this rank (the engine's PE)"),
    u64("base", doc="this rank's address of the arena (a symmetric address)"),
    *[u64(f"off_{name}", doc=doc) for name, doc in EP_NET_REGIONS.items()],
])

register_header(GeneratedHeader(
    "ep/ep_net_generated.hpp", "mori::epnet", enums=[EpDType, EpPhase, EpCombineQuant],
    consts=[NetWaitId, NetSignal, ErrCode, FlagUnit], cfgs=[EpNetCfg],
    derived=[NetElemBytes, NetTokenBytes, NetWireBytes, NetBlockThreads, NetMaxRecv, NetNumExperts, NetSummable, NetIsValid],
    args=[EP_NET_ARGS]))


def net_region_bytes(disp: EpNetCfg, comb: EpNetCfg, families=("v2_ll",)) -> dict[str, int]:
    """Bytes of each region for a dispatch of ``disp`` and a combine of ``comb`` (one
    shape) of an op that builds ``families`` (the ``v2`` regions are empty without ``v2``)."""
    recv, k, m, ws = NetMaxRecv(disp), disp.numExpertPerToken, disp.maxTokPerRank, disp.worldSize
    tok, ctok = NetTokenBytes(disp), NetWireBytes(comb)
    nodes, v2 = ws // disp.gpuPerNode, int("v2" in families)
    meta = (2 * k + 3) * 4
    return {
        "disp_out": recv * tok, "out_wts": recv * k * 4, "out_idx": recv * k * 4, "recv_to_src": recv * 4,
        "recv_cnt": 4, "total_recv": 4, "tok_dest": m * k * 4, "disp_stage": m * tok, "disp_stage_meta": m * 2 * k * 4,
        "comb_recv": ws * m * ctok, "comb_recv_wts": ws * m * k * 4, "comb_stage": recv * ctok,
        "comb_stage_wts": recv * k * 4, "signals": len(NetSignal) * ws * 8, "comb_short": ws * 4, "sync": 4 * 8,
        "relay": v2 * nodes * m * tok, "relay_meta": v2 * nodes * m * meta, "relay_stage_meta": v2 * m * nodes * meta,
        "relay_out_cnt": v2 * nodes * 4, "recv_relay": v2 * recv * 4, "comb_relay": v2 * ws * m * ctok,
        "comb_relay_wts": v2 * ws * m * k * 4, **mask_region_bytes(ws),
    }


def make_net_cfg(leg: str, arch: str, request: Mapping[str, Any]) -> EpNetCfg:
    """The EpNetCfg of ``leg`` (one of :data:`LEGS`) on ``arch`` with ``request`` applied. The
    combine refuses byte dtypes (they can be moved, not summed)."""
    if leg not in LEGS:
        raise ValueError(f"internode leg must be one of {LEGS}, got {leg!r}")
    if vendor_of(arch) not in TRANSPORTS:
        raise ConfigError(f"internode kernels on {arch}: no SHMEM transport for {arch} ({vendor_of(arch)}); they run "
                          f"on NVSHMEM (NVIDIA) only")
    cfg = apply_request(EpNetCfg(), {**request, "waveSize": wave_size_for_arch(arch)})
    if leg == COMBINE and not NetSummable(cfg):
        raise ConfigError(f"combine dtype {cfg.dtype.name} cannot be summed; combine supports Bf16 and Fp32")
    return cfg
