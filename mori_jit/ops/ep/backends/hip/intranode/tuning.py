"""Geometry tuning tables of the JIT kernels (the ``hip`` backend, on AMD and NVIDIA GPUs): blocks ×
warps per block, by token count.

Two tables: dispatch is keyed by dtype, combine is not (combine only reduces its bf16/fp32 staging,
whatever the dispatch carried). Keys are ``(world_size, hidden, topk, experts_per_rank | None)``,
where ``None`` is a wildcard over experts per rank (no entry uses one: the sweeps did not vary it),
and values are buckets ``(max_tokens_inclusive | None, blocks, warps)`` in increasing order.
:func:`lookup` merges both tables even when their bucket edges differ, falls back to one default
for unswept shapes, and clamps blocks to the device's CU/SM count (combine's cross-device barrier
needs every block resident), or a one-rank combine's to its own limit (``combine_cus``: its blocks
wait for none of the others, so it may hold more than one block per SM). When two geometries
measure within noise, the table holds the smaller one: it leaves SMs to the expert GEMMs that
overlap with communication.

Entries come from ``scripts/bench_ep.py --sweep``; the machine, the method and every sweep are in
docs/performance.md (its decisions table has a row per entry).
"""
from __future__ import annotations

from typing import Optional

from mori_jit.ops.ep.core.schedule import Schedule

__all__ = ["Bucket", "DISPATCH_TABLE", "COMBINE_TABLE", "DEFAULT_DISPATCH", "DEFAULT_COMBINE",
           "LOW_LATENCY_MAX_TOKENS", "ONE_TOKEN_COMBINE", "BULK_DISPATCH_MIN_TOKENS", "lookup", "schedule_from_buckets"]

Bucket = tuple[Optional[int], int, int]  # (max_tokens_inclusive | None, blocks, warps)

DEFAULT_DISPATCH: tuple[int, int] = (64, 16)
DEFAULT_COMBINE: tuple[int, int] = (132, 16)  # clamped to the CU/SM count
# An NVIDIA op whose max_num_inp_token_per_rank is at most this combines low latency (each word of a row
# its own signal) unless told otherwise: it wins up to 256 tokens and loses from 512
# (docs/performance.md, decisions: "Low-latency combine for ≤ 256 tokens").
LOW_LATENCY_MAX_TOKENS: int = 256
# A low-latency op whose every peer-token task fits the device's SMs (EpRangeTok: one-token ranges)
# combines on every SM (the tables' blocks do not apply) with these EpCfg fields: vecUnroll 2 puts a
# token's 14 chunks on 14 of the 16 waves, not 7 on 7 (docs/performance.md, decisions: "Combine vecUnroll").
ONE_TOKEN_COMBINE: dict[str, int] = {"vecUnroll": 2}
# A dispatch block that owns at least this many tokens moves its rows with the bulk-copy unit
# (EpCfg.bulkMinTokens, NVIDIA sm_90 and later): a bucket whose blocks can own that many compiles
# the bulk path, and each block chooses by its own count. Bulk copies win from 15.5 tokens per block
# and lose at 1-2 (docs/performance.md, decisions: "Bulk-copy dispatch from 12 tokens per block").
BULK_DISPATCH_MIN_TOKENS: int = 12


# dtype name -> (world_size, hidden, topk, experts_per_rank | None) -> buckets. Each key's sweep and
# what it chose is a row of docs/performance.md's decisions table ("Geometry, EP2 dispatch bf16", ...).
DISPATCH_TABLE: dict[str, dict[tuple, list[Bucket]]] = {
    "bf16": {(2, 7168, 8, 128): [(512, 64, 8), (None, 132, 8)],
             (1, 7168, 8, 256): [(128, 64, 8), (None, 132, 16)]},
    "fp8": {(2, 7168, 8, 128): [(128, 64, 4), (None, 132, 8)],
            (1, 7168, 8, 256): [(128, 64, 16), (None, 132, 16)]},
}
# (world_size, hidden, topk, experts_per_rank | None) -> buckets ("Geometry, EP2 combine", "Geometry, EP1 combine").
# One rank's 264 blocks are two per SM of an H200 (common.grid.SOLO_COMBINE_BLOCKS_PER_SM) of 14
# warps: a two-token range of 7168-wide rows is 14 items, one per wave, and two such blocks hold
# 28 waves per SM where one block of 16 held 16 ("One-rank combine, two blocks per SM").
COMBINE_TABLE: dict[tuple, list[Bucket]] = {
    (2, 7168, 8, 128): [(128, 64, 16), (None, 132, 16)],
    (1, 7168, 8, 256): [(128, 64, 16), (None, 264, 14)],
}


def _find(table: dict, key: tuple) -> Optional[list[Bucket]]:
    return table.get(key) or table.get((*key[:3], None))


def _at(buckets: list[Bucket], edge: Optional[int]) -> tuple[int, int]:
    for max_tok, blocks, warps in buckets:
        if max_tok is None or (edge is not None and edge <= max_tok):
            return blocks, warps
    return buckets[-1][1], buckets[-1][2]


def _clamp(geo: tuple[int, int], num_cus: int, max_warps: Optional[int]) -> tuple[int, int]:
    return min(geo[0], num_cus), (min(geo[1], max_warps) if max_warps else geo[1])


def schedule_from_buckets(disp: list[Bucket], comb: list[Bucket], num_cus: int,
                          max_warps: Optional[int] = None, combine_cus: Optional[int] = None) -> Schedule:
    """Merge two bucket lists with possibly different edges into one schedule, with blocks clamped
    to ``num_cus`` (the combine's to ``combine_cus`` where given) and warps per block to
    ``max_warps`` (None: not clamped)."""
    finite = sorted({b[0] for b in disp + comb if b[0] is not None})
    edges: list[Optional[int]] = [*finite, None]
    d = tuple(_clamp(_at(disp, e), num_cus, max_warps) for e in edges)
    c = tuple(_clamp(_at(comb, e), combine_cus or num_cus, max_warps) for e in edges)
    return Schedule(tuple(edges), d, c)


def lookup(dtype: str, world_size: int, hidden: int, topk: int, experts_per_rank: int, num_cus: int,
           max_warps: Optional[int] = None, combine_cus: Optional[int] = None) -> Schedule:
    """The schedule for one shape: table entries where swept, the defaults otherwise. The tables
    count warps of the arch they were swept on; ``max_warps`` (1024 threads / wave size) keeps an
    entry valid on an arch with wider waves. ``combine_cus``: the combine's block limit where it
    differs from ``num_cus`` (one rank)."""
    key = (world_size, hidden, topk, experts_per_rank)
    disp = _find(DISPATCH_TABLE.get(dtype, {}), key) or [(None, *DEFAULT_DISPATCH)]
    comb = _find(COMBINE_TABLE, key) or [(None, *DEFAULT_COMBINE)]
    return schedule_from_buckets(disp, comb, num_cus, max_warps, combine_cus)
