"""``Schedule``: which geometry each leg of the EP op launches, by token-count bucket.

Backend-neutral: the op picks a bucket by the call's token count (:meth:`Schedule.index`), or by a
geometry the call names (:meth:`Schedule.find`); a backend fills the geometries (the ``hip``
backend from :mod:`mori_jit.ops.ep.backends.hip.intranode.tuning`).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

__all__ = ["Schedule"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Merged buckets: ``edges[i]`` is the inclusive max token count of bucket i (None = no limit).

    ``groups`` (None: every bucket's) names, per bucket, the protocol its kernels speak: a call may
    launch another bucket's variant only within its own bucket's group (the internode families
    ``v2`` and ``v2_ll`` are two groups; every rank of one call must speak the same one).
    """

    edges: tuple[Optional[int], ...]
    dispatch: tuple[tuple[int, int], ...]
    combine: tuple[tuple[int, int], ...]
    groups: Optional[tuple[str, ...]] = None

    def __post_init__(self):
        object.__setattr__(self, "_finite", [e for e in self.edges if e is not None])

    def index(self, num_tokens: int) -> int:
        """Bucket index for ``num_tokens`` (the last bucket covers everything above)."""
        return bisect.bisect_left(self._finite, num_tokens)

    def find(self, leg: str, num_tokens: int, blocks: int, warps: int) -> Optional[int]:
        """The bucket a call of ``num_tokens`` tokens launches when it names the geometry ``(blocks,
        warps)`` of ``leg`` (``"dispatch"`` or ``"combine"``; a value ``<= 0`` matches any): its own
        bucket if that geometry is its own, else the first bucket of its group that has it; None
        when no built variant has it (nothing is compiled for a call)."""
        geos = self.dispatch if leg == "dispatch" else self.combine
        own = self.index(num_tokens)
        candidates = [own] + [i for i in range(len(geos)) if i != own]
        for i in candidates:
            b, w = geos[i]
            if (blocks <= 0 or b == blocks) and (warps <= 0 or w == warps) and \
                    (self.groups is None or self.groups[i] == self.groups[own]):
                return i
        return None

    def variants(self) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """The distinct (blocks, warps) geometries of dispatch and of combine: what gets compiled."""
        return set(self.dispatch), set(self.combine)
