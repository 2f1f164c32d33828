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
# sm_90a, EP2, hidden 7168, topk 8, 128 experts per rank: docs/PERF.md "Sweep (session 2)", raw data
# docs/bench/session2/sweep_*.json (device run 5, graph mode, the GPU queued ahead of the host).
# Noise between two runs of one point is about ±1 µs at 128/512 tokens and ±2 µs at 4096.
#   dispatch bf16  128: 64x4 15.6 | 32x8 15.9 | 64x8 15.9 | 132x4 16.0 | 32x4 16.3 | 16x8 16.8 | x16 ~20
#                  512: 132x4 31.6 | 132x8 31.6 | 64x8 31.9 | 64x16 32.8 | 64x4 33.5 | 16x16 34.6
#                 4096: 132x16 182.3 | 132x8 182.6 | 132x4 185.1 | 64x16 187.4 | 64x8 192.0
#   dispatch fp8   128: 64x8 13.8 | 132x8 14.1 | 32x8 14.8 | 32x16 16.6;  4096: 132x16 104.0 | 132x8 104.7
#   combine (staging copy / zero-copy)
#                  128: 132x8 26.7/25.1 | 132x4 26.9/23.9 | 64x8 28.5/25.5 | 64x4 30.0/23.9
#                  512: 132x16 42.1/37.1 | 132x8 42.9/36.9 | 64x16 43.3/37.0 | 64x8 49.0/36.4
#                 4096: 132x16 266.5/190.6 | 132x8 312.2/192.0 | 64x16 315.0/192.1
# sm_90a, EP1 (one GPU, 256 experts), bf16, device run 6, docs/bench/session2/sweep_ep1_bf16.json:
#   dispatch  128: 64x4 11.3 | 132x4 11.3 | 32x4 11.6 | 32x8 11.6 | x16 ~14;  4096: 132x16 39.9 | 132x8 44.3
#   combine   128: 132x4 16.4/15.3 | 132x8 17.7/17.1 | 64x4 18.0/15.1 | 32x4 20.7/14.9
#            4096: 132x16 82.2/44.1 | 132x8 114.1/52.8 | 64x16 123.1/60.4
# Within noise the smaller geometry wins (fewer warps in total). experts_per_rank was not varied,
# so the keys are exact, not wildcards. 1024 tokens was not swept: it takes the 4096 geometry.
# Both sweeps predate the chunked combine pull (device run 7), which shortens small-batch combines;
# the combine optimum at 128 tokens may have moved and has not been re-swept.
DISPATCH_TABLE: dict[str, dict[tuple, list[Bucket]]] = {
    "bf16": {(2, 7168, 8, 128): [(128, 132, 8), (512, 132, 8), (None, 132, 8)],
             (1, 7168, 8, 256): [(128, 132, 8), (None, 132, 16)]},
    "fp8": {(2, 7168, 8, 128): [(128, 132, 8), (None, 132, 8)]},
}
# (world_size, hidden, topk, experts_per_rank | None) -> buckets
COMBINE_TABLE: dict[tuple, list[Bucket]] = {
    (2, 7168, 8, 128): [(128, 132, 4), (512, 132, 8), (None, 132, 16)],
    (1, 7168, 8, 256): [(128, 132, 4), (None, 132, 16)],
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
