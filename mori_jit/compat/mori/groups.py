"""Which torch process group a mori object runs on.

mori's v1 op takes no group: it runs on the group ``mori.shmem.shmem_torch_process_group_init``
registered (:func:`register`), else on WORLD. mori's ``Communicator.init(nranks, rank, uid)``
names no group either: :func:`resolve` finds the one where this process is ``rank`` of ``nranks``
and whose rank 0 made ``uid``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from mori_jit.ops.ep import EpArgumentError, EpStateError

__all__ = ["register", "registered", "v1_group", "resolve"]

# The name mori.shmem registered its group under (at most one). The name, not the group: a group
# held here would outlive dist.destroy_process_group and be freed at interpreter exit, where freeing
# a process group can abort the process (std::terminate) after its work is done.
_REGISTERED: list[str] = []


def _require_dist(what: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise EpStateError(f"{what}: torch.distributed is not initialized; mori-jit's op runs on a torch process "
                           f"group (dist.init_process_group first)")


def register(group_name: Optional[str]) -> None:
    """Make the group torch has registered under ``group_name`` the one mori's v1 op runs on
    (None: forget it)."""
    _REGISTERED[:] = [group_name] if group_name is not None else []


def registered():
    """The group :func:`register` named, as torch resolves the name now; None when none is named or
    torch no longer knows the name (``dist.destroy_process_group`` unregisters every group)."""
    if not _REGISTERED:
        return None
    try:
        return torch._C._distributed_c10d._resolve_process_group(_REGISTERED[0])
    except (RuntimeError, ValueError):
        return None


def v1_group():
    """The group a v1 op (``mori.ops.EpDispatchCombineOp(config)``) runs on: the registered one, else WORLD."""
    _require_dist("mori.ops.EpDispatchCombineOp")
    return registered() or dist.group.WORLD


def _known_groups() -> list:
    """Every process group torch knows this process is in (torch's own table; empty if it moved)."""
    try:
        from torch.distributed import distributed_c10d
        return list(distributed_c10d._world.pg_group_ranks)
    except AttributeError:
        return []


def _fits(group, nranks: int, rank: int, root: Optional[int]) -> bool:
    try:
        return (dist.get_world_size(group) == nranks and dist.get_rank(group) == rank
                and (root is None or dist.get_global_rank(group, 0) == root))
    except (RuntimeError, ValueError):  # (a group this process is not in)
        return False


def resolve(nranks: int, rank: int, root: Optional[int]):
    """The group a ``Communicator`` of ``nranks`` ranks, this process being ``rank``, runs on:
    the registered group, else WORLD, else the one group torch knows that fits (several groups of
    the same members are one choice: the one of WORLD's backend is taken). ``root``: the global
    rank that made the communicator's unique id (None: unknown)."""
    _require_dist("Communicator.init")
    for group in (registered(), dist.group.WORLD):
        if group is not None and _fits(group, nranks, rank, root):
            return group
    fits = [g for g in _known_groups() if _fits(g, nranks, rank, root)]
    members = {tuple(dist.get_process_group_ranks(g)) for g in fits}
    if len(members) == 1:
        backend = dist.get_backend()
        return next((g for g in fits if dist.get_backend(g) == backend), fits[0])
    made = f" whose rank 0 is global rank {root}" if root is not None else ""
    if not members:
        raise EpArgumentError(f"Communicator.init(nranks={nranks}, rank={rank}): no torch process group has this "
                              f"process as rank {rank} of {nranks}{made}; create one, or register it with "
                              f"mori.shmem.shmem_torch_process_group_init(name)")
    raise EpArgumentError(f"Communicator.init(nranks={nranks}, rank={rank}): several torch process groups fit "
                          f"(global ranks {sorted(members)}); register the one to use with "
                          f"mori.shmem.shmem_torch_process_group_init(name)")
