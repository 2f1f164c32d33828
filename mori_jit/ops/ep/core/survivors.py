"""How the ranks that are left agree and talk once some are masked (docs/design.md §6, "Rank
masking"): the survivors' agreement on the mask through the group's store, their own process
group, and the ``torch`` backend's exchanges over it.

**The rule.** A survivor's ``reset()`` after its mask changed publishes its view (the ranks it
masks) in the store of the op's group, under the reset's generation, then reads the view of every
rank it believes live, waiting at most twice ``MORI_EP_TIMEOUT_S`` for each; a rank whose view
does not arrive is masked too. The mask is the union of its own view and those it read. A second
round publishes each survivor's union and compares them: survivors that differ all raise
:class:`EpStateError` naming each view, so no two survivors serve with different masks. A rank
that finds itself in a peer's view raises instead (a masked rank takes no part). Every survivor
takes part in every such reset, so their generations agree: ``(full resets, survivor resets since
the last full one)``; a full reset (every rank, nothing masked) is the only way back in.

**The group.** ``torch.distributed.new_group`` is collective over the whole default group unless
``use_local_synchronization=True``, with which only its members rendezvous (through the default
store): that is what works while a rank is dead, so the survivors' group is made that way (its
name is a hash of its ranks; it is made once per process and set of ranks). Its store is the
default group's, so the process that hosts it (``MASTER_ADDR``'s, rank 0 with a ``TCPStore``)
must be a survivor, or the store must live outside the ranks.
"""
from __future__ import annotations

import datetime
import json
import time
from typing import Optional

import torch.distributed as dist

from mori_jit.ops.ep.core.watch import POLL_S, Exchange, host_timeout_s
from mori_jit.ops.ep.errors import EpPeerError, EpStateError

__all__ = ["survivors_group", "agree_on_mask", "masked_by_count", "LiveExchange"]

#: survivors' groups made in this process, by (backend, global ranks): a hashed name is made once
_GROUPS: dict = {}


def survivors_group(base, live: tuple[int, ...]):
    """The process group of ``live`` (ranks of ``base``), made among them alone (see the module)."""
    members = dist.get_process_group_ranks(base if base is not None else dist.group.WORLD)
    ranks = tuple(members[r] for r in live)
    backend = str(dist.get_backend(base))
    key = (backend, ranks)
    group = _GROUPS.get(key)
    if group is None:
        try:
            group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True,
                                   timeout=datetime.timedelta(seconds=host_timeout_s()))
        except Exception as e:  # noqa: BLE001 - a survivor that never came, a store that went away
            raise EpPeerError(f"the survivors' process group of ranks {list(live)} could not be made "
                              f"({type(e).__name__}: {e}); every survivor masks the same ranks before its "
                              f"next call") from e
        _GROUPS[key] = group
    return group


def _key(op_number: int, *parts) -> str:
    return "/".join(["mori_ep/mask", f"op{op_number}", *map(str, parts)])


def masked_by_count(store, op_number: int, rank: int, delta: int = 0) -> int:
    """How many ranks mask ``rank`` on op ``op_number`` (after adding ``delta``); 0 without a
    store (best effort: the store's host may be the dead peer)."""
    if store is None:
        return 0
    try:
        return int(store.add(_key(op_number, "masked", rank), delta))
    except Exception:  # noqa: BLE001
        return 0


def _read(store, key: str, deadline: float) -> Optional[list]:
    while True:
        if store.check([key]):
            return json.loads(store.get(key))
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def agree_on_mask(store, op_number: int, generation: tuple, rank: int, world_size: int,
                  masked: frozenset) -> frozenset:
    """The survivors' mask (the module's rule), from this rank's view ``masked``."""
    if store is None:
        raise EpStateError("the survivors agree on the mask through the process group's store, which this "
                           "torch build does not expose")
    prefix = ("reset",) + tuple(generation)
    store.set(_key(op_number, *prefix, "view", rank), json.dumps(sorted(masked)))
    union, by = set(masked), {}
    deadline = time.monotonic() + host_timeout_s()
    for p in range(world_size):
        if p == rank or p in masked:
            continue
        view = _read(store, _key(op_number, *prefix, "view", p), deadline)
        if view is None:
            union.add(p)  # (it did not arrive: dead or stalled)
            continue
        if rank in view:
            by.setdefault(rank, []).append(p)
        union.update(view)
    if by:
        raise EpStateError(f"reset: rank {rank} is masked by ranks {by[rank]}; it takes no part until every "
                           f"rank unmasks it (op.unmask_rank({rank})) and all reset together")
    store.set(_key(op_number, *prefix, "final", rank), json.dumps(sorted(union)))
    views = {rank: sorted(union)}
    deadline = time.monotonic() + host_timeout_s()
    for p in range(world_size):
        if p != rank and p not in union:
            view = _read(store, _key(op_number, *prefix, "final", p), deadline)
            views[p] = view if view is not None else "none within 2 x MORI_EP_TIMEOUT_S"
    if any(v != views[rank] for v in views.values()):
        raise EpStateError("reset: the survivors disagree on the masked ranks (" +
                           "; ".join(f"rank {p}: {v}" for p, v in sorted(views.items())) +
                           "); mask the same ranks on every survivor and reset again")
    return frozenset(union)


class LiveExchange(Exchange):
    """An :class:`Exchange` over the survivors' group that keeps the op's rank numbering: lists of
    ``world_size`` entries (by rank of the op's group) in, the live ranks' entries over the wire,
    a masked rank's gathered entry zero (it sends and receives nothing)."""

    def __init__(self, group, watch, what: str, expected: int, live: tuple[int, ...]):
        super().__init__(group, watch, what, expected)
        self._live = live

    def _splits(self, splits: list[int]) -> list[int]:
        dead = [r for r, c in enumerate(splits) if c and r not in self._live]
        if dead:
            raise EpStateError(f"{self._what}: rows for masked ranks {dead} (a masked rank sends and receives none)")
        return [splits[r] for r in self._live]

    def all_gather(self, outs: list, t) -> None:
        super().all_gather([outs[r] for r in self._live], t)
        for r, o in enumerate(outs):
            if r not in self._live:
                o.zero_()

    def all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int]) -> None:
        super().all_to_all(out, inp, self._splits(out_splits), self._splits(in_splits))

    def post_all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int]):
        return super().post_all_to_all(out, inp, self._splits(out_splits), self._splits(in_splits))
