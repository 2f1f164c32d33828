"""Where the symmetric arena's memory comes from: one block per rank, every rank's base known.

Two providers, chosen by ``EpDispatchCombineConfig.symm_memory`` (see :func:`.peers.memory_kind`):

* :class:`TorchSymmMemProvider`: torch symmetric memory (``empty`` + ``rendezvous``; multicast off).
  It refuses ranks that share a device.
* :class:`IpcMemoryProvider`: a plain device allocation per rank, opened by every peer through
  torch's own storage sharing (``_share_cuda_`` on the owner, ``_new_shared_cuda`` on each peer;
  CUDA IPC on NVIDIA, HIP IPC on ROCm), the handles exchanged with ``all_gather_object`` over the
  op's group (gloo included). Each peer's block is opened in this rank's own device context, so it
  serves ranks on one device (run on hardware) and ranks on P2P-connected devices of one host (not
  yet run on hardware). A group of one rank gets a plain allocation and no collective.

Lifetime: :meth:`MemoryProvider.release` is collective. A rank first drops its mappings of the
peers' blocks, then waits for the group, then frees its own block: no owner frees memory a peer
still maps, and torch's IPC bookkeeping finds every block released (no "producer terminated"
warning at exit).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from mori_jit.ops.ep.memory.peers import barrier, blocking_wait, gather_objects, host_id
from mori_jit.ops.ep.memory.torch_compat import torch_before
from mori_jit.ops.ep.errors import EpArgumentError, EpMemoryError

__all__ = ["MemoryProvider", "TorchSymmMemProvider", "IpcMemoryProvider", "make_provider", "check_peer_blocks"]


class MemoryProvider(Protocol):
    """Allocates ``nbytes`` of symmetric device memory; returns the local tensor and every rank's base."""

    kind: str

    def allocate(self, nbytes: int, device: torch.device, group, wait=None) -> tuple[torch.Tensor, list[int]]:
        """Collective: ``nbytes`` on ``device`` for every rank of ``group``; the local uint8 tensor
        and each rank's base address of its block (this rank's is the tensor's ``data_ptr``).
        ``wait(work, what)`` bounds the provider's own collectives where it starts them (None:
        unbounded); a rendezvous inside torch waits as torch does."""
        ...

    def release(self, tensor: torch.Tensor, wait=None) -> None:
        """Collective: drop the peers' mappings, then (after the group) this rank's block. No kernel
        may still use the memory. ``wait`` as at :meth:`allocate`."""
        ...


class TorchSymmMemProvider:
    """torch symmetric memory (``empty`` + ``rendezvous``), multicast left off."""

    kind = "torch"

    def allocate(self, nbytes: int, device: torch.device, group, wait=None) -> tuple[torch.Tensor, list[int]]:
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        name = group.group_name
        if torch_before(2, 9) and hasattr(symm_mem, "enable_symm_mem_for_group"):  # a deprecated no-op after
            symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, name)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        rank = dist.get_rank(group)
        # torch >= 2.10 may sub-allocate: the tensor can start inside the rendezvous'd block.
        delta = buf.data_ptr() - ptrs[rank]
        if delta:
            ptrs = [p + delta for p in ptrs]
        self._handle = handle  # keep the mapping alive as long as the tensor
        return buf, ptrs

    def release(self, tensor: torch.Tensor, wait=None) -> None:
        self._handle = None


def check_peer_blocks(blocks: list[tuple[str, int]]) -> None:
    """Raise RuntimeError unless every rank's block (``(host, bytes)``, by rank) is on one host and
    of one size: an IPC handle opens only on its own host, and peers index every block alike."""
    hosts = {h for h, _ in blocks}
    if len(hosts) > 1:
        where = "; ".join(f"rank {r}: {h}" for r, (h, _) in enumerate(blocks))
        raise EpMemoryError(f"IPC symmetric memory needs every rank on one host; the group spans {len(hosts)} ({where})")
    sizes = [n for _, n in blocks]
    if any(n != sizes[0] for n in sizes):
        raise EpMemoryError(f"IPC symmetric memory: ranks asked for different sizes {sizes} (bytes, by rank); "
                           f"every rank must lay out the same arena (compare the ranks' configs)")


class IpcMemoryProvider:
    """One plain allocation per rank, mapped into every peer through IPC handles (see the module)."""

    kind = "ipc"

    def __init__(self):
        self._group = None
        self._own: torch.Tensor | None = None
        self._peers: list[torch.UntypedStorage] = []

    def allocate(self, nbytes: int, device: torch.device, group, wait=None) -> tuple[torch.Tensor, list[int]]:

        group = group or dist.group.WORLD
        rank, ws = dist.get_rank(group), dist.get_world_size(group)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if ws == 1:  # no peer maps it: a plain allocation, and no collective (none is needed)
            self._group, self._own = group, buf
            return buf, [buf.data_ptr()]
        # One share per peer: each share gets its own reference counter in torch's IPC bookkeeping,
        # set to 1 and counted down when that one peer drops its mapping, so the block leaves the
        # owner's "in use by consumers" list only when every peer has let go. (Sharing once for
        # all peers counts one counter down ws - 1 times: the block never leaves that list, and
        # torch warns at exit that the producer terminated before its consumers released it.)
        # A share: (device index, handle, block size, offset in the block, ref-counter handle and
        # offset, event).
        shares = [None if pe == rank else buf.untyped_storage()._share_cuda_() for pe in range(ws)]
        cards = gather_objects(group, (host_id(), nbytes, shares), wait or blocking_wait,
                               "the exchange of IPC handles at construction")
        check_peer_blocks([(c[0], c[1]) for c in cards])
        bases = []
        for pe, (_, _, peer_shares) in enumerate(cards):
            if pe == rank:
                bases.append(buf.data_ptr())
                continue
            peer_meta = peer_shares[rank]
            # Opened in this rank's own device context (the meta's first item is the device the
            # handle is opened on): the mapping then lives where this rank's kernels run, with
            # peer access enabled to the owner's device when that is another GPU.
            storage = torch.UntypedStorage._new_shared_cuda(buf.device.index, *peer_meta[1:])
            if storage.nbytes() < nbytes:
                raise EpMemoryError(f"IPC symmetric memory: rank {pe}'s block maps {storage.nbytes()} bytes, "
                                   f"expected {nbytes}")
            self._peers.append(storage)
            bases.append(storage.data_ptr())
        self._group, self._own = group, buf
        return buf, bases

    def release(self, tensor: torch.Tensor, wait=None) -> None:
        if self._group is None:
            return
        if not self._peers:  # one rank: nothing shared
            self._own = self._group = None
            return
        self._peers.clear()  # unmap the peers' blocks (each storage's deleter closes its handle)
        # every peer has unmapped this rank's block
        barrier(self._group, wait, "the barrier of the arena's release at close")
        self._own = None
        self._group = None
        torch.cuda.ipc_collect()  # free this rank's block now that no peer holds it


def make_provider(kind: str) -> MemoryProvider:
    """A fresh provider of ``kind`` (``torch``, ``ipc``, or ``nvshmem``: the internode arena)."""
    from mori_jit.ops.ep.memory.nvshmem import NvshmemProvider
    providers = {"torch": TorchSymmMemProvider, "ipc": IpcMemoryProvider, "nvshmem": NvshmemProvider}
    if kind not in providers:
        raise EpArgumentError(f"symmetric memory provider {kind!r}: allowed {tuple(providers)}")
    return providers[kind]()
