"""Geometry tuning tables of the JIT kernels (the ``hip`` backend, on AMD and NVIDIA GPUs): blocks ×
warps per block, by token count.

Two tables: dispatch is keyed by dtype, combine is not (combine only reduces its bf16/fp32 staging,
whatever the dispatch carried). Keys are ``(world_size, hidden, topk, experts_per_rank | None)``,
where ``None`` is a measured wildcard (experts per rank does not move the optimum), and values are
buckets ``(max_tokens_inclusive | None, blocks, warps)`` in increasing order. :func:`lookup` merges
both tables even when their bucket edges differ, falls back to one default for unswept shapes, and
clamps blocks to the device's CU/SM count (combine's cross-device barrier needs every block
resident). When two geometries measure within noise, the table holds the smaller one: it leaves SMs
to the expert GEMMs that overlap with communication.

Entries come from ``scripts/bench_ep.py --sweep`` (machine and method: docs/performance.md).
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
# its own signal) unless told otherwise. sm_90a EP2 bf16 hidden 7168, graph mode, combine µs, low
# latency against range flags (docs/performance.md, "Low-latency combine"): 128 tokens 15.4-15.9 against
# 16.4-17.0; 256 20.8-21.0 against 22.4-22.8; 512 37.9 against 35.6-36.6; 1024 58.2 against
# 56.4-57.0; 4096 177.4-177.5 against 175.9-176.4. The edge lies between 256 and 512 (not swept).
LOW_LATENCY_MAX_TOKENS: int = 256
# A low-latency op whose every peer-token task fits the device's SMs (EpRangeTok: one-token ranges)
# combines on every SM (the tables' blocks do not apply; see the sweep notes below) with
# these EpCfg fields. vecUnroll 2 puts a token's 14 chunks on 14 of the 16 waves, not 7 on 7:
# sm_90a EP2 bf16 hidden 7168, 128 tokens, 132x16, graph mode, combine fresh / buffer 14.3 / 14.3
# and 14.5 / 14.6 µs against 4's 15.0 / 14.6 and 15.2 / 15.1 (docs/performance.md, "Combine vecUnroll").
ONE_TOKEN_COMBINE: dict[str, int] = {"vecUnroll": 2}
# A dispatch block that owns at least this many tokens moves its rows with the bulk-copy unit
# (EpCfg.bulkMinTokens, NVIDIA sm_90 and later): a bucket whose blocks can own that many compiles
# the bulk path, and each block chooses by its own count. sm_90a EP2 hidden 7168, graph mode,
# dispatch µs, every block bulk (4 stages) against wave copies, same calls (docs/performance.md,
# "Bulk-copy dispatch"): 31 tokens per block (4096 on 132): bf16 173.7-174.2 against 174.3-175.2, fp8
# 93.0-93.5 against 95.6-96.0; 15.5 (2048): bf16 91.9-92.1 against 92.5-92.6, fp8 51.5-51.8 against
# 52.4-52.8; 7.8 (1024): bf16 51.0-51.1 against 50.5-50.7, fp8 equal; 8 (512 on 64): bf16 equal,
# fp8 20.2-20.8 against 19.5-19.8; 4 (256 on 64): equal; 1-2 (128): bf16 15.3-15.6 against 13.9-14.7.
# The edge lies between 8 and 15.5 (not swept): 12. On 64 blocks (MORI_EP_CFG_DISPATCH_BLOCKNUM)
# at 4096: bf16 179.2-179.5 against 185.6-185.7, fp8 98.0-98.3 against 103.5-103.6. Not at one rank
# (EP1 copies into its own memory, no link; 4096 tokens): bf16 37.6-38.0 against 38.3-38.9,
# but fp8 33.2-33.4 against 23.8 on 64 blocks and 25.2 against 20.5 on 132.
BULK_DISPATCH_MIN_TOKENS: int = 12


# dtype name -> (world_size, hidden, topk, experts_per_rank | None) -> buckets
#
# Swept on sm_90a (2 x H200), hidden 7168, topk 8, 128 experts per rank at EP2 and 256 at EP1, graph
# mode, every point golden-gated (``scripts/bench_ep.py --sweep``; machine and method in
# docs/performance.md). Two runs of one point differ by about ±1 µs at 128/512 tokens and ±2 µs at
# 4096; within that the smaller geometry (fewer warps in total) is kept. µs, fastest first:
#   EP2 dispatch bf16  128: 64x8 14.8 | 64x16 14.8 | 132x8 15.2 | 132x16 15.3
#                      512: 132x8 30.3 | 132x16 30.7 | 64x8 31.2 | 64x16 31.2 (within noise: 64x8 kept)
#                     4096: 132x8 175.2 | 132x16 175.8 | 64x16 182.3 | 64x8 186.5
#   EP2 dispatch fp8   128: 132x16 13.5 | 64x8 13.8 | 132x4 13.8 | 64x4 13.9 | 132x8 13.9 | 64x16 14.0
#                     4096: 132x16 96.2 | 132x8 97.4 | 64x16 98.8 | 132x4 100.3 | 64x8 103.8
#   EP2 combine, fresh / buffer input (range flags unless said):
#                      128: 64x16 17.2/17.0 | 132x16 17.3/17.3 | 64x8 18.2/18.1 | 132x8 18.4/18.3
#       128, low latency: 64x16 15.5/15.6 | 132x16 16.0/15.9 | 64x8 16.8/16.9 | 32x16 22.7 | 32x8 23.6
#       256, low latency: 132x16 20.7/20.6 | 132x8 22.2/22.2 | 64x16 25.2/24.9 | 64x8 28.3 | 32x16 31.1
#                      512: 132x16 36.3/36.4 | 132x8 38.9/38.9 | 64x16 42.4/42.5 | 64x8 45.4/45.3
#                     4096: 132x16 180.0/179.6 | 132x8 181.9/182.3 | 64x16 226.6/226.0 | 64x8 239.6/240.6
#       128, low latency with one-token ranges (ONE_TOKEN_COMBINE, every SM): 132x16 14.4-14.7 |
#                           64x16 17.8 (more tasks than blocks)
#   EP1 dispatch bf16  128: 132x16 8.6 | 132x8 8.8 | 64x16 9.2 | 64x8 9.3 (within noise: 64x8 kept)
#                     4096: 132x16 39.4 | 132x8 44.2
#   EP1 combine        128: 64x16 9.3/9.2 | 132x16 9.5/9.5 | 64x8 10.2 | 132x8 10.6
#                     4096: 132x16 51.7 | 132x8 66.3
#   EP1 dispatch fp8 with fp32 block scales (scripts/bench_ep_moe.py; one run, 64x16 | 132x16):
#       caller-cast rows  128: 6.4 | 6.6   512: 7.8 | 7.3   1024: 10.0 | 8.8   4096: 28.7 | 23.6
#       in-kernel cast    128: 7.8 | 7.6   512: 10.5 | 8.5  1024: 15.1 | 11.5  4096: 59.6 | 35.9
#       (the cast is arithmetic: every SM pays from 512 tokens; 128 is within noise, so 64 kept)
# A combine of 132x32 spills (64 registers, 112 B of stack) and measured no faster than 132x16.
# experts_per_rank was not varied, so the keys are exact, not wildcards. 1024 tokens was not swept:
# it takes the 4096 geometry.
DISPATCH_TABLE: dict[str, dict[tuple, list[Bucket]]] = {
    "bf16": {(2, 7168, 8, 128): [(512, 64, 8), (None, 132, 8)],
             (1, 7168, 8, 256): [(128, 64, 8), (None, 132, 16)]},
    "fp8": {(2, 7168, 8, 128): [(128, 64, 4), (None, 132, 8)],
            (1, 7168, 8, 256): [(128, 64, 16), (None, 132, 16)]},
}
# (world_size, hidden, topk, experts_per_rank | None) -> buckets
COMBINE_TABLE: dict[tuple, list[Bucket]] = {
    (2, 7168, 8, 128): [(128, 64, 16), (None, 132, 16)],
    (1, 7168, 8, 256): [(128, 64, 16), (None, 132, 16)],
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
                          max_warps: Optional[int] = None) -> Schedule:
    """Merge two bucket lists with possibly different edges into one schedule, with blocks clamped
    to ``num_cus`` and warps per block to ``max_warps`` (None: not clamped)."""
    finite = sorted({b[0] for b in disp + comb if b[0] is not None})
    edges: list[Optional[int]] = [*finite, None]
    d = tuple(_clamp(_at(disp, e), num_cus, max_warps) for e in edges)
    c = tuple(_clamp(_at(comb, e), num_cus, max_warps) for e in edges)
    return Schedule(tuple(edges), d, c)


def lookup(dtype: str, world_size: int, hidden: int, topk: int, experts_per_rank: int, num_cus: int,
           max_warps: Optional[int] = None) -> Schedule:
    """The schedule for one shape: table entries where swept, the defaults otherwise. The tables
    count warps of the arch they were swept on; ``max_warps`` (1024 threads / wave size) keeps an
    entry valid on an arch with wider waves."""
    key = (world_size, hidden, topk, experts_per_rank)
    disp = _find(DISPATCH_TABLE.get(dtype, {}), key) or [(None, *DEFAULT_DISPATCH)]
    comb = _find(COMBINE_TABLE, key) or [(None, *DEFAULT_COMBINE)]
    return schedule_from_buckets(disp, comb, num_cus, max_warps)
