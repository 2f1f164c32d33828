"""Geometry tuning tables of the ``hip`` backend (blocks × warps per block, by token count).

Two tables: dispatch is keyed by dtype, combine is not (combine only reduces its bf16/fp32 staging,
whatever the dispatch carried). Keys are ``(world_size, hidden, topk, experts_per_rank | None)``,
where ``None`` is a measured wildcard (experts per rank does not move the optimum), and values are
buckets ``(max_tokens_inclusive | None, blocks, warps)`` in increasing order. :func:`lookup` merges
both tables even when their bucket edges differ, falls back to one default for unswept shapes, and
clamps blocks to the device's CU/SM count (combine's cross-device barrier needs every block
resident). When two geometries measure within noise, the table holds the smaller one: it leaves SMs
to the expert GEMMs that overlap with communication.

Entries come from ``scripts/bench_ep.py --sweep`` (see docs/PERF.md for the runs behind them).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

__all__ = ["Bucket", "Schedule", "DISPATCH_TABLE", "COMBINE_TABLE", "DEFAULT_DISPATCH", "DEFAULT_COMBINE",
           "lookup", "schedule_from_buckets"]

Bucket = tuple[Optional[int], int, int]  # (max_tokens_inclusive | None, blocks, warps)

DEFAULT_DISPATCH: tuple[int, int] = (64, 16)
DEFAULT_COMBINE: tuple[int, int] = (132, 16)  # clamped to the CU/SM count

# dtype name -> (world_size, hidden, topk, experts_per_rank | None) -> buckets
#
# sm_90a, EP2, hidden 7168, topk 8 (docs/PERF.md "Sweep", docs/bench/sweep_ep2_bf16.json, graph mode):
#   dispatch  128 tok: 32x16 20.6 µs | 64x8 22.4 | 132x8 22.3 | 64x16 28.6 (spread ±4 µs: take the smallest)
#            4096 tok: 132x8 184.2 µs | 132x16 184.6 | 64x16 189.9 | 64x8 196.6 | 32x16 207.1
#   combine  128 tok: 64x8 36.6 µs | 132x8 36.5 | 32x8 40.3;  4096 tok: 132x8 320.9 | 64x8 480.3 | 32x8 875.7,
#            and 132x16 268.9 in the bench run (more loads in flight for the staging copy and the pull).
# Only the 128 and 4096 points were swept, so the edge sits at the measured 128; experts_per_rank
# was not varied (128 per rank only), so these keys are exact, not wildcards. fp8 dispatch has not
# been swept: it falls back to the default.
DISPATCH_TABLE: dict[str, dict[tuple, list[Bucket]]] = {
    "bf16": {(2, 7168, 8, 128): [(128, 32, 16), (None, 132, 8)]},
    "fp8": {},
}
# (world_size, hidden, topk, experts_per_rank | None) -> buckets
COMBINE_TABLE: dict[tuple, list[Bucket]] = {
    (2, 7168, 8, 128): [(128, 64, 8), (None, 132, 16)],
}


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
        return set(self.dispatch), set(self.combine)


def _find(table: dict, key: tuple) -> Optional[list[Bucket]]:
    return table.get(key) or table.get((*key[:3], None))


def _at(buckets: list[Bucket], edge: Optional[int]) -> tuple[int, int]:
    for max_tok, blocks, warps in buckets:
        if max_tok is None or (edge is not None and edge <= max_tok):
            return blocks, warps
    return buckets[-1][1], buckets[-1][2]


def _clamp(geo: tuple[int, int], num_cus: int) -> tuple[int, int]:
    return min(geo[0], num_cus), geo[1]


def schedule_from_buckets(disp: list[Bucket], comb: list[Bucket], num_cus: int) -> Schedule:
    """Merge two bucket lists with possibly different edges into one schedule (clamped)."""
    finite = sorted({b[0] for b in disp + comb if b[0] is not None})
    edges: list[Optional[int]] = [*finite, None]
    d = tuple(_clamp(_at(disp, e), num_cus) for e in edges)
    c = tuple(_clamp(_at(comb, e), num_cus) for e in edges)
    return Schedule(tuple(edges), d, c)


def lookup(dtype: str, world_size: int, hidden: int, topk: int, experts_per_rank: int, num_cus: int) -> Schedule:
    """The schedule for one shape: table entries where swept, the defaults otherwise."""
    key = (world_size, hidden, topk, experts_per_rank)
    disp = _find(DISPATCH_TABLE.get(dtype, {}), key) or [(None, *DEFAULT_DISPATCH)]
    comb = _find(COMBINE_TABLE, key) or [(None, *DEFAULT_COMBINE)]
    return schedule_from_buckets(disp, comb, num_cus)
