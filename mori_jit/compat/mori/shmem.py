"""``mori.shmem``: the process group mori's v1 op runs on.

The engines register their EP group under a name
(``torch._C._distributed_c10d._register_process_group(name, group)``) and pass the name to
``shmem_torch_process_group_init``; mori starts its symmetric heap on it. mori-jit's op allocates
its own symmetric memory, so here the call only makes that group the one v1 ops run on
(:mod:`.groups`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mori_jit.compat.mori import groups
from mori_jit.ops.ep import EpArgumentError, EpStateError

__all__ = ["shmem_torch_process_group_init", "shmem_finalize", "shmem_mype", "shmem_npes", "shmem_barrier_all"]


def shmem_torch_process_group_init(group_name: str) -> int:
    """Make the process group registered under ``group_name`` the one mori's v1 ops run on.
    Returns 0 (mori's success status)."""
    try:
        torch._C._distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError) as e:
        raise EpArgumentError(f"group_name={group_name!r}: no process group is registered under that name "
                              f"(torch._C._distributed_c10d._register_process_group(name, group) first): {e}") from None
    groups.register(group_name)
    return 0


def _group():
    group = groups.registered()
    if group is None:
        raise EpStateError("mori.shmem: no process group registered (shmem_torch_process_group_init(name) first)")
    return group


def shmem_finalize() -> None:
    """Forget the registered group (v1 ops made later run on WORLD)."""
    groups.register(None)


def shmem_mype() -> int:
    """This process's rank in the registered group."""
    return dist.get_rank(_group())


def shmem_npes() -> int:
    """Ranks in the registered group."""
    return dist.get_world_size(_group())


def shmem_barrier_all() -> None:
    """Collective: a barrier over the registered group."""
    dist.barrier(group=_group())
