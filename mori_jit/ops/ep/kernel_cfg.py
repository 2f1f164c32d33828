"""EP kernel config (``EpCfg``), its shared arithmetic, the args struct and the arena regions.

This module is the one declaration of each: the C++ header ``kernels/ep/ep_generated.hpp`` is
generated from it, and :func:`make_ep_cfg` is the one place that turns a request into an EpCfg
(arch defaults, then the request, then ``MORI_V2_EP_*`` overrides).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mori_jit.jit.args import ArgsSchema, i32, i64, ptr, u64
from mori_jit.jit.codegen import GeneratedHeader, register_header
from mori_jit.jit.expr import C, Derived, where
from mori_jit.jit.fields import CConst, CEnum, ConfigError, apply_request, cfg_fields
from mori_jit.jit.toolchain import has_bulk_copy, wave_size_for_arch

from . import knobs
from .contract import ROW_ALIGN
from .tuning import DEFAULT_COMBINE, DEFAULT_DISPATCH

__all__ = ["EpDType", "CombWord", "WaitId", "ErrCode", "XdbRow", "FlagUnit", "Stamp", "EP_STAMP_WORDS", "EpCfg", "EP_ARGS",
           "EP_REGIONS", "EP_MAX_PEERS", "EP_ROW_ALIGN", "EP_MAX_BLOCK_THREADS", "EP_MAX_BULK_SMEM", "EP_MAX_COUNTED_EXPERTS", "make_ep_cfg", "region_bytes",
           "EpElemBytes", "EpTokenBytes", "EpBlockThreads", "EpMaxRecv", "EpNumExperts", "EpIsValid", "EpRangeTok",
           "EpBulkStages", "EpBulkSmemBytes", "EpSummable", "DISPATCH", "COMBINE", "LAYOUT",
           "EXPERT_SUM"]

#: Most ranks one intranode op spans (the size of the peer-pointer array in the args).
EP_MAX_PEERS = 8
#: Bytes of the vectors the kernels move rows in: a token row is whole vectors (every backend
#: refuses other hidden sizes, see config.py, so that one config is valid for all).
EP_ROW_ALIGN = ROW_ALIGN
#: Most threads in one block, on every supported arch.
EP_MAX_BLOCK_THREADS = 1024
#: Most dynamic shared memory for a dispatch block's bulk-copy stages: sm_90's 227 KiB per block
#: less the static routing arrays (DispatchRound, at most 24 KiB) and the claim's words.
EP_MAX_BULK_SMEM = 192 * 1024
#: Most experts in all (numExpertPerRank * worldSize) a dispatch with expertCounts tallies in one
#: block's shared memory (8 KiB).
EP_MAX_COUNTED_EXPERTS = 2048
DISPATCH, COMBINE = "dispatch", "combine"
#: The expert-major layout kernel (launched after a dispatch, on the dispatch's EpCfg) and the
#: expert-major combine's local sum (launched before a float32 combine, on the combine's EpCfg).
LAYOUT, EXPERT_SUM = "layout", "expert_sum"


class EpDType(CEnum):
    """Payload type of one leg. Fp8 and Fp4x2 are moved as bytes (one byte per element; for Fp4x2
    ``hiddenDim`` counts bytes, i.e. pairs of e2m1), never summed."""

    Bf16 = 0
    Fp32 = 1
    Fp8 = 2
    Fp4x2 = 3

    @classmethod
    def _coerce_other(cls, value):
        name = str(value).replace("torch.", "")
        return {"bfloat16": cls.Bf16, "float32": cls.Fp32, "float8_e4m3fn": cls.Fp8,
                "float8_e4m3fnuz": cls.Fp8, "float4_e2m1fn_x2": cls.Fp4x2, "uint8": cls.Fp4x2}.get(name)


class _U64Const(CConst):
    """Codes that kernels combine with 64-bit error words (underlying type uint64_t)."""

    @classmethod
    def ctype(cls) -> str:
        """The C++ underlying type of the generated enum."""
        return "uint64_t"


class _U32Const(CConst):
    """Words that kernels compare with 32-bit data words (underlying type uint32_t)."""

    @classmethod
    def ctype(cls) -> str:
        """The C++ underlying type of the generated enum."""
        return "uint32_t"


class CombWord(_U32Const):
    """The 32-bit words of the low-latency combine's rows (`comb_recv`) that are not data.

    There, each word of a pushed row is its own arrival signal (no fence, no range flag). A word
    the home rank has summed is set back to kEmptyWord (the host fills the region with 0xFF bytes);
    a row the sender had no input for (a short input) arrives as kShortWord words. A data word equal
    to either (a NaN, of a bf16 pair or an fp32) is sent as kCanonWord, another NaN, so the home
    rank never mistakes data for them."""

    kEmptyWord = 0xFFFFFFFF
    kShortWord = 0xFFFFFFFE
    kCanonWord = 0xFFFFFFFD


class WaitId(_U64Const):
    """Which spin-wait timed out (the high bits of the error detail word)."""

    kWaitDispatchDone = 1
    kWaitCombineDone = 2
    kWaitCombineRange = 3
    kWaitCombineRows = 4


class ErrCode(_U64Const):
    """Device error codes (word 0 of the host-mapped error words; 0 = no error)."""

    kErrTimeout = 0x4D4F5249  # "MORI": a spin-wait gave up after the timeout
    kErrShortInput = 0x53484F52  # "SHOR": the combine input has fewer rows than were received
    kErrPeerShortInput = 0x50534852  # "PSHR": a peer's short combine input left some of our tokens without its rows
    kErrCapacity = 0x43415041  # "CAPA": a local expert received more pairs than the expert-major layout holds


class XdbRow(CConst):
    """Rows of the cross-device `xdb` region, each indexed by the writing rank."""

    kXdbDispatch = 0  # dispatch done (a count: FlagUnit.kDoneUnit per epoch)
    kXdbCombine = 1  # combine done reading (a count: FlagUnit.kDoneUnit per epoch)
    kXdbNumTok = 2  # token count of the writer's last dispatch


class SyncWord(CConst):
    """Words of the local `sync` region (u64, kernel-only; a claim counter is two, by epoch parity).

    A combine resets the other parity's claim counters at its start (the last combine that used
    them is done, by stream order), so no block has to wait for the others to reset them."""

    kDispEpoch = 0  # the last dispatch's epoch (device-side: no host sync)
    kCombSendNext = 1  # (and word 2) the combine's next send task to claim, by epoch parity
    kCombSumNext = 3  # (and word 4) the combine's next range to sum, by epoch parity
    kErrClaim = 5  # threads that failed since the last reset (RecordError; only the first reports)


#: The claim counters: two words each (the word and the next), by epoch parity.
SYNC_PAIRS = (SyncWord.kCombSendNext, SyncWord.kCombSumNext)
#: Words of the `sync` region (a pair's second word included).
EP_SYNC_WORDS = max(*SyncWord, *(w + 1 for w in SYNC_PAIRS)) + 1


class FlagUnit(_U64Const):
    """How far a done counter moves per epoch."""

    # a rank's dispatch-done and combine-done counters (on every rank, its own too: its own
    # combine-done count is its combine epoch): its blocks add this in all per epoch, whatever its
    # grid (block 0 adds kDoneUnit - (grid - 1), every other block 1), so no block waits for another
    kDoneUnit = 1 << 20


class Stamp(CConst):
    """Phase-timestamp slots of the `stamps` region (globaltimer ns of the last call)."""

    kStDispStart = 0
    kStDispLoopDone = 1
    kStDispCounted = 2  # the latest block's done count sent (atomic max)
    kStDispPeersDone = 3
    kStDispEnd = 4
    kStDispClaimed = 5
    kStCombStart = 8
    kStCombFirstRange = 9
    kStCombSent = 10  # the latest sender's finish (atomic max)
    kStCombSummed = 11  # the latest block's sums computed, before its last output stores (atomic max)
    kStCombEnd = 12  # the latest block's done counts sent (atomic max)
    kStCombFlagsSeen = 13  # the latest time a summer saw its range's flags (low latency: had its rows) (atomic max)
    kStCombFirstStore = 14  # block 0 may push (past its wait for the peers' last combine; its first rows' loads issued)


#: Words of the `stamps` region.
EP_STAMP_WORDS = 16


@dataclasses.dataclass(frozen=True)
class EpCfg:
    """One EP kernel specialization (dispatch or combine leg). Geometry is in here, so in the key."""

    worldSize: int = 8
    hiddenDim: int = 7168
    maxTokPerRank: int = 128
    numExpertPerRank: int = 8
    numExpertPerToken: int = 8
    maxRecv: int = 0  # 0 = worldSize * maxTokPerRank; also the stride of the flat index pe*maxRecv+slot
    dtype: EpDType = EpDType.Bf16
    blockNum: int = 64
    warpPerBlock: int = 16
    waveSize: int = 64
    useWeights: bool = True
    vecUnroll: int = 4  # 16-byte vectors in flight per lane (per source in combine): memory-level parallelism
    # combine: rows pushed as their own arrival signal (each 32-bit word; no fence, no range flag)
    lowLatency: bool = False
    # dispatch: a block that owns at least this many tokens moves its rows with the bulk-copy unit
    # (EpBulkStages rows in flight, one thread drives it); others, and every block at 0, copy them
    # through the waves' registers. NVIDIA sm_90 and later only.
    bulkMinTokens: int = 0
    # dispatch: expert ids (the input's and out_idx) are int64, else int32; ids outside
    # [0, numExperts) drop their slot either way, compared before any narrowing
    ids64: bool = False
    # dispatch: per-token scales forwarded with their rows (inpScales [n, scaleDim] -> out_scales),
    # elements of scaleTypeSize bytes (1, 2, 4 or 8); 0 and 0: none
    scaleDim: int = 0
    scaleTypeSize: int = 0
    # dispatch: count the received (token, local expert) pairs into expert_counts (one per valid
    # top-k slot): each block tallies its slots per expert in shared memory and adds them to the
    # destinations' parity counters (expert_adds), which block 0 publishes and resets at the end
    expertCounts: bool = False
    # dispatch: a launch with args.replay set moves a new payload along the latest dispatch's forward
    # map (tok_off) instead of claiming slots: same receive rows, ids, counts and total_recv
    routingReplay: bool = False
    # dispatch: the input is bf16 and each 128-element block is cast to e4m3 (dtype Fp8) with its
    # scale (scaleTypeSize 4: float32, 1: UE8M0) on the way, as quant.py does, bit for bit
    quantFp8Block128: bool = False
    # dispatch: > 0 lays the received (token, local expert) pairs out expert-major, expertCapacity
    # entries per expert (needs expertCounts), by the layout kernel launched after each dispatch
    expertCapacity: int = 0

    def __post_init__(self):
        if not EpIsValid(self):
            raise ConfigError(f"invalid EpCfg: {'; '.join(ep_cfg_problems(self))}")


EpElemBytes = Derived("EpElemBytes", "EpCfg", where(C.dtype.eq(EpDType.Fp32), 4,
                                                    where(C.dtype.eq(EpDType.Bf16), 2, 1)),
                      doc="bytes per payload element")
EpTokenBytes = Derived("EpTokenBytes", "EpCfg", C.hiddenDim * EpElemBytes, doc="bytes per token row")
EpBlockThreads = Derived("EpBlockThreads", "EpCfg", C.warpPerBlock * C.waveSize, doc="threads per block")
EpMaxRecv = Derived("EpMaxRecv", "EpCfg", where(C.maxRecv.eq(0), C.worldSize * C.maxTokPerRank, C.maxRecv),
                    doc="receive capacity in rows; also the stride of the flat index pe*maxRecv+slot")
EpNumExperts = Derived("EpNumExperts", "EpCfg", C.numExpertPerRank * C.worldSize, doc="experts in total")
# Tokens per combine range (see ep_combine_words.hpp): 2, or 1 for a low-latency combine whose every
# peer-token task fits in the grid, so that each block sends at most one row per peer and sums at
# most one token (measured at tuning.ONE_TOKEN_COMBINE: such an op gets every SM). The flag
# protocol needs 2 on every rank (a range flag's unit); low latency has no flags, so ranks may differ.
EpRangeTok = Derived("EpRangeTok", "EpCfg",
                     where(C.lowLatency & (C.maxTokPerRank * (C.worldSize - 1) <= C.blockNum), 1, 2),
                     doc="tokens per combine range (a sender's task, a summing block's unit)")
# 4 stages: 2 and 6 measured no better (docs/performance.md, "4 bulk stages").
EpBulkStages = Derived("EpBulkStages", "EpCfg", where(C.bulkMinTokens > 0, 4, 0),
                       doc="rows in flight per dispatch block through the bulk-copy unit (0: none)")
EpBulkSmemBytes = Derived("EpBulkSmemBytes", "EpCfg", EpBulkStages * EpTokenBytes,
                          doc="dynamic shared memory of a dispatch block: its bulk-copy stages")
EpSummable = Derived("EpSummable", "EpCfg", C.dtype.eq(EpDType.Bf16) | C.dtype.eq(EpDType.Fp32), ctype="bool",
                     doc="the dtype can be reduced (combine leg)")

# Each validity rule once, with its message; EpIsValid is their conjunction (emitted to C++ too).
_RULES: list[tuple[Any, str]] = [
    (C.worldSize >= 1, "worldSize must be >= 1"),
    (C.worldSize <= EP_MAX_PEERS, f"worldSize must be <= {EP_MAX_PEERS} (intranode)"),
    (C.worldSize <= C.waveSize, "worldSize must fit in one wavefront/warp"),
    (C.hiddenDim >= 1, "hiddenDim must be >= 1"),
    ((EpTokenBytes % EP_ROW_ALIGN).eq(0), f"token bytes (hiddenDim * element bytes) must be a multiple of {EP_ROW_ALIGN}"),
    (C.maxTokPerRank >= 1, "maxTokPerRank must be >= 1"),
    (C.numExpertPerRank >= 1, "numExpertPerRank must be >= 1"),
    (C.numExpertPerToken >= 1, "numExpertPerToken must be >= 1"),
    (C.numExpertPerToken <= C.waveSize, "numExpertPerToken (topk) must fit in one wavefront/warp"),
    (C.maxRecv.eq(0) | (C.maxRecv >= C.worldSize * C.maxTokPerRank),
     "maxRecv must be 0 or cover the worst case worldSize*maxTokPerRank"),
    (C.waveSize.eq(32) | C.waveSize.eq(64), "waveSize must be 32 or 64"),
    (C.blockNum >= 1, "blockNum must be >= 1"),
    (C.blockNum < int(FlagUnit.kDoneUnit),
     f"blockNum must be < {int(FlagUnit.kDoneUnit)} (a done counter's unit per epoch: block 0 adds it minus the other blocks' 1s)"),
    (C.warpPerBlock >= 1, "warpPerBlock must be >= 1"),
    (EpBlockThreads <= EP_MAX_BLOCK_THREADS, f"warpPerBlock*waveSize must be <= {EP_MAX_BLOCK_THREADS}"),
    ((C.vecUnroll >= 1) & (C.vecUnroll <= 8), "vecUnroll must be in 1..8"),
    (C.bulkMinTokens >= 0, "bulkMinTokens must be >= 0"),
    ((C.scaleDim.eq(0) & C.scaleTypeSize.eq(0)) | ((C.scaleDim >= 1) & (C.scaleTypeSize.eq(1) | C.scaleTypeSize.eq(2)
                                                                       | C.scaleTypeSize.eq(4) | C.scaleTypeSize.eq(8))),
     "scaleDim and scaleTypeSize must be both 0 (no scales) or scaleDim >= 1 with scaleTypeSize 1, 2, 4 or 8"),
    (~C.quantFp8Block128 | (C.dtype.eq(EpDType.Fp8) & (C.hiddenDim % 128).eq(0) & C.scaleDim.eq(C.hiddenDim / 128)
                             & (C.scaleTypeSize.eq(4) | C.scaleTypeSize.eq(1)) & C.bulkMinTokens.eq(0)),
     "quantFp8Block128 needs dtype Fp8, hiddenDim a multiple of 128, scaleDim = hiddenDim / 128, scaleTypeSize 4 "
     "or 1, and bulkMinTokens 0 (the rows are cast in registers)"),
    (C.expertCapacity.eq(0) | ((C.expertCapacity >= 1) & C.expertCounts),
     "expertCapacity must be 0 (no expert-major layout) or >= 1 with expertCounts"),
    (~C.expertCounts | (EpNumExperts <= EP_MAX_COUNTED_EXPERTS),
     f"expertCounts needs numExpertPerRank*worldSize <= {EP_MAX_COUNTED_EXPERTS} (a block tallies every expert in "
     f"shared memory)"),
    (EpBulkSmemBytes <= EP_MAX_BULK_SMEM, f"bulk-copy stages (EpBulkStages * token bytes) must fit in "
                                          f"{EP_MAX_BULK_SMEM} bytes of shared memory"),
]


def _all(exprs):
    out = exprs[0]
    for e in exprs[1:]:
        out = out & e
    return out


EpIsValid = Derived("EpIsValid", "EpCfg", _all([r for r, _ in _RULES]), ctype="bool",
                    doc="the kernels can be built and are correct for this config")


def ep_cfg_problems(cfg: EpCfg) -> list[str]:
    """Every violated rule, with the offending values."""
    vals = ", ".join(f"{f.name}={getattr(cfg, f.name)!s}" for f in cfg_fields(cfg))
    return [f"{msg} ({vals})" for expr, msg in _RULES if not expr.eval(cfg)]


#: Symmetric-arena regions (name → doc). Offsets are runtime args ``off_<name>``, never Cfg fields.
EP_REGIONS: dict[str, str] = {
    "disp_out": "received token rows [maxRecv, tokenBytes] (written by peers)",
    "out_wts": "received weights [maxRecv, k] f32 (written by peers)",
    "out_idx": "received expert ids [maxRecv, k] i32 (i64 with ids64) (written by peers)",
    "recv_to_src": "reverse map [maxRecv] i32: srcRank*M + srcTok (written by peers)",
    "tok_off": "forward map [M, k] i32: pe*maxRecv + slot, -1 for dropped/duplicate slots (local)",
    "recv_num": "slot counters [2] i32, by epoch parity (peers add atomically)",
    "total_recv": "received rows of the last dispatch [1] i32 (local)",
    "src_to_recv": "slot of each source token here [ws, M] i64: dispatch epoch << 32 | slot (written by peers)",
    "comb_recv": "combine rows pushed by peers [ws, M, combine tokenBytes], by source rank and token (written by peers); low latency: a word is kEmptyWord until written and once summed (CombWord)",
    "comb_recv_wts": "combine weights pushed by peers [ws, M, k] f32 (written by peers); low latency: u64, combine epoch << 32 | f32 bits",
    "comb_flags": "combine range-ready flags [ws, M] u64, by source rank and token range: 2*epoch, +1 if the sender's input was short (written by peers); none with low latency",
    "xdb": "cross-device words [XdbRow, EP_MAX_PEERS] u64, by writing rank: dispatch-done, combine-done, token count",
    "sync": "local sync words [SyncWord] u64: claim counters (by epoch parity), the dispatch epoch, the error-report claim",
    "stamps": "phase timestamps [EP_STAMP_WORDS] u64 (globaltimer ns, slots: Stamp) of the last call, for profiling (local)",
    "out_scales": "received per-token scales [maxRecv, scaleDim] of scaleTypeSize bytes (written by peers); none without scales",
    "expert_adds": "received (token, local expert) pairs [2, numExpertPerRank] i32, by epoch parity (peers add atomically); none without expertCounts",
    "expert_counts": "the last dispatch's received (token, local expert) pairs [numExpertPerRank] i32 (local); none without expertCounts",
    "exp_cursor": "expert-major layout: next entry per local expert [numExpertPerRank] u32 (local; the dispatch zeroes it, the layout kernel claims); none without expertCapacity",
    "exp_x": "expert-major layout: rows [numExpertPerRank, expertCapacity, tokenBytes] (local)",
    "exp_scales": "expert-major layout: scales [numExpertPerRank, expertCapacity, scaleDim * scaleTypeSize bytes] (local)",
    "exp_wts": "expert-major layout: each entry's top-k weight [numExpertPerRank, expertCapacity] f32, 0 on padding (local)",
    "exp_maps": "expert-major layout: receive row, source (srcRank*M + srcTok), top-k slot [3, numExpertPerRank, expertCapacity] i32, -1 on padding (local)",
    "exp_entry": "expert-major layout: the entry e*expertCapacity + c of each received (row, top-k slot) [maxRecv, k] i32, -1 for none (local)",
}

EP_ARGS = ArgsSchema("EpArgs", [
    ptr("inpTok", "const void", "dispatch: tokens [n, tokenBytes]; combine: expert output [>=recv, H]"),
    ptr("inpWeights", "const float", "dispatch: weights [n, k]; combine: weights [>=recv, k] or null"),
    ptr("inpIndices", "const int32_t", "dispatch: expert ids [n, k] (int64 with ids64)"),
    ptr("outTok", "void", "combine: y [n, H]"),
    ptr("outWeights", "float", "combine: y_w [n, k] or null"),
    ptr("errWord", "uint64_t", "host-mapped error words [4]: code, detail (0 = ok)"),
    i32("numTokens", doc="n of the dispatch call"),
    i32("inpRows", doc="combine: rows of the expert output (guards a short input)"),
    i32("rank", doc="this rank"),
    i64("timeoutNs", doc="spin-wait bound in ns"),
    u64("peerBase", EP_MAX_PEERS, "arena base address of every rank, by rank"),
    *[u64(f"off_{name}", doc=doc) for name, doc in EP_REGIONS.items()],
    ptr("inpScales", "const void", "dispatch: per-token scales [n, scaleDim] of scaleTypeSize bytes, or null"),
    i32("replay", doc="dispatch (routingReplay): 1 = move the payload along the latest dispatch's routing"),
])

register_header(GeneratedHeader(
    "ep/ep_generated.hpp", "mori::ep", enums=[EpDType], consts=[CombWord, WaitId, ErrCode, XdbRow, SyncWord, FlagUnit, Stamp], cfgs=[EpCfg],
    derived=[EpElemBytes, EpTokenBytes, EpBlockThreads, EpMaxRecv, EpNumExperts, EpRangeTok, EpBulkStages,
             EpBulkSmemBytes, EpSummable, EpIsValid],
    args=[EP_ARGS]))


def region_bytes(disp: EpCfg, comb: EpCfg) -> dict[str, int]:
    """Bytes of each region for a dispatch leg ``disp`` and a combine leg ``comb`` (same shape)."""
    recv, k, m, ws = EpMaxRecv(disp), disp.numExpertPerToken, disp.maxTokPerRank, disp.worldSize
    low = comb.lowLatency
    return {
        "disp_out": recv * EpTokenBytes(disp), "out_wts": recv * k * 4, "out_idx": recv * k * (8 if disp.ids64 else 4),
        "recv_to_src": recv * 4, "tok_off": m * k * 4, "recv_num": 2 * 4, "total_recv": 4,
        "src_to_recv": ws * m * 8,
        "comb_recv": ws * m * EpTokenBytes(comb), "comb_recv_wts": ws * m * k * (8 if low else 4),
        "comb_flags": 0 if low else ws * m * 8,
        "xdb": len(XdbRow) * EP_MAX_PEERS * 8, "sync": EP_SYNC_WORDS * 8, "stamps": EP_STAMP_WORDS * 8,
        "out_scales": recv * disp.scaleDim * disp.scaleTypeSize,
        "expert_adds": 2 * disp.numExpertPerRank * 4 if disp.expertCounts else 0,
        "expert_counts": disp.numExpertPerRank * 4 if disp.expertCounts else 0,
        **_layout_bytes(disp),
    }


def _layout_bytes(disp: EpCfg) -> dict[str, int]:
    """Bytes of the expert-major layout's regions (all 0 without expertCapacity)."""
    entries = disp.numExpertPerRank * disp.expertCapacity
    return {"exp_cursor": disp.numExpertPerRank * 4 if entries else 0, "exp_x": entries * EpTokenBytes(disp),
            "exp_scales": entries * disp.scaleDim * disp.scaleTypeSize, "exp_wts": entries * 4,
            "exp_maps": 3 * entries * 4, "exp_entry": EpMaxRecv(disp) * disp.numExpertPerToken * 4 if entries else 0}


def _leg_defaults(kind: str, arch: str) -> dict[str, Any]:
    # the geometry default is the tuning table's fallback: one number, one place
    # (a layout runs on the dispatch's EpCfg, an expert sum on the combine's)
    blocks, warps = DEFAULT_COMBINE if kind in (COMBINE, EXPERT_SUM) else DEFAULT_DISPATCH
    return {"waveSize": wave_size_for_arch(arch), "blockNum": blocks, "warpPerBlock": warps}


def _env_overrides(kind: str) -> dict[str, str]:
    """``MORI_V2_EP_<FIELD>`` (both legs) and ``MORI_V2_EP_<DISPATCH|COMBINE>_<FIELD>`` (one leg)."""
    by_key = {f.name.upper(): f.name for f in cfg_fields(EpCfg)}
    out: dict[str, str] = {}
    legs = (DISPATCH.upper() + "_", COMBINE.upper() + "_")
    for specific in (False, True):
        for raw, value in knobs.ep.cfg_overrides.items():
            leg = next((p for p in legs if raw.startswith(p)), None)
            if (leg is not None) != specific or (leg and leg != kind.upper() + "_"):
                continue
            name = raw[len(leg):] if leg else raw
            field = by_key.get(name.replace("_", ""))
            if field is None:
                raise ConfigError(f"MORI_V2_EP_{raw}: no EpCfg field {name!r}; valid: "
                                  f"{', '.join('MORI_V2_EP_[DISPATCH_|COMBINE_]' + k for k in by_key)}")
            out[field] = value
    return out


def make_ep_cfg(kind: str, arch: str, request: Mapping[str, Any]) -> EpCfg:
    """The EpCfg for leg ``kind`` on ``arch``: arch defaults ← ``request`` ← ``MORI_V2_EP_*`` overrides.

    The only place ``MORI_V2_EP_*`` is read; the result goes into the key like any other Cfg. The
    combine leg refuses byte dtypes (they can be moved, not summed) and bulk copies (dispatch only).
    """
    if kind not in (DISPATCH, COMBINE, LAYOUT, EXPERT_SUM):
        raise ValueError(f"kind must be one of {DISPATCH!r}, {COMBINE!r}, {LAYOUT!r}, {EXPERT_SUM!r}, got {kind!r}")
    merged = {**_leg_defaults(kind, arch), **request,
              **_env_overrides(COMBINE if kind in (COMBINE, EXPERT_SUM) else DISPATCH)}
    cfg = apply_request(EpCfg(worldSize=1, waveSize=wave_size_for_arch(arch)), merged)
    if kind in (COMBINE, EXPERT_SUM) and not EpSummable(cfg):
        raise ConfigError(f"combine dtype {cfg.dtype.name} cannot be summed; combine supports Bf16 and Fp32")
    if kind == COMBINE and cfg.bulkMinTokens:
        raise ConfigError(f"bulkMinTokens={cfg.bulkMinTokens} on the combine leg: bulk copies are a dispatch "
                          f"choice (set MORI_V2_EP_DISPATCH_BULKMINTOKENS, not MORI_V2_EP_BULKMINTOKENS)")
    if cfg.bulkMinTokens and not has_bulk_copy(arch):
        raise ConfigError(f"bulkMinTokens={cfg.bulkMinTokens} on {arch}: no bulk-copy unit there "
                          f"(NVIDIA sm_90 and later); use 0")
    return cfg
