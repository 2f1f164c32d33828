"""EP kernel config (``EpCfg``): its fields, derived arithmetic, validity rules, region sizes, and
the generated header ``kernels/ep/ep_generated.hpp`` (with the constants of ``common.consts`` and
the regions and args struct of ``intranode.args``, re-exported here). This module is the one
declaration of each, and :func:`make_ep_cfg` is the one place that turns a request into an EpCfg
(arch defaults, then the request, then ``MORI_EP_CFG_*`` overrides).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mori_jit.jit.codegen import GeneratedHeader, register_header
from mori_jit.jit.expr import C, Derived, where
from mori_jit.jit.fields import ConfigError, apply_request, cfg_fields
from mori_jit.jit.toolchain import has_bulk_copy, wave_size_for_arch

from mori_jit.ops.ep import knobs
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, COMBINE_QUANT_RULE, DISPATCH, EXPERT_SUM, LAYOUT, ELEM_BYTES, MAX_RECV, SUMMABLE, all_of, mask_region_bytes, rule_problems, wire_bytes
from mori_jit.ops.ep.contract import ROW_ALIGN
from mori_jit.ops.ep.backends.hip.intranode.args import EP_ARGS, EP_MAX_PEERS, EP_REGIONS
from mori_jit.ops.ep.backends.hip.common.consts import EP_STAMP_WORDS, EP_SYNC_WORDS, SYNC_PAIRS, CombWord, EpCombineQuant, EpDType, EpPhase, ErrCode, FlagUnit, Stamp, SyncWord, WaitId, XdbRow
from mori_jit.ops.ep.backends.hip.intranode.tuning import DEFAULT_COMBINE, DEFAULT_DISPATCH

__all__ = ["EpDType", "EpPhase", "EpCombineQuant", "EpWireBytes", "CombWord", "WaitId", "ErrCode", "XdbRow", "SyncWord", "SYNC_PAIRS", "EP_SYNC_WORDS", "FlagUnit",
           "Stamp", "EP_STAMP_WORDS", "EpCfg", "EP_ARGS", "EP_REGIONS", "EP_MAX_PEERS", "EP_ROW_ALIGN", "EP_MAX_BLOCK_THREADS", "EP_MAX_BULK_SMEM", "EP_MAX_COUNTED_EXPERTS", "make_ep_cfg", "region_bytes",
           "EpElemBytes", "EpTokenBytes", "EpBlockThreads", "EpMaxRecv", "EpNumExperts", "EpIsValid", "EpRangeTok",
           "EpBulkStages", "EpBulkSmemBytes", "EpSummable", "DISPATCH", "COMBINE", "LAYOUT",
           "EXPERT_SUM"]

#: Bytes of the vectors the kernels move rows in: a token row is whole vectors (every backend
#: refuses other hidden sizes, see config.py, so that one config is valid for all).
EP_ROW_ALIGN = ROW_ALIGN
#: Most threads in one block, on every supported arch.
EP_MAX_BLOCK_THREADS = 1024
#: Most threads one SM holds at once (NVIDIA sm_80 and later): blocksPerSm blocks must fit.
EP_MAX_SM_THREADS = 2048
#: Most dynamic shared memory for a dispatch block's bulk-copy stages: sm_90's 227 KiB per block
#: less the static routing arrays (DispatchRound, at most 24 KiB) and the claim's words.
EP_MAX_BULK_SMEM = 192 * 1024
#: Most experts in all (numExpertPerRank * worldSize) a dispatch with expertCounts tallies in one
#: block's shared memory (8 KiB).
EP_MAX_COUNTED_EXPERTS = 2048


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
    # blocks each SM holds at once (the launch bound's minimum: registers are capped to fit them);
    # more than 1 only for a one-rank combine, whose grid may exceed the SMs (nothing in it waits)
    blocksPerSm: int = 1
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
    # dispatch and combine: the whole leg, or its send or its receive half (the split legs,
    # EpPhase); a dispatch's receive runs on one block
    phase: EpPhase = EpPhase.Whole
    # combine: the wire's cast (the op's quant_type, EpCombineQuant): every row, the home rank's own
    # too, is cast to e4m3 (with its block scales) and the home rank sums the decoded values, as
    # quant.py does, bit for bit; Plain moves the rows as they are
    combineQuant: EpCombineQuant = EpCombineQuant.Plain
    # combine, Fp8Block: the scale rule's bytes, 4 (float32) or 1 (UE8M0: a power of two); either
    # travels as one 32-bit word per block
    combineScaleBytes: int = 4

    def __post_init__(self):
        if not EpIsValid(self):
            raise ConfigError(f"invalid EpCfg: {'; '.join(ep_cfg_problems(self))}")


EpElemBytes = Derived("EpElemBytes", "EpCfg", ELEM_BYTES, doc="bytes per payload element")
EpTokenBytes = Derived("EpTokenBytes", "EpCfg", C.hiddenDim * EpElemBytes, doc="bytes per token row")
EpBlockThreads = Derived("EpBlockThreads", "EpCfg", C.warpPerBlock * C.waveSize, doc="threads per block")
EpMaxRecv = Derived("EpMaxRecv", "EpCfg", MAX_RECV,
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
EpWireBytes = Derived("EpWireBytes", "EpCfg", wire_bytes(EpTokenBytes),
                      doc="bytes of a combine row on the wire (comb_recv's row)")
EpSummable = Derived("EpSummable", "EpCfg", SUMMABLE, ctype="bool",
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
    ((C.blocksPerSm >= 1) & (EpBlockThreads * C.blocksPerSm <= EP_MAX_SM_THREADS),
     f"blocksPerSm must be >= 1, and blocksPerSm*warpPerBlock*waveSize <= {EP_MAX_SM_THREADS} (one SM's threads)"),
    (C.bulkMinTokens >= 0, "bulkMinTokens must be >= 0"),
    ((C.scaleDim.eq(0) & C.scaleTypeSize.eq(0)) | ((C.scaleDim >= 1) & (C.scaleTypeSize.eq(1) | C.scaleTypeSize.eq(2)
                                                                       | C.scaleTypeSize.eq(4) | C.scaleTypeSize.eq(8))),
     "scaleDim and scaleTypeSize must be both 0 (no scales) or scaleDim >= 1 with scaleTypeSize 1, 2, 4 or 8"),
    (~C.quantFp8Block128 | (C.dtype.eq(EpDType.Fp8) & (C.hiddenDim % 128).eq(0) & C.scaleDim.eq(C.hiddenDim / 128)
                             & (C.scaleTypeSize.eq(4) | C.scaleTypeSize.eq(1)) & C.bulkMinTokens.eq(0)),
     "quantFp8Block128 needs dtype Fp8, hiddenDim a multiple of 128, scaleDim = hiddenDim / 128, scaleTypeSize 4 "
     "or 1, and bulkMinTokens 0 (the rows are cast in registers)"),
    COMBINE_QUANT_RULE,
    (C.expertCapacity.eq(0) | ((C.expertCapacity >= 1) & C.expertCounts),
     "expertCapacity must be 0 (no expert-major layout) or >= 1 with expertCounts"),
    (~C.expertCounts | (EpNumExperts <= EP_MAX_COUNTED_EXPERTS),
     f"expertCounts needs numExpertPerRank*worldSize <= {EP_MAX_COUNTED_EXPERTS} (a block tallies every expert in "
     f"shared memory)"),
    (EpBulkSmemBytes <= EP_MAX_BULK_SMEM, f"bulk-copy stages (EpBulkStages * token bytes) must fit in "
                                          f"{EP_MAX_BULK_SMEM} bytes of shared memory"),
]


EpIsValid = Derived("EpIsValid", "EpCfg", all_of(_RULES), ctype="bool",
                    doc="the kernels can be built and are correct for this config")


def ep_cfg_problems(cfg: EpCfg) -> list[str]:
    """Every violated rule, with the offending values."""
    return rule_problems(cfg, _RULES)


register_header(GeneratedHeader(
    "ep/ep_generated.hpp", "mori::ep", enums=[EpDType, EpPhase, EpCombineQuant], consts=[CombWord, WaitId, ErrCode, XdbRow, SyncWord, FlagUnit, Stamp], cfgs=[EpCfg],
    derived=[EpElemBytes, EpTokenBytes, EpBlockThreads, EpMaxRecv, EpNumExperts, EpRangeTok, EpBulkStages,
             EpBulkSmemBytes, EpWireBytes, EpSummable, EpIsValid],
    args=[EP_ARGS]))


def region_bytes(disp: EpCfg, comb: EpCfg) -> dict[str, int]:
    """Bytes of each region for a dispatch leg ``disp`` and a combine leg ``comb`` (same shape)."""
    recv, k, m, ws = EpMaxRecv(disp), disp.numExpertPerToken, disp.maxTokPerRank, disp.worldSize
    low = comb.lowLatency
    return {
        "disp_out": recv * EpTokenBytes(disp), "out_wts": recv * k * 4, "out_idx": recv * k * (8 if disp.ids64 else 4),
        "recv_to_src": recv * 4, "tok_off": m * k * 4, "recv_num": 2 * 4, "total_recv": 4,
        "src_to_recv": ws * m * 8,
        "comb_recv": ws * m * EpWireBytes(comb), "comb_recv_wts": ws * m * k * (8 if low else 4),
        "comb_flags": 0 if low else ws * m * 8,
        "xdb": len(XdbRow) * EP_MAX_PEERS * 8, "sync": EP_SYNC_WORDS * 8, "stamps": EP_STAMP_WORDS * 8,
        "out_scales": recv * disp.scaleDim * disp.scaleTypeSize,
        "expert_adds": 2 * disp.numExpertPerRank * 4 if disp.expertCounts else 0,
        "expert_counts": disp.numExpertPerRank * 4 if disp.expertCounts else 0,
        **mask_region_bytes(EP_MAX_PEERS),
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
    """``MORI_EP_CFG_<FIELD>`` (both legs) and ``MORI_EP_CFG_<DISPATCH|COMBINE>_<FIELD>`` (one leg)."""
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
                raise ConfigError(f"MORI_EP_CFG_{raw}: no EpCfg field {name!r}; valid: "
                                  f"{', '.join('MORI_EP_CFG_[DISPATCH_|COMBINE_]' + k for k in by_key)}")
            out[field] = value
    return out


def make_ep_cfg(kind: str, arch: str, request: Mapping[str, Any]) -> EpCfg:
    """The EpCfg for leg ``kind`` on ``arch``: arch defaults ← ``request`` ← ``MORI_EP_CFG_*`` overrides.

    The only place ``MORI_EP_CFG_*`` is read; the result goes into the key like any other Cfg. The
    combine leg refuses byte dtypes (they can be moved, not summed) and bulk copies (dispatch only).
    """
    if kind not in (DISPATCH, COMBINE, LAYOUT, EXPERT_SUM):
        raise ValueError(f"kind must be one of {DISPATCH!r}, {COMBINE!r}, {LAYOUT!r}, {EXPERT_SUM!r}, got {kind!r}")
    env = _env_overrides(COMBINE if kind in (COMBINE, EXPERT_SUM) else DISPATCH)
    if "phase" in env:  # (it would make every launch of the leg one half of it)
        raise ConfigError("MORI_EP_CFG_*PHASE: the phase is chosen by the op's call (dispatch_send, dispatch_recv, "
                          "...), never by an override; unset it")
    merged = {**_leg_defaults(kind, arch), **request, **env}
    cfg = apply_request(EpCfg(worldSize=1, waveSize=wave_size_for_arch(arch)), merged)
    if kind in (COMBINE, EXPERT_SUM) and not EpSummable(cfg):
        raise ConfigError(f"combine dtype {cfg.dtype.name} cannot be summed; combine supports Bf16 and Fp32")
    if kind == COMBINE and cfg.bulkMinTokens:
        raise ConfigError(f"bulkMinTokens={cfg.bulkMinTokens} on the combine leg: bulk copies are a dispatch "
                          f"choice (set MORI_EP_CFG_DISPATCH_BULKMINTOKENS, not MORI_EP_CFG_BULKMINTOKENS)")
    if kind not in (DISPATCH, COMBINE) and cfg.phase != EpPhase.Whole:
        raise ConfigError(f"phase={cfg.phase.name} on the {kind} kernel: only dispatch and combine run in halves")
    if cfg.bulkMinTokens and not has_bulk_copy(arch):
        raise ConfigError(f"bulkMinTokens={cfg.bulkMinTokens} on {arch}: no bulk-copy unit there "
                          f"(NVIDIA sm_90 and later); use 0")
    return cfg
