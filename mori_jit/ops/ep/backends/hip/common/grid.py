"""How many blocks one rank's grid may have, and the refusal of a pin beyond it: shared by the
intranode and internode variant walks (docs/design.md §9, "SM budget")."""
from __future__ import annotations

from mori_jit.jit.fields import ConfigError

from mori_jit.ops.ep import knobs
from mori_jit.ops.ep.errors import EpConfigError

__all__ = ["check_num_cus", "grid_budget", "check_pin", "ranks_dividing_cus", "SOLO_COMBINE_BLOCKS_PER_SM"]

#: Blocks per SM a one-rank combine's grid may have. Its blocks wait for none of the others
#: (``kSolo`` in ``ep_combine_summer.hpp``: no flags, no claims), so its grid need not be resident
#: at once and may exceed the SMs; each block beyond one per SM caps the kernel's registers
#: (``EpCfg.blocksPerSm``).
SOLO_COMBINE_BLOCKS_PER_SM = 2


def ranks_dividing_cus(ranks_per_device: int) -> int:
    """How many ranks divide the CU/SM count this process sees: 1 under a CUDA MPS thread limit
    (the count is already this process's share, and the limits of co-located ranks sum to at most
    the device), else every rank on the device."""
    return 1 if knobs.ep.mps_thread_percentage else ranks_per_device


def check_num_cus(num_cus) -> None:
    """Refuse a CU/SM count that is not an int >= 1."""
    if isinstance(num_cus, bool) or not isinstance(num_cus, int) or num_cus < 1:
        raise EpConfigError(f"num_cus={num_cus!r}: expected the device's CU/SM count, an int >= 1")


def grid_budget(num_cus: int, ranks_per_device: int) -> int:
    """The blocks one rank's grid may have: its share of the device's CUs/SMs. Ranks that share a
    device spin-wait on each other, so every rank's grid must be resident beside the others'."""
    return max(1, num_cus // ranks_per_device)


def check_pin(what: str, blocks: int, budget: int, num_cus: int, ranks_per_device: int, hint: str = "",
              per_sm: int = 1) -> None:
    """Refuse a pinned grid of ``blocks`` beyond this rank's ``budget`` (see :func:`grid_budget`)
    times ``per_sm`` (:data:`SOLO_COMBINE_BLOCKS_PER_SM` for a one-rank combine, else 1), naming the
    pin, the limit and why."""
    limit = budget * per_sm
    if blocks <= limit:
        return
    if per_sm > 1:
        why = (f": a one-rank combine waits for no block, so its grid may exceed the {num_cus} CUs/SMs of the "
               f"device, up to {per_sm} blocks per CU/SM")
    else:
        share = (f"this rank's share of the {num_cus} CUs/SMs of a device that {ranks_per_device} ranks share"
                 if ranks_per_device > 1 else f"the {num_cus} CUs/SMs of the device")
        why = f", {share}: the kernels wait on their peers, so every block of every rank must be resident at once"
    raise EpConfigError(f"{what}={blocks} exceeds {limit}{why}; pin at most {limit} (or leave it unset){hint}")
