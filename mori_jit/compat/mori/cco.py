"""``mori.cco``: mori's ``Communicator`` on ``torch.distributed``.

The serving engines make one and hand it to the op (``EpDispatchCombineOp(cfg, comm)``):
``Communicator.get_unique_id()`` on rank 0, the id broadcast, ``Communicator.init(nranks, rank,
uid, per_rank_vmm=...)`` on every rank, later ``comm.barrier()``. Here the communicator is the torch
process group it finds for those ranks (:func:`.groups.resolve`), held as ``process_group``: the
attribute by which the op takes it for a group. mori-jit's op allocates its own symmetric memory,
so ``per_rank_vmm`` reserves nothing, and the memory/window/device-communicator calls of mori's
communicator are refused by name.
"""
from __future__ import annotations

import os
import struct
from typing import Optional

import torch.distributed as dist

from mori_jit.compat.mori import groups
from mori_jit.ops.ep import EpArgumentTypeError, EpStateError, EpUnsupportedError

__all__ = ["UniqueId", "get_unique_id", "Communicator"]

_MAGIC = b"mori-jit"
_NO_ROOT = -1


class UniqueId:
    """A communicator's rendezvous token: random bytes and the global rank of the process that made
    it (what tells the ranks' group apart from others of the same size). Picklable, and bytes."""

    def __init__(self, nonce: bytes, root: Optional[int]):
        self.nonce, self.root = nonce, root

    def __bytes__(self) -> bytes:
        return _MAGIC + self.nonce + struct.pack("<i", _NO_ROOT if self.root is None else self.root)

    @staticmethod
    def from_bytes(b) -> "UniqueId":
        """The id whose ``bytes()`` are ``b``."""
        b = bytes(b)
        if not b.startswith(_MAGIC) or len(b) != len(_MAGIC) + 16 + 4:
            raise EpArgumentTypeError("unique_id: not the bytes of a mori_jit.compat.mori.cco.UniqueId")
        root = struct.unpack("<i", b[-4:])[0]
        return UniqueId(b[len(_MAGIC):-4], None if root == _NO_ROOT else root)

    def __eq__(self, other) -> bool:
        return isinstance(other, UniqueId) and bytes(self) == bytes(other)

    def __hash__(self) -> int:
        return hash(bytes(self))

    def __repr__(self) -> str:
        return f"<UniqueId: {self.nonce[:4].hex()}... root={self.root}>"


def get_unique_id() -> UniqueId:
    """A new rendezvous token (rank 0 makes it, then broadcasts it to the others)."""
    root = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    return UniqueId(os.urandom(16), root)


class Communicator:
    """mori's communicator, backed by a torch process group (``process_group``)."""

    #: mori's default per-rank VMM reservation (accepted; mori-jit's op sizes its own memory)
    DEFAULT_PER_RANK_VMM: int = 4 * 1024 ** 3

    def __init__(self, process_group=None, nranks: int = 0, rank: int = -1):
        self._group, self._nranks, self._rank = process_group, nranks, rank

    @staticmethod
    def get_unique_id() -> UniqueId:
        """A new rendezvous token (on rank 0)."""
        return get_unique_id()

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id, per_rank_vmm: int = DEFAULT_PER_RANK_VMM) -> "Communicator":
        """Collective in mori; here a lookup: the communicator of the torch group where this process
        is ``rank`` of ``nranks`` and whose rank 0 made ``unique_id`` (a :class:`UniqueId` or its bytes)."""
        if not isinstance(unique_id, UniqueId):
            if not isinstance(unique_id, (bytes, bytearray, memoryview)):
                raise EpArgumentTypeError(f"unique_id: expected a UniqueId (Communicator.get_unique_id()) or its "
                                          f"bytes, got {type(unique_id).__name__}")
            unique_id = UniqueId.from_bytes(unique_id)
        return cls(groups.resolve(nranks, rank, unique_id.root), nranks, rank)

    def _valid(self, what: str):
        if self._group is None:
            raise EpStateError(f"Communicator.{what}: the communicator is destroyed (or was never init())")
        return self._group

    @property
    def process_group(self):
        """The torch process group this communicator runs on (what the op takes for its group)."""
        return self._valid("process_group")

    @property
    def is_valid(self) -> bool:
        """Whether the communicator is usable (made by :meth:`init`, not destroyed)."""
        return self._group is not None

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        self._valid("rank")
        return self._rank

    @property
    def nranks(self) -> int:
        """Ranks in the communicator."""
        self._valid("nranks")
        return self._nranks

    def barrier(self) -> None:
        """Collective: wait until every rank has reached it (``dist.barrier`` on the group)."""
        dist.barrier(group=self._valid("barrier"))

    def destroy(self) -> None:
        """Forget the group (it stays torch's: the communicator did not create it)."""
        self._group = None

    def close_all_resources(self) -> None:
        """Nothing to close: the communicator holds no memory of its own."""

    def _refuse(self, what: str):
        raise EpUnsupportedError(f"Communicator.{what}: mori-jit's communicator holds no symmetric memory or windows "
                                 f"(its op allocates its own); only init, barrier and the op's group are served")

    def alloc_mem(self, size: int):
        """Refused: see the module's doc."""
        self._refuse("alloc_mem")

    def register_window(self, ptr: int, size: int):
        """Refused: see the module's doc."""
        self._refuse("register_window")

    def register_external_window(self, ext_ptr: int, size: int):
        """Refused: see the module's doc."""
        self._refuse("register_external_window")

    def create_dev_comm(self, requirements=None):
        """Refused: see the module's doc."""
        self._refuse("create_dev_comm")

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        if self._group is None:
            return "<Communicator: destroyed>"
        return f"<Communicator: rank={self._rank}/{self._nranks} on {dist.get_backend(self._group)}>"
