"""``Schedule``: which geometry each leg of the EP op launches, by token-count bucket.

Backend-neutral: the op picks a bucket by the call's token count (:meth:`Schedule.index`); a
backend fills the geometries (the ``hip`` backend from :mod:`mori_jit.ops.ep.backends.hip.intranode.tuning`).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

__all__ = ["Schedule"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Merged buckets: ``edges[i]`` is the inclusive max token count of bucket i (None = no limit)."""

    edges: tuple[Optional[int], ...]
    dispatch: tuple[tuple[int, int], ...]
    combine: tuple[tuple[int, int], ...]

    def __post_init__(self):
        object.__setattr__(self, "_finite", [e for e in self.edges if e is not None])

    def index(self, num_tokens: int) -> int:
        """Bucket index for ``num_tokens`` (the last bucket covers everything above)."""
        return bisect.bisect_left(self._finite, num_tokens)

    def variants(self) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """The distinct (blocks, warps) geometries of dispatch and of combine: what gets compiled."""
        return set(self.dispatch), set(self.combine)
