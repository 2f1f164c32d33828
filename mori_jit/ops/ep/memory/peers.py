"""What the ranks of an EP group learn about each other at construction, in one bounded exchange.

Every rank contributes a :class:`RankCard` (its host, its device's UUID, whether torch symmetric
memory is usable, its config); :func:`gather_cards` exchanges them over the op's group (any backend,
gloo included) in two asynchronous ``all_gather`` calls whose waits the caller bounds (a peer that
never constructs its op makes the others raise, not hang). Everything derived from the cards is a
pure function of the full list, so every rank reaches the same decision:

* :func:`ranks_sharing_device`: how many ranks of the group run on this rank's GPU. Co-located
  ranks share its SMs/CUs: each rank sizes and clamps its grids to its share, so that every rank's
  grid is resident beside the others (the kernels spin-wait on their peers).
* :func:`config_mismatch`: the first config field on which two ranks disagree (a different
  ``hidden_dim`` or expert count would misroute or crash later, far from the cause).
* :func:`memory_kind`: which provider backs the symmetric arena (``EpDispatchCombineConfig.symm_memory``).
"""
from __future__ import annotations

import dataclasses
import functools
import pickle
import socket
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from mori_jit.ops.ep.config_rules import SYMM_MEMORY_KINDS
from mori_jit.ops.ep.errors import EpArgumentError

__all__ = ["RankCard", "gather_cards", "gather_objects", "blocking_wait", "barrier", "collective_device", "host_id",
           "ranks_sharing_device", "config_mismatch", "memory_kind"]



@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This machine's identity: host name and kernel boot id (two containers may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _torch_symm_mem_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return False
    return True


@dataclasses.dataclass(frozen=True)
class RankCard:
    """One rank's facts. ``device`` is the UUID of its GPU (None on the CPU); ``config`` its
    ``EpDispatchCombineConfig``."""

    rank: int
    host: str
    device: Optional[str]
    torch_symm_mem: bool
    config: Any

    @classmethod
    def local(cls, rank: int, device: torch.device, config: Any) -> "RankCard":
        """This process's card for ``device``."""
        uuid = None
        if device.type == "cuda":
            uuid = str(torch.cuda.get_device_properties(device).uuid)
        return cls(rank, host_id(), uuid, _torch_symm_mem_usable(device), config)


def collective_device(group) -> torch.device:
    """Where the tensors of a host collective on ``group`` live: the CPU for gloo, the current GPU
    otherwise (NCCL moves only device memory)."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def blocking_wait(work, what: str) -> None:
    """``wait(work, what)`` without a bound (a caller with no group watch)."""
    work.wait()


def barrier(group, wait: Optional[Callable[[Any, str], None]], what: str) -> None:
    """Collective: ``dist.barrier`` on ``group``, started with ``async_op=True`` and handed to
    ``wait(work, what)``, which bounds it (None: :func:`blocking_wait`)."""
    (wait or blocking_wait)(dist.barrier(group=group, async_op=True), what)


def gather_objects(group, obj: Any, wait: Callable[[Any, str], None], what: str) -> list:
    """Collective: every rank's picklable ``obj``, by rank.

    Two ``all_gather`` calls (the pickled objects' sizes, then the objects padded to the largest),
    each started with ``async_op=True`` and handed to ``wait(work, what)``, which bounds it (the op's
    :meth:`GroupWatch.wait <mori_jit.ops.ep.core.watch.GroupWatch.wait>`; ``what`` names the
    exchange in its errors). ``all_gather_object`` would wait without a bound."""
    ws = dist.get_world_size(group)
    device = collective_device(group)
    blob = pickle.dumps(obj)
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(ws)]
    wait(dist.all_gather(sizes, size, group=group, async_op=True), what)
    counts = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(counts), dtype=torch.uint8)
    mine[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    mine = mine.to(device)
    outs = [torch.empty_like(mine) for _ in range(ws)]
    wait(dist.all_gather(outs, mine, group=group, async_op=True), what)
    return [pickle.loads(o.cpu().numpy().tobytes()[:n]) for o, n in zip(outs, counts)]


def gather_cards(group, card: RankCard, wait: Callable[[Any, str], None]) -> list[RankCard]:
    """Collective: every rank's card, by rank (one rank: its own, without a collective), in
    :func:`gather_objects`' bounded exchange."""
    if dist.get_world_size(group) == 1:
        return [card]
    return gather_objects(group, card, wait, "the exchange of the ranks' cards at construction")


def ranks_sharing_device(cards: Sequence[RankCard], rank: int) -> int:
    """How many ranks (this one included) run on ``rank``'s GPU (same host, same device UUID)."""
    me = cards[rank]
    if me.device is None:
        return 1
    return sum(1 for c in cards if c.host == me.host and c.device == me.device)


def config_mismatch(cards: Sequence[RankCard]) -> Optional[str]:
    """None when every rank has the same config, fields marked ``per_rank`` (the rank, the
    geometry) aside; else one line naming the first field that differs and each rank's value."""
    for f in dataclasses.fields(cards[0].config):
        if f.metadata.get("per_rank"):
            continue
        values = [getattr(k.config, f.name) for k in cards]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {k.rank}: {v!r}" for k, v in zip(cards, values))
            return (f"EpDispatchCombineConfig.{f.name} differs between ranks ({per_rank}); every rank must pass "
                    f"the same {f.name}")
    return None


def memory_kind(requested: str, cards: Sequence[RankCard]) -> str:
    """The provider for the arena: ``requested`` unless ``auto``, which takes ``torch`` only when
    there are peers, no two ranks share a device and torch symmetric memory is usable on every
    rank, else ``ipc`` (for one rank a plain allocation: nothing is shared, and it spares torch
    symmetric memory's start-up).
    Raises ValueError for a request that cannot work (``torch`` with ranks on one device, which
    torch symmetric memory refuses; ``ipc`` across hosts)."""
    if requested not in SYMM_MEMORY_KINDS:
        raise EpArgumentError(f"EpDispatchCombineConfig.symm_memory={requested!r}: allowed {SYMM_MEMORY_KINDS}")
    shared = any(ranks_sharing_device(cards, c.rank) > 1 for c in cards)
    if requested == "auto":
        usable = len(cards) > 1 and not shared and all(c.torch_symm_mem for c in cards)
        requested = "torch" if usable else "ipc"
    if requested == "torch" and shared:
        pairs = [c.rank for c in cards if ranks_sharing_device(cards, c.rank) > 1]
        raise EpArgumentError(f"EpDispatchCombineConfig.symm_memory='torch': ranks {pairs} share a device, which torch "
                         f"symmetric memory refuses; use 'ipc' or 'auto'")
    if requested == "ipc":
        hosts = sorted({c.host for c in cards})
        if len(hosts) > 1:
            where = "; ".join(f"{h}: ranks {[c.rank for c in cards if c.host == h]}" for h in hosts)
            raise EpArgumentError(f"EpDispatchCombineConfig.symm_memory='ipc' needs every rank on one host; the group "
                             f"spans {len(hosts)} ({where})")
    return requested
