"""The EP kernel variants a live ``hip`` op builds — shared by the op and by ``mori-jit precompile``.

Walking the same schedule and the same :func:`~mori_jit.ops.ep.backends.hip.intranode.cfg.make_ep_cfg` as the live op is
what makes precompile produce exactly the binaries the op will ask for.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Optional

import torch

from mori_jit.jit.toolchain import has_bulk_copy, vendor_of, wave_size_for_arch

from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, DISPATCH, EXPERT_SUM, LAYOUT, EP_MAX_BLOCK_THREADS, EpCfg, EpDType, EpIsValid, EpPhase, EpRangeTok, make_ep_cfg, region_bytes
from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.gaps import hip_gaps
from mori_jit.ops.ep.backends.hip.common.cfg import SPLIT_PHASES, halves
from mori_jit.ops.ep.backends.hip.common.grid import check_num_cus
from mori_jit.ops.ep.backends.hip.common.request import GridShare, ep_dtype, kernel_fields
from mori_jit.ops.ep.core.schedule import Schedule
from mori_jit.ops.ep.backends.hip.intranode.tuning import BULK_DISPATCH_MIN_TOKENS, LOW_LATENCY_MAX_TOKENS, ONE_TOKEN_COMBINE, lookup, schedule_from_buckets
from mori_jit.ops.ep.errors import EpConfigError

__all__ = ["EpVariants", "ep_variants", "combine_low_latency", "DEFAULT_NUM_CUS", "plan_requests",
           "config_from_strings", "precompile_targets", "hip_gaps", "dispatch_moe_fields"]

#: CU/SM counts used when no device is present (precompile); the live op reads the device.
DEFAULT_NUM_CUS = {"sm_90": 132, "sm_90a": 132, "sm_100a": 148, "sm_80": 108, "gfx90a": 104, "gfx940": 228,
                   "gfx942": 304, "gfx950": 256}


def dispatch_moe_fields(cfg: EpDispatchCombineConfig) -> dict:
    """The dispatch EpCfg fields of ``cfg``'s MoE options. Each is off by default, and a Cfg renders
    only its non-default fields, so an op without them renders, keys and builds as before."""
    return {"ids64": cfg.index_dtype == torch.int64, "scaleDim": cfg.scale_dim, "scaleTypeSize": cfg.scale_type_size,
            "expertCounts": cfg.expert_counts, "routingReplay": cfg.routing_replay,
            "quantFp8Block128": cfg.dispatch_quant_type == "fp8_e4m3_block128", "expertCapacity": cfg.expert_capacity}


@dataclasses.dataclass(frozen=True)
class EpVariants:
    """The schedule and, per bucket, the dispatch and combine EpCfg it launches."""

    schedule: Schedule
    dispatch: tuple[EpCfg, ...]
    combine: tuple[EpCfg, ...]
    #: per bucket, the combine of ``combine_expert_major`` (the expert layout only): the combine's
    #: EpCfg moving float32 rows (the local sums), so the result is rounded once
    expert_combine: tuple[EpCfg, ...] = ()
    #: the split legs (``split_send_recv``): each bucket's dispatch and combine also run in halves
    split: bool = False

    def half(self, kind: str, phase: EpPhase) -> tuple[EpCfg, ...]:
        """Per bucket, the ``kind`` leg's EpCfg for one half of the split legs (the whole leg's
        EpCfg, but for its phase); empty without them, and for the combine's send at one rank:
        there it has no peer to push to (its receive reads the rows where they lie), and even an
        empty kernel costs a launch in the caller's step."""
        legs = self.dispatch if kind == DISPATCH else self.combine
        if kind == COMBINE and phase == EpPhase.Send and legs[0].worldSize == 1:
            return ()
        return halves(legs, phase, self.split)

    def all_cfgs(self) -> list[tuple[str, EpCfg]]:
        """Distinct (kind, cfg) pairs — the set of binaries to compile (a dispatch with the
        expert-major layout brings its layout kernel, the combine its local sum, and the split legs
        each leg's send and receive kernels)."""
        split = [(kind, c) for kind in (DISPATCH, COMBINE) for phase in SPLIT_PHASES for c in self.half(kind, phase)]
        out = dict.fromkeys([(DISPATCH, c) for c in self.dispatch] + [(COMBINE, c) for c in self.combine]
                            + [(LAYOUT, c) for c in self.dispatch if c.expertCapacity]
                            + [(EXPERT_SUM, c) for c in self.combine if self.expert_combine]
                            + [(COMBINE, c) for c in self.expert_combine] + split)
        return list(out)

    def region_bytes(self) -> dict[str, int]:
        """The arena's region sizes for these kernels (the expert-major combine moves float32 rows,
        so its combine, where there is one, sizes the combine's receive side)."""
        return region_bytes(self.dispatch[0], (self.expert_combine or self.combine)[0])

    def requests(self) -> list[tuple]:
        """The ``(spec, EpCfg)`` pairs to prepare: :meth:`all_cfgs` with each kind's spec."""
        from mori_jit.ops.ep.backends.hip.intranode.specs import EP_COMBINE, EP_DISPATCH, EP_EXPERT_SUM, EP_LAYOUT
        spec = {DISPATCH: EP_DISPATCH, COMBINE: EP_COMBINE, LAYOUT: EP_LAYOUT, EXPERT_SUM: EP_EXPERT_SUM}
        return [(spec[kind], c) for kind, c in self.all_cfgs()]


def _one_token_ranges(cfg: EpDispatchCombineConfig, blocks: int, arch: str) -> bool:
    """Whether a low-latency combine of ``cfg`` on ``blocks`` blocks holds each peer-token task in
    its grid, so that the kernel takes one-token ranges (``EpRangeTok``): each block pushes at most
    one row per peer and sums at most one token. An op that can have them gets every SM in each
    combine bucket (tuning: ``tuning.ONE_TOKEN_COMBINE``), and its blocks then load fewer
    vectors per lane."""
    probe = EpCfg(worldSize=cfg.world_size, maxTokPerRank=cfg.max_num_inp_token_per_rank, blockNum=blocks,
                  waveSize=wave_size_for_arch(arch), lowLatency=True)
    return EpRangeTok(probe) == 1


def _bulk_dispatch(c: EpCfg, arch: str, max_tokens: int) -> bool:
    """Whether dispatch ``c`` (a bucket of at most ``max_tokens`` tokens) asks for the bulk-copy
    path (tuning: ``tuning.BULK_DISPATCH_MIN_TOKENS``): rows go to peers (one rank copies only
    into its own memory, where the path measured slower), the arch has the unit, a block can own
    that many tokens, and ``c`` stays valid with it (its stages fit in shared memory). A request: a
    ``MORI_EP_CFG_*`` override wins."""
    probe = types.SimpleNamespace(**{**vars(c), "bulkMinTokens": BULK_DISPATCH_MIN_TOKENS})  # (EpCfg would raise)
    return (c.worldSize > 1 and has_bulk_copy(arch) and -(-max_tokens // c.blockNum) >= BULK_DISPATCH_MIN_TOKENS
            and EpIsValid(probe))


def _schedule(cfg: EpDispatchCombineConfig, share: GridShare, arch: str, low_latency: bool) -> Schedule:
    share.check_pins(cfg)
    budget, comb_budget = share.budget, share.combine_budget(cfg.world_size)
    if cfg.schedule is not None:
        disp = [(b[0], b[1], b[2]) for b in cfg.schedule]
        comb = [(b[0], b[3], b[4]) for b in cfg.schedule]
        return schedule_from_buckets(disp, comb, budget, combine_cus=comb_budget)
    base = lookup(ep_dtype(cfg.dispatch_dtype).name.lower(), cfg.world_size, cfg.hidden_dim,
                  cfg.num_experts_per_token, cfg.num_experts_per_rank, budget,
                  max_warps=EP_MAX_BLOCK_THREADS // wave_size_for_arch(arch), combine_cus=comb_budget)
    comb_blocks = cfg.combine_block_num
    if comb_blocks is None and low_latency and _one_token_ranges(cfg, budget, arch):
        comb_blocks = budget  # every SM of the share
    pin = lambda geo, blocks, warps: (blocks or geo[0], warps or geo[1])  # noqa: E731
    return Schedule(base.edges,
                    tuple(pin(g, cfg.dispatch_block_num, cfg.warp_num_per_block) for g in base.dispatch),
                    tuple(pin(g, comb_blocks, cfg.combine_warp_num_per_block) for g in base.combine))


def ep_variants(cfg: EpDispatchCombineConfig, arch: str, num_cus: int, ranks_per_device: int = 1) -> EpVariants:
    """Every EpCfg the op for ``cfg`` on ``arch`` launches, by bucket, on a device of ``num_cus``
    CUs/SMs that ``ranks_per_device`` ranks of the group share (each sizes its grids to its share).
    A geometry pin beyond the share raises EpConfigError."""
    share = GridShare(num_cus, ranks_per_device)
    low = combine_low_latency(cfg, arch)
    sched = _schedule(cfg, share, arch, low)

    def leg(kind, geo, **extra):
        return make_ep_cfg(kind, arch, {**kernel_fields(cfg, kind), "blockNum": geo[0], "warpPerBlock": geo[1], **extra})

    def combine(geo):  # one-token ranges take their tuning, as requests (a MORI_EP_* override wins)
        # a grid beyond the share (one rank only) asks the compiler to fit that many blocks per SM
        per_sm = {"blocksPerSm": -(-geo[0] // share.budget)} if geo[0] > share.budget else {}
        c = leg(COMBINE, geo, lowLatency=low, **per_sm)
        return c if EpRangeTok(c) == 2 else leg(COMBINE, geo, lowLatency=low, **ONE_TOKEN_COMBINE, **per_sm)

    moe = dispatch_moe_fields(cfg)

    def dispatch(edge, geo):  # a bucket whose blocks can own enough tokens takes the bulk path, as a request
        c = leg(DISPATCH, geo, **moe)
        return leg(DISPATCH, geo, bulkMinTokens=BULK_DISPATCH_MIN_TOKENS, **moe) \
            if _bulk_dispatch(c, arch, min(edge or cfg.max_num_inp_token_per_rank, cfg.max_num_inp_token_per_rank)) else c

    comb = tuple(combine(geo) for geo in sched.combine)
    for c in comb:  # MORI_EP_* overrides come after: refuse what would deadlock or corrupt
        share.check("combine blockNum", c.blockNum, "; check MORI_EP_*BLOCK_NUM",
                    per_sm=share.combine_per_sm(cfg.world_size))
        if c.lowLatency != low:  # (it sizes arena regions, which every rank must lay out alike)
            raise EpConfigError(f"combine lowLatency={c.lowLatency} from MORI_EP_CFG_*LOW_LATENCY: set "
                              f"EpDispatchCombineConfig.combine_low_latency instead")
    expert = tuple(dataclasses.replace(c, dtype=EpDType.Fp32) for c in comb) if cfg.expert_capacity else ()
    return EpVariants(sched, tuple(dispatch(e, g) for e, g in zip(sched.edges, sched.dispatch)), comb, expert,
                      cfg.split_send_recv)


def combine_low_latency(cfg: EpDispatchCombineConfig, arch: str) -> bool:
    """Whether the op's combine on ``arch`` is low latency: ``combine_low_latency``, else by the op's
    size (``max_num_inp_token_per_rank <= LOW_LATENCY_MAX_TOKENS``) on NVIDIA, where it was measured;
    on AMD only when asked (unmeasured there, and each 16-byte push is four 32-bit atomic stores).
    Never on one rank (no peer rows)."""
    if cfg.world_size == 1:
        return False
    if cfg.combine_low_latency is not None:
        return cfg.combine_low_latency
    return vendor_of(arch) == "nvidia" and cfg.max_num_inp_token_per_rank <= LOW_LATENCY_MAX_TOKENS


def plan_requests(cfg: EpDispatchCombineConfig, arch: str, num_cus: int, ranks_per_device: int = 1) -> list[tuple]:
    """The ``(spec, EpCfg)`` pairs a live ``hip`` op prepares, in order, without duplicates."""
    return ep_variants(cfg, arch, num_cus, ranks_per_device).requests()


def _dtype_from_string(value: str):
    import torch
    tag = EpDType.coerce(value)  # bf16 / fp8 / torch names, any case
    return {EpDType.Bf16: torch.bfloat16, EpDType.Fp32: torch.float32, EpDType.Fp8: torch.float8_e4m3fn,
            EpDType.Fp4x2: getattr(torch, "float4_e2m1fn_x2", torch.uint8)}[tag]


#: a string field's annotation, as text (postponed annotations) or as the type
_STR_TYPES = ("str", "Optional[str]", str, Optional[str])
#: the config's on/off fields, and the words that set them on the command line
_FLAG_FIELDS = ("combine_low_latency", "expert_counts", "routing_replay", "split_send_recv")
_FLAGS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}


def _index_dtype_from_string(value: str):
    from mori_jit.ops.ep.config_rules import INDEX_DTYPES
    names = {str(t).removeprefix("torch."): t for t in INDEX_DTYPES}
    if value.removeprefix("torch.") not in names:
        raise EpConfigError(f"expected one of {', '.join(names)}")
    return names[value.removeprefix("torch.")]


def config_from_strings(request: dict[str, str]) -> tuple[EpDispatchCombineConfig, int | None]:
    """An op config from ``KEY=VALUE`` strings (``mori-jit precompile --ep``), and ``num_cus`` if given.

    Keys are :class:`EpDispatchCombineConfig` fields (``rank`` defaults to 0) plus ``num_cus``;
    dtype fields take ``bf16``/``fp32``/``fp8``/``fp4x2`` or torch dtype names, ``index_dtype``
    ``int32``/``int64``, and the on/off fields (``combine_low_latency``, ``expert_counts``,
    ``routing_replay``, ``split_send_recv``) ``on``/``off`` (or true/false, 1/0).
    """
    fields = {f.name: f for f in dataclasses.fields(EpDispatchCombineConfig)}
    kwargs: dict = {"rank": 0}
    num_cus = None
    for key, raw in request.items():
        try:
            if key == "num_cus":
                num_cus = int(raw, 0)
                check_num_cus(num_cus)
            elif key not in fields:
                raise EpConfigError(f"unknown EP config field {key!r}; valid: num_cus, {', '.join(fields)}")
            elif key.endswith("data_type"):
                kwargs[key] = _dtype_from_string(raw)
            elif key == "index_dtype":
                kwargs[key] = _index_dtype_from_string(raw)
            elif fields[key].type in _STR_TYPES:
                kwargs[key] = raw
            elif key in _FLAG_FIELDS:
                if raw.lower() not in _FLAGS:
                    raise EpConfigError(f"expected one of {', '.join(_FLAGS)}")
                kwargs[key] = _FLAGS[raw.lower()]
            elif key == "schedule":
                raise EpConfigError("schedule cannot be given on the command line")
            else:
                kwargs[key] = int(raw, 0)
        except ValueError as e:
            raise EpConfigError(f"--ep {key}={raw!r}: {e}") from None
    try:
        return EpDispatchCombineConfig(**kwargs), num_cus
    except TypeError as e:
        raise EpConfigError(f"--ep: {e}") from None
    except ValueError as e:
        raise EpConfigError(str(e)) from None


def precompile_targets(request: dict[str, str], arch: str) -> list[tuple]:
    """What ``mori-jit precompile --ep ...`` builds: exactly :func:`plan_requests` of that op (an
    internode op's: :func:`.internode.variants.net_variants`). A config the live op refuses
    (:func:`hip_gaps`) is refused here too."""
    cfg, num_cus = config_from_strings(request)
    gaps = hip_gaps(cfg, arch)
    if gaps:
        raise EpConfigError(f"--ep: the hip op does not support: {'; '.join(gaps)}")
    if num_cus is None:
        num_cus = DEFAULT_NUM_CUS.get(arch)
        if num_cus is None:
            raise EpConfigError(f"no default CU/SM count for {arch}; pass --ep num_cus=N "
                              f"(known: {', '.join(sorted(DEFAULT_NUM_CUS))})")
    if cfg.is_internode:
        from mori_jit.ops.ep.backends.hip.internode.variants import net_variants
        return net_variants(cfg, arch, num_cus).requests()
    return plan_requests(cfg, arch, num_cus)
