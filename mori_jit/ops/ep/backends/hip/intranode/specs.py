"""The EP kernel specs: ``ep_dispatch`` and ``ep_combine`` (one TU template, two entry bodies)."""
from __future__ import annotations

from mori_jit.jit.registry import register
from mori_jit.jit.spec import Geometry, Spec
from mori_jit.jit.toolchain import Toolchain

from mori_jit.ops.ep.backends.hip.common.cfg import ELEM_TYPES, phase_suffix, quant_suffix
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, DISPATCH, EP_ARGS, EXPERT_SUM, LAYOUT, EpBlockThreads, EpBulkSmemBytes, EpCfg, EpDType, EpPhase, make_ep_cfg

__all__ = ["EpSpec", "EP_DISPATCH", "EP_COMBINE", "EP_LAYOUT", "EP_EXPERT_SUM"]

#: The kernel body of each kind.
_BODIES = {DISPATCH: "EpDispatchBody", COMBINE: "EpCombineBody", LAYOUT: "EpLayoutBody",
           EXPERT_SUM: "EpExpertSumBody"}


class EpSpec(Spec):
    """One kernel of the intranode EP op. ``kind`` is ``dispatch``, ``combine``, ``layout`` (the
    expert-major layout, launched after a dispatch with the dispatch's EpCfg) or ``expert_sum`` (the
    expert-major combine's local sum, on the combine's EpCfg)."""

    cfg_type = EpCfg
    args = EP_ARGS
    template = "ep_intranode.hip.j2"
    deps = ("kernels/platform", "kernels/common", "kernels/ep")

    def __init__(self, kind: str):
        self.kind = kind
        self.name = f"ep_{kind}"

    def default_cfg(self, toolchain: Toolchain) -> EpCfg:
        return make_ep_cfg(self.kind, toolchain.arch, {})

    def make_cfg(self, toolchain: Toolchain, request=None) -> EpCfg:
        return make_ep_cfg(self.kind, toolchain.arch, request or {})

    def entry_name(self, cfg: EpCfg) -> str:
        # (_m<n>: n blocks per SM, the launch bound (a one-rank combine); _ll: the low-latency
        # combine; _bulk: a dispatch whose large blocks use the bulk-copy unit;
        # _i64: int64 expert ids; _s<dim>x<bytes>: per-token scales;
        # _cnt: local expert counts; _rr: routing replay; _q128: in-kernel fp8 block cast;
        # _c<capacity>: the expert-major layout; _send/_recv: one half of the split legs; _w8: the
        # combine's fp8 wire, direct cast; _w8b<bytes>: blockwise, with scales of that many bytes)
        return (f"mori_ep_{self.kind}_{cfg.dtype.name.lower()}_ws{cfg.worldSize}_h{cfg.hiddenDim}"
                f"_k{cfg.numExpertPerToken}_{cfg.blockNum}x{cfg.warpPerBlock}"
                f"{f'_m{cfg.blocksPerSm}' if cfg.blocksPerSm > 1 else ''}{'_ll' if cfg.lowLatency else ''}"
                f"{'_bulk' if cfg.bulkMinTokens else ''}{'_i64' if cfg.ids64 else ''}"
                f"{f'_s{cfg.scaleDim}x{cfg.scaleTypeSize}' if cfg.scaleDim else ''}{'_cnt' if cfg.expertCounts else ''}"
                f"{'_rr' if cfg.routingReplay else ''}{'_q128' if cfg.quantFp8Block128 else ''}"
                f"{f'_c{cfg.expertCapacity}' if cfg.expertCapacity else ''}{quant_suffix(cfg)}{phase_suffix(cfg.phase)}")

    def precompile_cfgs(self, toolchain: Toolchain) -> list[EpCfg]:
        # a layout or an expert sum exists only for an op's config (mori-jit precompile --ep builds those)
        return [] if self.kind in (LAYOUT, EXPERT_SUM) else super().precompile_cfgs(toolchain)

    def geometry(self, cfg: EpCfg) -> Geometry:
        # (only the dispatch's sends have bulk-copy stages; a layout runs on the dispatch's EpCfg
        # without them; a dispatch's receive is one block's waits and counts)
        if self.kind == DISPATCH and cfg.phase == EpPhase.Recv:
            return Geometry((1, 1, 1), (EpBlockThreads(cfg), 1, 1), 0)
        smem = EpBulkSmemBytes(cfg) if self.kind == DISPATCH else 0
        return Geometry((cfg.blockNum, 1, 1), (EpBlockThreads(cfg), 1, 1), smem)

    def template_vars(self, cfg: EpCfg, toolchain: Toolchain) -> dict:
        # Arch routing happens here, on the host: every arch uses the portable body today.
        return {"body_header": "ep/ep_intranode.hpp",
                "body": _BODIES[self.kind],
                "elem_t": ELEM_TYPES[cfg.dtype],
                "launch_bounds": _launch_bounds(cfg, toolchain)}


def _launch_bounds(cfg: EpCfg, toolchain: Toolchain) -> str:
    """The kernel's ``__launch_bounds__`` arguments: its threads, and on NVIDIA the blocks per SM
    where there are more than one (``blocksPerSm``; a minimum of 1 is left out: nvcc allocates
    registers differently with it, and every other kernel keeps its measured code). hip's second
    argument counts waves per execution unit, not blocks, and no AMD geometry asks for more than
    one block per CU: AMD gets the threads only."""
    per_sm = f", {cfg.blocksPerSm}" if cfg.blocksPerSm > 1 and toolchain.vendor == "nvidia" else ""
    return f"EpBlockThreads(kCfg){per_sm}"


EP_DISPATCH = register(EpSpec(DISPATCH))
EP_COMBINE = register(EpSpec(COMBINE))
EP_LAYOUT = register(EpSpec(LAYOUT))
EP_EXPERT_SUM = register(EpSpec(EXPERT_SUM))
