"""SymmArena: one symmetric allocation per op, cut into named 256-byte-aligned regions.

Every rank allocates the same layout; a peer's region is ``peer_bases[pe] + offsets[name]``. Region
offsets and the rank are runtime kernel arguments, never Cfg fields (one binary serves every rank
and every layout). The memory itself comes from a :class:`~.symm_memory.MemoryProvider`: torch
symmetric memory, or IPC handles where ranks share a device (which torch symmetric memory refuses).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from mori_jit.ops.ep.memory.peers import barrier
from mori_jit.ops.ep.memory.symm import MemoryProvider, make_provider
from mori_jit.ops.ep.errors import EpArgumentError

__all__ = ["SymmArena", "ALIGN", "layout", "keep_until_exit"]

ALIGN = 256

# What a rank let go of without a collective release (see SymmArena.abandon): device memory that a
# peer's or this rank's kernel may still touch, referenced until the process exits.
_KEPT_UNTIL_EXIT: list = []


def keep_until_exit(*objs) -> None:
    """Reference ``objs`` until the process exits (memory a running kernel may still write)."""
    _KEPT_UNTIL_EXIT.append(objs)


def layout(region_bytes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Offsets of each region (declaration order, each 256-byte aligned) and the total size."""
    offsets, off = {}, 0
    for name, nbytes in region_bytes.items():
        if nbytes < 0:
            raise EpArgumentError(f"region {name!r}: negative size {nbytes}")
        offsets[name] = off
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets, max(off, ALIGN)


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
               provider: MemoryProvider | str = "torch", wait=None) -> "SymmArena":
        """Collective: allocate (``provider``: an instance or a kind, ``torch``/``ipc``), zero, and
        wait until every rank has zeroed before anyone writes. ``wait(work, what)`` bounds the
        collectives started here (the op's group watch; None: unbounded)."""
        offsets, total = layout(region_bytes)
        if isinstance(provider, str):
            provider = make_provider(provider)
        tensor, bases = provider.allocate(total, device, group, wait=wait)
        tensor.zero_()
        if len(bases) > 1:  # (one rank has no peer to wait for)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            barrier(group, wait, "the barrier after zeroing the arena at construction")
        return cls(tensor, offsets, dict(region_bytes), bases, provider)

    def view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A typed view of region ``name`` (``shape`` must fit in the region)."""
        off, size = self.offsets[name], self.sizes[name]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes > size:
            raise EpArgumentError(f"view of {name} as {dtype}{list(shape)} needs {nbytes} bytes; region has {size}")
        return self.tensor[off:off + nbytes].view(dtype).view(shape)

    def zero(self, *names: str) -> None:
        """Zero regions ``names`` on this rank (stream-ordered; the caller synchronizes ranks)."""
        self.fill(0, *names)

    def fill(self, byte: int, *names: str) -> None:
        """Set every byte of regions ``names`` on this rank to ``byte`` (stream-ordered)."""
        for n in names:
            self.tensor[self.offsets[n]:self.offsets[n] + self.sizes[n]].fill_(byte)

    def close(self, wait=None) -> None:
        """Collective: release the memory; the arena holds an empty tensor and no peer bases
        afterwards. Every rank drops its mappings of the peers' blocks before any owner frees its
        own (the IPC provider waits for the group in between; ``wait(work, what)`` bounds that wait,
        as at :meth:`create`)."""
        tensor, self.tensor, self.peer_bases = self.tensor, torch.empty(0, dtype=torch.uint8), []
        self.provider.release(tensor, wait=wait)

    def abandon(self) -> None:
        """Not collective: let go of the arena without releasing it; its memory (this rank's block
        and the peers' mappings) stays mapped until the process exits. For a rank that leaves on an
        exception: its peers may be anywhere (inside a kernel, a collective, or gone), so a
        collective release could wait forever, and freeing this rank's block alone could let a
        peer's kernel write into freed memory."""
        keep_until_exit(self.tensor, self.peer_bases, self.provider)
        self.tensor, self.peer_bases = torch.empty(0, dtype=torch.uint8), []
