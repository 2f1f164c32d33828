"""The one mapping from a user config to the kernels' config fields, and the one check of its
geometry pins, for both variant walks (intranode ``variants``, ``internode.variants``).

A walk asks :func:`kernel_fields` for a leg's fields, adds its geometry (and its family's own
fields), and hands the dict to its family's ``make_*_cfg``. :class:`GridShare` is a rank's share
of the device's SMs; :meth:`GridShare.check_pins` refuses every geometry pin of a config beyond it.
"""
from __future__ import annotations

import dataclasses

from mori_jit.ops.ep.backends.hip.common.cfg import DISPATCH
from mori_jit.ops.ep.backends.hip.common.consts import EpCombineQuant, EpDType
from mori_jit.ops.ep.backends.hip.common.grid import SOLO_COMBINE_BLOCKS_PER_SM, check_num_cus, check_pin, grid_budget
from mori_jit.ops.ep.errors import EpConfigError

__all__ = ["ep_dtype", "kernel_fields", "GridShare"]


def ep_dtype(torch_dtype) -> EpDType:
    """The EpDType tag of a torch dtype (uint8 carries fp4x2 pairs)."""
    return EpDType.coerce(torch_dtype)


def kernel_fields(cfg, leg: str) -> dict:
    """The kernel config fields of ``cfg`` that every kernel of leg ``leg`` (``dispatch`` or
    ``combine``) takes alike, under the kernels' names: sizes, counts and the leg's payload dtype
    (an internode op's kernels also take its node size; a combine its wire's cast)."""
    fields = {"worldSize": cfg.world_size, "hiddenDim": cfg.hidden_dim, "maxTokPerRank": cfg.max_num_inp_token_per_rank,
              "numExpertPerRank": cfg.num_experts_per_rank, "numExpertPerToken": cfg.num_experts_per_token,
              "maxRecv": cfg.max_total_recv_tokens,
              "dtype": ep_dtype(cfg.dispatch_dtype if leg == DISPATCH else cfg.combine_dtype)}
    if cfg.is_internode:
        fields["gpuPerNode"] = cfg.gpu_per_node
    if leg != DISPATCH and cfg.quant_type != "none":  # (the combine's wire cast: both kernel configs)
        fields["combineQuant"] = EpCombineQuant.coerce(cfg.quant_type)
        fields["combineScaleBytes"] = cfg.combine_scale_type_size
    return fields


@dataclasses.dataclass(frozen=True)
class GridShare:
    """A rank's share of a device of ``num_cus`` CUs/SMs that ``ranks_per_device`` ranks share."""

    num_cus: int
    ranks_per_device: int = 1

    def __post_init__(self):
        check_num_cus(self.num_cus)
        if isinstance(self.ranks_per_device, bool) or not isinstance(self.ranks_per_device, int) \
                or self.ranks_per_device < 1:
            raise EpConfigError(f"ranks_per_device={self.ranks_per_device!r}: expected an int >= 1")

    @property
    def budget(self) -> int:
        """The most blocks one rank's grid may have."""
        return grid_budget(self.num_cus, self.ranks_per_device)

    def check(self, what: str, blocks: int, hint: str = "", per_sm: int = 1) -> None:
        """Refuse a grid of ``blocks`` beyond :attr:`budget` times ``per_sm``, naming ``what``
        pinned it."""
        check_pin(what, blocks, self.budget, self.num_cus, self.ranks_per_device, hint, per_sm)

    @staticmethod
    def combine_per_sm(world_size: int) -> int:
        """Blocks per SM of the share a combine's grid may have (a one-rank combine waits for no
        block: :data:`~.grid.SOLO_COMBINE_BLOCKS_PER_SM`; others need every block resident: 1)."""
        return SOLO_COMBINE_BLOCKS_PER_SM if world_size == 1 else 1

    def combine_budget(self, world_size: int) -> int:
        """The most blocks a combine's grid may have at ``world_size`` ranks."""
        return self.budget * self.combine_per_sm(world_size)

    def check_pins(self, cfg) -> None:
        """Refuse every geometry pin of ``cfg`` (its ``schedule`` buckets, else its block counts)
        beyond :attr:`budget` (a one-rank combine's: :meth:`combine_budget`)."""
        per_sm = self.combine_per_sm(cfg.world_size)
        if cfg.schedule is not None:
            for b in cfg.schedule:
                self.check(f"schedule bucket {tuple(b)!r} dispatch blocks", b[1])
                self.check(f"schedule bucket {tuple(b)!r} combine blocks", b[3], per_sm=per_sm)
            return
        for field, n in (("dispatch_block_num", 1), ("combine_block_num", per_sm)):
            if getattr(cfg, field) is not None:
                self.check(field, getattr(cfg, field), per_sm=n)
