"""The internode arena's memory: NVSHMEM's symmetric heap, through torch's NVSHMEM backend.

torch's symmetric memory with the ``NVSHMEM`` backend bootstraps NVSHMEM with a unique id
exchanged over the default group's store (any backend, gloo included), allocates with
``nvshmem_malloc`` (collective: every rank gets the same offset in its heap, so this rank's address
of an object is the symmetric address the engine's device calls take) and exposes each peer's block
where loads and stores reach it (``nvshmem_ptr``; 0 where only puts do). Kernels linked against
NVSHMEM join that same instance through ``nvshmemx_cumodule_init`` (:mod:`mori_jit.jit.nvshmem`).

Facts this relies on (docs/design.md §11): the backend is process-wide and is chosen before the
process's first symmetric allocation; the engine's PEs are the default group's ranks, so the op's
group must be the whole default group; several PEs on one GPU need CUDA MPS with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set in each process so that the sum is at most 100.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mori_jit.ops.ep.memory.peers import barrier
from mori_jit.ops.ep.memory.torch_compat import torch_before
from mori_jit.ops.ep.errors import EpMemoryError

__all__ = ["NvshmemProvider", "nvshmem_gap", "BACKEND"]

#: torch's name of the backend
BACKEND = "NVSHMEM"


def nvshmem_gap(group=None) -> str | None:
    """Why the NVSHMEM arena cannot serve ``group`` in this process (None when it can)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:  # pragma: no cover - torch builds without distributed
        return f"torch.distributed._symmetric_memory is missing ({e})"
    if not hasattr(symm_mem, "set_backend"):
        return f"torch {torch.__version__} has no symmetric-memory backends (torch >= 2.8 has NVSHMEM)"
    available = getattr(symm_mem, "is_nvshmem_available", None)
    if available is None or not available():
        return (f"NVSHMEM is not available to torch {torch.__version__} (a CUDA build with NVSHMEM and the "
                f"nvidia-nvshmem wheel are needed)")
    group = group or dist.group.WORLD
    if (dist.get_world_size(group), dist.get_rank(group)) != (dist.get_world_size(), dist.get_rank()):
        return (f"the op's group (rank {dist.get_rank(group)} of {dist.get_world_size(group)}) is not the whole "
                f"default group (rank {dist.get_rank()} of {dist.get_world_size()}): NVSHMEM's PEs are the default "
                f"group's ranks")
    return None


class NvshmemProvider:
    """NVSHMEM symmetric memory through torch's ``NVSHMEM`` symmetric-memory backend."""

    kind = "nvshmem"

    def __init__(self):
        self._handle = None
        self._group = None

    def allocate(self, nbytes: int, device: torch.device, group, wait=None) -> tuple[torch.Tensor, list[int]]:
        """Collective: ``nbytes`` of NVSHMEM symmetric memory on every rank; the local tensor and
        each rank's base where this rank reaches it with loads and stores (0 where only puts do)."""
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        why = nvshmem_gap(group)
        if why:
            raise EpMemoryError(f"NVSHMEM arena: {why}")
        _use_nvshmem_backend(symm_mem, device)
        if torch_before(2, 9) and hasattr(symm_mem, "enable_symm_mem_for_group"):  # (a no-op after)
            symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)  # NVSHMEM bootstraps over its store
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        rank = dist.get_rank(group)
        pe = getattr(handle, "rank", rank)
        if pe != rank:
            raise EpMemoryError(f"NVSHMEM arena: rank {rank} of the op's group is NVSHMEM PE {pe}; the kernels "
                               f"address peers by rank")
        ptrs = [int(p) for p in handle.buffer_ptrs]
        delta = buf.data_ptr() - ptrs[rank]  # (a sub-allocation starts inside the rendezvous'd block)
        self._handle, self._group = handle, group  # keep the mapping alive as long as the tensor
        return buf, [p + delta if p else 0 for p in ptrs]

    def release(self, tensor: torch.Tensor, wait=None) -> None:
        """Collective: wait for the device and the group, then drop the handle. The block goes back
        to NVSHMEM when its last tensor dies (``nvshmem_free`` is collective in NVSHMEM: every rank
        drops its views of an op, such as dispatch outputs, at the same point of its program)."""
        if self._handle is None:
            return
        torch.cuda.synchronize(tensor.device if tensor.is_cuda else None)
        barrier(self._group, wait, "the barrier of the arena's release at close")
        self._handle = self._group = None


_BACKEND_CHOSEN = False


def _use_nvshmem_backend(symm_mem, device: torch.device) -> None:
    """Make NVSHMEM torch's symmetric-memory backend in this process (once: the choice is
    process-wide and fixed by the first symmetric allocation)."""
    global _BACKEND_CHOSEN
    if _BACKEND_CHOSEN:
        return
    get = getattr(symm_mem, "get_backend", None)
    current = get(device) if get is not None else None
    if current != BACKEND:
        try:
            symm_mem.set_backend(BACKEND)
        except RuntimeError as e:
            raise EpMemoryError(f"NVSHMEM arena: torch's symmetric memory of this process already uses the "
                               f"{current!r} backend, and the backend cannot change after an allocation "
                               f"(an intranode op with symm_memory='torch' made one); build internode ops "
                               f"first or give intranode ops symm_memory='ipc' ({e})") from None
    _BACKEND_CHOSEN = True
