"""Every internode kernel an op launches: the walk the live op and ``mori-jit precompile`` share.

From a config, an arch and the rank's share of the SMs: the token-count buckets (the tuning
table's edges, plus ``internode_auto_ll_max_tokens`` under ``auto``), each bucket's family
(``v2_ll`` or ``v2``) and the EpNetCfg of each leg (one kernel each). ``auto`` switches family by the
launch's token count: a bucket of at most ``internode_auto_ll_max_tokens`` tokens takes ``v2_ll``,
a larger one ``v2``; buckets no call can reach (above ``max_num_inp_token_per_rank``) are left out,
so an op whose every call is small builds only ``v2_ll``. Every rank of one call must fall on the
same side of the threshold (the families speak different protocols; ranks that differ time out):
an op's calls switch together, e.g. between prefill and decode. With ``split_send_recv`` each
bucket's legs also run in halves (:meth:`NetVariants.half`), in every family, so ``auto`` switches
the halves as it switches the whole legs.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from mori_jit.jit.toolchain import vendor_of

from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.internode.cfg import EP_NET_MAX_RANKS, EpNetCfg, make_net_cfg
from mori_jit.ops.ep.backends.hip.internode.tuning import net_rows
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, DISPATCH, SPLIT_PHASES, halves
from mori_jit.ops.ep.backends.hip.common.consts import EpPhase
from mori_jit.ops.ep.backends.hip.common.request import GridShare, ep_dtype, kernel_fields
from mori_jit.ops.ep.core.schedule import Schedule
from mori_jit.ops.ep.errors import EpConfigError

__all__ = ["NetVariants", "net_variants", "internode_gaps", "bucket_families", "mask_refusal", "BUILT_FAMILIES"]

#: The internode families whose kernels exist (see internode.specs.FAMILY_BODIES).
BUILT_FAMILIES = ("v2_ll", "v2")


@dataclasses.dataclass(frozen=True)
class NetVariants:
    """The schedule and, per bucket, its family and the EpNetCfg of each leg."""

    schedule: Schedule
    families: tuple[str, ...]
    dispatch: tuple[EpNetCfg, ...]  # per bucket
    combine: tuple[EpNetCfg, ...]  # per bucket
    #: the split legs (``split_send_recv``): each bucket's legs also run as a send and a receive kernel
    split: bool = False

    def half(self, leg: str, phase: EpPhase) -> tuple[EpNetCfg, ...]:
        """Per bucket, the ``leg``'s EpNetCfg for one half of the split legs (its family's, as the
        whole leg's); empty without them."""
        return halves(self.dispatch if leg == DISPATCH else self.combine, phase, self.split)

    def requests(self) -> list[tuple]:
        """The distinct ``(spec, EpNetCfg)`` pairs to prepare: each bucket's legs in launch order,
        then, with the split legs, each half's."""
        from mori_jit.ops.ep.backends.hip.internode.specs import net_spec
        out: dict = {}
        for fam, disp, comb in zip(self.families, self.dispatch, self.combine):
            out.setdefault((net_spec(fam, DISPATCH), disp), None)
            out.setdefault((net_spec(fam, COMBINE), comb), None)
        for leg in (DISPATCH, COMBINE):
            for phase in SPLIT_PHASES:
                for fam, c in zip(self.families, self.half(leg, phase)):
                    out.setdefault((net_spec(fam, leg), c), None)
        return list(out)


def _edges(cfg: EpDispatchCombineConfig, row_edges: list[Optional[int]]) -> list[Optional[int]]:
    m = cfg.max_num_inp_token_per_rank
    cut = {e for e in row_edges if e is not None and e < m}
    if cfg.internode_kernel == "auto" and cfg.internode_auto_ll_max_tokens < m:
        cut.add(cfg.internode_auto_ll_max_tokens)
    return sorted(cut) + [None]


def bucket_families(cfg: EpDispatchCombineConfig, edges: list[Optional[int]]) -> tuple[str, ...]:
    """The family of each bucket (``edges``: inclusive maxima, the last None): the named one, or
    under ``auto`` ``v2_ll`` for buckets of at most ``internode_auto_ll_max_tokens`` tokens."""
    if cfg.internode_kernel != "auto":
        return tuple(cfg.internode_kernel for _ in edges)
    top = [e if e is not None else cfg.max_num_inp_token_per_rank for e in edges]
    return tuple("v2_ll" if t <= cfg.internode_auto_ll_max_tokens else "v2" for t in top)


def internode_gaps(cfg: EpDispatchCombineConfig, arch: Optional[str] = None) -> list[str]:
    """What the internode kernels cannot do for ``cfg`` on ``arch`` (None: this torch build's GPUs);
    AMD is refused naming the missing engine."""
    where = f"internode (gpu_per_node={cfg.gpu_per_node} < world_size={cfg.world_size})"
    if arch is not None:
        amd = vendor_of(arch) == "amd"
    else:
        import torch
        amd = bool(getattr(torch.version, "hip", None))
    if amd:
        return [f"{where} on {arch or 'AMD GPUs'}: internode kernels run on a device-side SHMEM engine, and "
                f"AMD's (rocSHMEM, mori-shmem) is not available to mori-jit; NVSHMEM is NVIDIA-only"]
    missing = []
    if cfg.world_size % cfg.gpu_per_node:
        missing.append(f"{where}: world_size must be a multiple of gpu_per_node (every node holds as many ranks)")
    if cfg.gpu_per_node > 32:
        missing.append(f"{where}: gpu_per_node={cfg.gpu_per_node} > 32 (a node's ranks are a 32-bit mask)")
    if cfg.world_size > EP_NET_MAX_RANKS:
        missing.append(f"{where}: world_size={cfg.world_size} > {EP_NET_MAX_RANKS}")
    if cfg.symm_memory != "auto":
        missing.append(f"{where} with symm_memory={cfg.symm_memory!r}: the internode arena is NVSHMEM symmetric "
                       f"memory; leave symm_memory='auto'")
    m = cfg.max_num_inp_token_per_rank
    needed = set(bucket_families(cfg, _edges(cfg, [])))
    for fam in sorted(needed - set(BUILT_FAMILIES)):
        if cfg.internode_kernel == "auto":
            missing.append(f"{where}: internode_kernel='auto' with max_num_inp_token_per_rank={m} > "
                           f"internode_auto_ll_max_tokens={cfg.internode_auto_ll_max_tokens} needs the {fam!r} family "
                           f"for its larger calls, which is not built yet; use internode_kernel='v2_ll', or "
                           f"max_num_inp_token_per_rank <= internode_auto_ll_max_tokens")
        else:
            missing.append(f"{where}: internode_kernel={fam!r} is not built yet (built: {', '.join(BUILT_FAMILIES)})")
    return missing


def mask_refusal(cfg: EpDispatchCombineConfig, families: tuple[str, ...]) -> str:
    """Why an internode op whose buckets are ``families`` does not serve rank masking, or "" when it
    does (every bucket ``v2_ll``). ``v2`` forwards each token through one rank of every destination
    node (the one with the source's local index), so a masked rank also relays the tokens of every
    source of its local index into its node: dropping its own experts would not keep the live
    ranks' tokens whole (docs/design.md §6, "Rank masking")."""
    if "v2" not in families:
        return ""
    why = f"internode_kernel={cfg.internode_kernel!r}"
    if cfg.internode_kernel == "auto":
        why += (f" with max_num_inp_token_per_rank={cfg.max_num_inp_token_per_rank} > internode_auto_ll_max_tokens="
                f"{cfg.internode_auto_ll_max_tokens}")
    return (f"{why} builds the 'v2' family, which forwards every token through a relay rank of each "
            f"destination node: a masked rank relays for other ranks, so its loss cannot be served by dropping "
            f"its experts alone. Masking is served by internode_kernel='v2_ll' (every rank sends straight to "
            f"every rank, as DeepEP masks in its low-latency mode only), or 'auto' with "
            f"max_num_inp_token_per_rank <= internode_auto_ll_max_tokens (v2_ll alone)")


def _rows(cfg: EpDispatchCombineConfig, arch: str, share: GridShare) -> tuple:
    share.check_pins(cfg)
    if cfg.schedule is not None:
        return tuple((b[0], b[1], 0, b[2], b[3], 0, b[4]) for b in cfg.schedule)
    rows = net_rows(arch, cfg.world_size, cfg.hidden_dim, cfg.num_experts_per_token,
                    ep_dtype(cfg.dispatch_dtype).name.lower(), share.budget)
    pin = lambda v, p: p if p is not None else v  # noqa: E731
    return tuple((e, pin(db, cfg.dispatch_block_num), dr, pin(dw, cfg.warp_num_per_block), pin(cb, cfg.combine_block_num),
                  cr, pin(cw, cfg.combine_warp_num_per_block)) for e, db, dr, dw, cb, cr, cw in rows)


def net_variants(cfg: EpDispatchCombineConfig, arch: str, num_cus: int, ranks_per_device: int = 1) -> NetVariants:
    """Every EpNetCfg the internode op for ``cfg`` on ``arch`` launches, by bucket, on a device of
    ``num_cus`` SMs that ``ranks_per_device`` ranks share. A geometry pin beyond the rank's share,
    or a family that is not built, raises EpConfigError."""
    share = GridShare(num_cus, ranks_per_device)
    gaps = internode_gaps(cfg, arch)
    if gaps:
        raise EpConfigError("; ".join(gaps))
    rows = _rows(cfg, arch, share)
    edges = _edges(cfg, [r[0] for r in rows])
    families = bucket_families(cfg, edges)
    disp, comb, sched_d, sched_c = [], [], [], []
    for edge, fam in zip(edges, families):
        top = edge if edge is not None else cfg.max_num_inp_token_per_rank
        row = next(r for r in rows if r[0] is None or r[0] >= top)
        _, db, _, dw, cb, _, cw = row
        disp.append(make_net_cfg(DISPATCH, arch, {**kernel_fields(cfg, DISPATCH), "blockNum": db, "warpPerBlock": dw}))
        comb.append(make_net_cfg(COMBINE, arch, {**kernel_fields(cfg, COMBINE), "blockNum": cb, "warpPerBlock": cw}))
        sched_d.append((db, dw))
        sched_c.append((cb, cw))
    # (a call may take another bucket's geometry only within its family: the families' protocols differ)
    schedule = Schedule(tuple(edges), tuple(sched_d), tuple(sched_c), groups=families)
    return NetVariants(schedule, families, tuple(disp), tuple(comb), cfg.split_send_recv)
