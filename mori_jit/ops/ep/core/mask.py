"""Rank masking: the op keeps serving when a rank is lost (docs/design.md §6, "Rank masking").

A mask of ranks lives on the device (int32 ``[world_size]``, 1 = masked: DeepEP's convention for
its ``mask_buffer``), and every call reads it there, so a graph captured before a change replays
with the change. A masked rank's experts are dropped as an id of -1 is (the combine sums the live
ranks only; expert counts and the expert-major layout count the live ranks' pairs), the op counts
the (token, expert) pairs each dispatch dropped for a masked rank (:attr:`MaskSurface.masked_pairs`,
a device counter: no sync), and no kernel waits for, sends to or reads from a masked rank.

Masking is local to the rank that calls it (a write on the device, on the current stream): every
survivor masks the same ranks before its next call. ``reset()`` after a change runs among the
survivors (:mod:`.survivors` says how they agree); a masked rank is refused by the survivors'
reset and by its own until every survivor unmasks it and all ranks reset together.
``MORI_EP_MASK_ON_TIMEOUT=1`` masks the peer a kernel's timed-out wait names, when its
``EpDeviceError`` is raised.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from mori_jit.ops.ep import knobs
from mori_jit.ops.ep.core.survivors import LiveExchange, agree_on_mask, masked_by_count, survivors_group
from mori_jit.ops.ep.core.watch import Exchange, _store_of, watch_of
from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError, EpStateError, EpUnsupportedError

__all__ = ["RankMask", "MaskSurface"]

_log = logging.getLogger(__name__)


class RankMask:
    """One op's mask: the ranks it masks, the device tensors its backend reads, and the group and
    watch its host collectives run on (the op's group until a rank is masked, then the survivors')."""

    def __init__(self, op):
        self._op, self.rank, self.world_size = op, op.cfg.rank, op.cfg.world_size
        self.tensor: Optional[torch.Tensor] = op._kernels.rank_mask
        self.pairs: Optional[torch.Tensor] = op._kernels.masked_pairs
        self.masked: frozenset = frozenset()
        self._base, self._base_watch = op.group, op._watch
        self._store = _store_of(op.group) if op.cfg.world_size > 1 else None
        self._group, self._watch, self._of = op.group, op._watch, frozenset()  # (the group's mask)
        self._changed = False  # the mask changed since the last reset
        self._full_resets = self._survivor_resets = 0  # the survivors' reset generation

    @property
    def live(self) -> tuple[int, ...]:
        """The op's ranks that are not masked, ascending."""
        return tuple(r for r in range(self.world_size) if r not in self.masked)

    def collective(self):
        """``(group, watch)`` of the op's host collectives now (the survivors' group is made on the
        first call after a change: a collective among them alone)."""
        if self._of != self.masked:
            if self.masked:
                self._group = survivors_group(self._base, self.live)
                self._watch = watch_of(self._group)
            else:
                self._group, self._watch = self._base, self._base_watch
            self._of = self.masked
        return self._group, self._watch

    def exchange(self, what: str, expected: int) -> Exchange:
        """The ``torch`` backend's collectives of one call (see :class:`.survivors.LiveExchange`)."""
        group, watch = self.collective()
        if not self.masked:
            return Exchange(group, watch, what, expected)
        return LiveExchange(group, watch, what, expected, self.live)

    def set(self, r, masked: bool) -> None:
        """Mask (or unmask) rank ``r`` here: the device tensor is written on the current stream."""
        if isinstance(r, bool) or not isinstance(r, int):
            raise EpArgumentTypeError(f"rank={r!r}: expected an int rank of the op's group")
        if not 0 <= r < self.world_size:
            raise EpArgumentError(f"rank={r}: outside the op's group [0, {self.world_size})")
        if r == self.rank:
            raise EpArgumentError(f"rank={r}: a rank does not mask itself (its peers mask it)")
        if self.tensor is None:
            why = self._op._kernels.mask_refusal or (f"{type(self._op).__name__} does not serve it; the hip kernels "
                                                     f"(intranode, and internode_kernel='v2_ll') and the torch "
                                                     f"backend do")
            raise EpUnsupportedError(f"rank masking (mask_rank({r})): {why}")
        if masked == (r in self.masked):
            return
        self.masked = self.masked | {r} if masked else self.masked - {r}
        self.tensor[r] = int(masked)
        self._changed = True
        masked_by_count(self._store, self._op._number, r, 1 if masked else -1)

    def saw_timeout(self, peer: Optional[int]) -> None:
        """A kernel's wait for ``peer`` timed out: mask it when ``MORI_EP_MASK_ON_TIMEOUT`` says so."""
        if (peer is not None and knobs.ep.mask_on_timeout and self.tensor is not None and peer != self.rank
                and 0 <= peer < self.world_size and peer not in self.masked):
            _log.warning("rank %d masks rank %d, whose wait timed out (MORI_EP_MASK_ON_TIMEOUT)", self.rank, peer)
            self.set(peer, True)

    def before_reset(self):
        """``(group, watch)`` the reset runs on: a masked rank is refused; after a change the
        survivors agree on the mask first (:func:`.survivors.agree_on_mask`)."""
        by = masked_by_count(self._store, self._op._number, self.rank)
        if by > 0:
            raise EpStateError(f"reset: rank {self.rank} is masked by {by} rank(s); it takes no part until every "
                               f"rank unmasks it (op.unmask_rank({self.rank})) and all reset together")
        if self.masked and self._changed:
            agreed = agree_on_mask(self._store, self._op._number, (self._full_resets, self._survivor_resets),
                                   self.rank, self.world_size, self.masked)
            for r in sorted(agreed - self.masked):
                self.set(r, True)
        return self.collective()

    def after_reset(self) -> None:
        """The reset is done on every rank it ran on: its generation advances, and the op's
        dispatch numbers restart (a rank back from the mask has made fewer)."""
        if self.masked:
            self._survivor_resets += 1
        else:
            self._full_resets, self._survivor_resets = self._full_resets + 1, 0
        self._changed = False
        self._op._dispatches = self._op._routing_no = 0


class MaskSurface:
    """The op's masking calls, under its own names and DeepEP's (``update_mask_buffer``,
    ``query_mask_buffer``, ``clean_mask_buffer``): one mechanism, :class:`RankMask`."""

    _rank_mask: RankMask

    def _open_mask(self) -> RankMask:
        self._refuse_closed()  # (a closed op let go of its mask with its group)
        return self._rank_mask

    def mask_rank(self, rank: int) -> None:
        """Mask ``rank``: from the next call on, this rank's kernels drop the tokens routed to its
        experts and neither send to nor wait for it. Local (every survivor calls it); ``reset()``
        after a failure then runs among the survivors."""
        self._open_mask().set(rank, True)

    def unmask_rank(self, rank: int) -> None:
        """Unmask ``rank``; once every rank has, a reset of every rank takes it back."""
        self._open_mask().set(rank, False)

    @property
    def active_ranks(self) -> tuple[int, ...]:
        """The ranks this rank does not mask, ascending."""
        return self._open_mask().live

    @property
    def rank_mask(self) -> Optional[torch.Tensor]:
        """int32 ``[world_size]`` on the op's device, 1 = masked: what the kernels read (do not write
        it: :meth:`mask_rank` keeps the host's view with it). None where masking is not served."""
        return self._open_mask().tensor

    @property
    def masked_pairs(self) -> Optional[torch.Tensor]:
        """int32 ``[1]`` on the op's device: the (token, expert) pairs of this rank's latest dispatch
        that were dropped because their expert's rank is masked (reading it on the host syncs)."""
        return self._open_mask().pairs

    def update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's name: mask ``rank_to_mask`` (``mask=True``) or unmask it."""
        self._open_mask().set(rank_to_mask, bool(mask))

    def query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """DeepEP's name: copy the mask (int32 ``[world_size]``, 1 = masked) into ``mask_status``."""
        if self._open_mask().tensor is None:
            raise EpUnsupportedError(f"{type(self).__name__} does not serve rank masking")
        mask_status.copy_(self._open_mask().tensor, non_blocking=True)

    def clean_mask_buffer(self) -> None:
        """DeepEP's name: unmask every rank."""
        for r in sorted(self._open_mask().masked):
            self._open_mask().set(r, False)
