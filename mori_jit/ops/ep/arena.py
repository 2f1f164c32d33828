"""SymmArena: one symmetric allocation per op, cut into named 256-byte-aligned regions.

Every rank allocates the same layout; a peer's region is ``peer_bases[pe] + offsets[name]``. Region
offsets and the rank are runtime kernel arguments, never Cfg fields (one binary serves every rank
and every layout). The memory itself comes from a small :class:`MemoryProvider` so that a
``hipIpc``/``cudaIpc`` provider can replace torch symmetric memory where the latter misbehaves.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol

import torch
import torch.distributed as dist

__all__ = ["SymmArena", "MemoryProvider", "TorchSymmMemProvider", "ALIGN", "layout"]

ALIGN = 256


def layout(region_bytes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Offsets of each region (declaration order, each 256-byte aligned) and the total size."""
    offsets, off = {}, 0
    for name, nbytes in region_bytes.items():
        if nbytes < 0:
            raise ValueError(f"region {name!r}: negative size {nbytes}")
        offsets[name] = off
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, max(off, ALIGN)


class MemoryProvider(Protocol):
    """Allocates ``nbytes`` of symmetric device memory; returns the local tensor and every rank's base."""

    def allocate(self, nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, list[int]]:
        """Collective: ``nbytes`` on ``device`` for every rank of ``group``; the local uint8 tensor
        and each rank's base address of its block (this rank's is the tensor's ``data_ptr``)."""
        ...

    def release(self, tensor: torch.Tensor) -> None:
        """Drop what keeps ``tensor``'s mapping alive (no kernel may still use it)."""
        ...


class TorchSymmMemProvider:
    """torch symmetric memory (``empty`` + ``rendezvous``), multicast left off."""

    def allocate(self, nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, list[int]]:
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op after
            try:
                symm_mem.enable_symm_mem_for_group(name)
            except Exception:  # noqa: BLE001 - deprecated paths may warn or raise once enabled
                pass
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

    def release(self, tensor: torch.Tensor) -> None:
        self._handle = None


@dataclasses.dataclass
class SymmArena:
    """A symmetric arena: ``tensor`` (local bytes), ``offsets``, ``peer_bases`` (by rank)."""

    tensor: torch.Tensor
    offsets: dict[str, int]
    sizes: dict[str, int]
    peer_bases: list[int]
    provider: MemoryProvider

    @classmethod
    def create(cls, region_bytes: Mapping[str, int], group, device: torch.device,
               provider: MemoryProvider | None = None) -> "SymmArena":
        """Collective: allocate, zero, and wait until every rank has zeroed before anyone writes."""
        offsets, total = layout(region_bytes)
        provider = provider or TorchSymmMemProvider()
        tensor, bases = provider.allocate(total, device, group)
        tensor.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        return cls(tensor, offsets, dict(region_bytes), bases, provider)

    def view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A typed view of region ``name`` (``shape`` must fit in the region)."""
        off, size = self.offsets[name], self.sizes[name]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes > size:
            raise ValueError(f"view of {name} as {dtype}{list(shape)} needs {nbytes} bytes; region has {size}")
        return self.tensor[off:off + nbytes].view(dtype).view(shape)

    def zero(self, *names: str) -> None:
        """Zero regions ``names`` on this rank (stream-ordered; the caller synchronizes ranks)."""
        self.fill(0, *names)

    def fill(self, byte: int, *names: str) -> None:
        """Set every byte of regions ``names`` on this rank to ``byte`` (stream-ordered)."""
        for n in names:
            self.tensor[self.offsets[n]:self.offsets[n] + self.sizes[n]].fill_(byte)

    def close(self) -> None:
        """Release the memory; the arena holds an empty tensor and no peer bases afterwards."""
        self.provider.release(self.tensor)
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.peer_bases = []
