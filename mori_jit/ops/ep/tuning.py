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

Entries come from ``tools/bench_ep.py --sweep`` (see docs/PERF.md for the runs behind them).
"""
from __future__ import annotations

from typing import Optional

from .schedule import Schedule

__all__ = ["Bucket", "DISPATCH_TABLE", "COMBINE_TABLE", "DEFAULT_DISPATCH", "DEFAULT_COMBINE",
           "LOW_LATENCY_MAX_TOKENS", "ONE_TOKEN_COMBINE", "BULK_DISPATCH_MIN_TOKENS", "lookup", "schedule_from_buckets"]

Bucket = tuple[Optional[int], int, int]  # (max_tokens_inclusive | None, blocks, warps)

DEFAULT_DISPATCH: tuple[int, int] = (64, 16)
DEFAULT_COMBINE: tuple[int, int] = (132, 16)  # clamped to the CU/SM count
# An NVIDIA op whose max_num_inp_token_per_rank is at most this combines low latency (each word of a row
# its own signal) unless told otherwise. sm_90a EP2 bf16 hidden 7168, graph mode, combine µs, low
# latency against range flags (docs/PERF.md session 16, runs 1-4): 128 tokens 15.4-15.9 against
# 16.4-17.0; 256 20.8-21.0 against 22.4-22.8; 512 37.9 against 35.6-36.6; 1024 58.2 against
# 56.4-57.0; 4096 177.4-177.5 against 175.9-176.4. The edge lies between 256 and 512 (not swept).
LOW_LATENCY_MAX_TOKENS: int = 256
# A low-latency op whose every peer-token task fits the device's SMs (EpRangeTok: one-token ranges)
# combines on every SM (the tables' blocks do not apply; the session-17 sweep notes below) with
# these EpCfg fields. vecUnroll 2 puts a token's 14 chunks on 14 of the 16 waves, not 7 on 7:
# sm_90a EP2 bf16 hidden 7168, 128 tokens, 132x16, graph mode, combine fresh / buffer 14.3 / 14.3
# and 14.5 / 14.6 µs against 4's 15.0 / 14.6 and 15.2 / 15.1 (docs/PERF.md session 17, run 9).
ONE_TOKEN_COMBINE: dict[str, int] = {"vecUnroll": 2}
# A dispatch block that owns at least this many tokens moves its rows with the bulk-copy unit
# (EpCfg.bulkMinTokens, NVIDIA sm_90 and later): a bucket whose blocks can own that many compiles
# the bulk path, and each block chooses by its own count. sm_90a EP2 hidden 7168, graph mode,
# dispatch µs, every block bulk (4 stages) against wave copies, same calls (docs/PERF.md session
# 18, runs 2-3): 31 tokens per block (4096 on 132): bf16 173.7-174.2 against 174.3-175.2, fp8
# 93.0-93.5 against 95.6-96.0; 15.5 (2048): bf16 91.9-92.1 against 92.5-92.6, fp8 51.5-51.8 against
# 52.4-52.8; 7.8 (1024): bf16 51.0-51.1 against 50.5-50.7, fp8 equal; 8 (512 on 64): bf16 equal,
# fp8 20.2-20.8 against 19.5-19.8; 4 (256 on 64): equal; 1-2 (128): bf16 15.3-15.6 against 13.9-14.7.
# The edge lies between 8 and 15.5 (not swept): 12. On 64 blocks (run 6, MORI_V2_EP_DISPATCH_BLOCKNUM)
# at 4096: bf16 179.2-179.5 against 185.6-185.7, fp8 98.0-98.3 against 103.5-103.6. Not at one rank
# (EP1 copies into its own memory, no link; runs 5-6, 4096 tokens): bf16 37.6-38.0 against 38.3-38.9,
# but fp8 33.2-33.4 against 23.8 on 64 blocks and 25.2 against 20.5 on 132.
BULK_DISPATCH_MIN_TOKENS: int = 12


# dtype name -> (world_size, hidden, topk, experts_per_rank | None) -> buckets
#
# sm_90a, EP2, hidden 7168, topk 8, 128 experts per rank: docs/PERF.md "Sweeps (session 3)", raw
# data docs/bench/session3/run{2,3,4}/sweep*.json (graph mode, GPU queued ahead of the host, every
# point golden-gated). Noise between two runs of one point is about ±1 µs at 128/512 tokens and
# ±2 µs at 4096. Dispatch (block-owned tokens; bf16 from run 4, fp8 from run 3):
#   bf16  128: 64x8 16.4 | 132x4 16.9 | 64x4 17.2 | 132x8 17.2 | 132x16 17.3 | 64x16 17.6
#         512: 132x8 32.1 | 64x16 32.1 | 132x4 32.2 | 64x8 32.3 | 132x16 32.6 | 64x4 33.4
#        4096: 132x8 176.3 | 132x16 177.0 | 132x4 178.8 | 64x16 181.0 | 64x8 185.7
#   fp8   128: 132x16 13.5 | 64x8 13.8 | 132x4 13.8 | 64x4 13.9 | 132x8 13.9 | 64x16 14.0
#        4096: 132x16 96.2 | 132x8 97.4 | 64x16 98.8 | 132x4 100.3 | 64x8 103.8
# Combine (staging copy / zero-copy; bf16 128/512 from run 2, 4096 from run 3):
#         128: 132x8 19.3/18.0 | 132x16 19.6/18.2 | 64x16 19.8/18.0 | 64x8 20.8/17.9 | 132x4 20.8/18.2
#         512: 132x16 39.7/34.6 | 132x8 41.2/35.2 | 64x16 41.6/34.8 | 64x8 46.6/34.8
#        4096: 132x16 266.8/188.0 | 132x8 314.9/190.8 | 64x16 317.4/190.1
#              run 6: 132x32 251.2/190.3 | 132x16 264.1/189.0 (the copy gains from 1024 threads)
# sm_90a, EP1 (one GPU, 256 experts), bf16, session 3 run 5, docs/bench/session3/run5/sweep_ep1.json:
#   dispatch  128: 132x8 9.9 | 132x16 10.1 | 64x16 10.4 | 64x8 10.6;  4096: 132x16 41.0 | 132x8 46.3
#   combine   128: 132x8 11.4/10.8 | 64x16 11.7/11.0 | 132x16 11.8/11.3 | 64x8 13.1/11.6
#            4096: 132x16 78.0/45.0 | 132x8 112.1/59.3 | 64x16 122.1/67.8
# Session 4 (run 4, combine stages only the rows peers pull): 4096 132x16 222.8/191.3 | 132x32
#   222.7/192.7, so 132x16 again above 128 (132x32 also spills: 64 registers, 112 B stack).
# Session 5: combine became push-pipelined; not re-swept then (132x16 183.6 at 4096, 64x16 18.6 at 128).
# Session 6 (7/16 of the blocks send, sums claimed in order), run 4, graph mode, fresh/buffer input,
#   docs/bench/session6/run4/sweep_ep{2,1}.json. The table did not move:
#   EP2 combine  128: 64x16 18.0/18.1 | 132x16 18.2/18.1 | 132x8 18.6/18.6 | 64x8 18.8/18.8
#                512: 132x16 37.0/37.5 | 132x8 39.7/39.9 | 64x16 43.8/42.8 | 64x8 47.0/46.6
#               1024: 132x16 58.0/58.4 | 132x8 60.9/60.6 | 64x16 70.4/69.8 | 64x8 76.4/76.3
#               4096: 132x16 181.5/181.1 | 132x8 184.4/183.6 | 64x16 227.1/228.7 | 64x8 251.3/252.0
#   EP2 dispatch bf16 128: 132x16 16.4 | 64x16 16.6 | 64x8 17.2 | 132x8 17.8 (within noise: 64x8 kept)
#                512: 64x8 31.8 | 132x8 32.1 | 132x16 32.7 | 64x16 32.9;  1024: 132x8 52.3 | 64x16 53.5
#               4096: 132x8 175.7 | 132x16 176.5 | 64x16 181.9 | 64x8 187.6
#   EP1 combine  128: 64x16 10.3/10.3 | 132x16 10.4/10.0 | 132x8 10.9/10.9;  4096: 132x16 51.1/51.4 | 132x8 67.0
#   EP1 dispatch 128: 132x16 9.4 | 132x8 9.6 | 64x16 9.8 | 64x8 10.0;  4096: 132x16 40.3 | 132x8 44.4
# Session 9 (combine end before its last stores, acq_rel block count), run 5, graph mode,
#   fresh/buffer input, docs/bench/session9/run5/sweep_ep{2,1}.json. The table did not move:
#   EP2 combine  128: 64x16 17.2/17.0 | 132x16 17.3/17.3 | 64x8 18.2/18.1 | 132x8 18.4/18.3
#                512: 132x16 36.3/36.4 | 132x8 38.9/38.9 | 64x16 42.4/42.5 | 64x8 45.4/45.3
#               4096: 132x16 180.0/179.6 | 132x8 181.9/182.3 | 64x16 226.6/226.0 | 64x8 239.6/240.6
#   EP2 dispatch bf16 128: 64x8 14.8 | 64x16 14.8 | 132x8 15.2 | 132x16 15.3
#                512: 132x8 30.3 | 132x16 30.7 | 64x8 31.2 | 64x16 31.2 (within noise: 64x8 kept)
#               4096: 132x8 175.2 | 132x16 175.8 | 64x16 182.3 | 64x8 186.5
#   EP1 combine  128: 64x16 9.3/9.2 | 132x16 9.5/9.5 | 64x8 10.2 | 132x8 10.6;  4096: 132x16 51.7 | 132x8 66.3
#   EP1 dispatch 128: 132x16 8.6 | 132x8 8.8 | 64x16 9.2 | 64x8 9.3 (0.7 apart, as in session 6:
#                within the ±1 µs noise, so 64x8 kept);  4096: 132x16 39.4 | 132x8 44.2
# Session 15 (the own row hinted into L2), run 1, graph mode, fresh/buffer input, EP2 bf16 at 128
#   only (docs/bench/session15/run1/sum.txt). The table did not move:
#   EP2 combine  128: 64x16 16.8/16.8 | 132x16 17.2/17.1 | 64x8 17.6/17.7 | 132x8 17.9/17.9 | 32x16 22.9 | 32x8 25.8
#   EP2 dispatch bf16 128: 64x8 14.5 | 64x16 14.7 | 132x8 14.7 | 132x16 14.9 | 32x8 15.6 | 32x16 15.7
# Session 16 (the low-latency combine, on for ops of <= 256 tokens), run 5, graph mode, fresh/buffer
#   input, EP2 bf16 (docs/bench/session16/run5/sweep.log). The table did not move:
#   EP2 combine  128: 64x16 15.5/15.6 | 132x16 16.0/15.9 | 64x8 16.8/16.9 | 132x8 16.8/16.9 | 32x16 22.7 | 32x8 23.6
#                256: 132x16 20.7/20.6 | 132x8 22.2/22.2 | 64x16 25.2/24.9 | 64x8 28.3 | 32x16 31.1 | 32x8 36.1
#   EP2 dispatch bf16 128: 64x8 14.6 | 64x16 14.8 | 132x8 15.0 | 132x16 15.0;  256: 64x8 20.0 | 132x16 20.3
#   Run 6, combine vecUnroll at 128 (MORI_V2_EP_COMBINE_VEC_UNROLL): 4 15.6/15.6 | 2 16.7 | 8 17.9.
# Session 17 (low latency: every lane polls its vectors), runs 4 and 6, graph mode, combine µs, EP2
#   bf16 (docs/bench/session17/run{4,6}/sweep_*.log). Two-token ranges: 128: 64x16 15.3-15.6 |
#   96x16 15.5-15.7 | 132x16 15.2-15.9;  256: 132x16 20.2-20.7 | 96x16 23.6-24.9 | 64x16 23.7-25.2.
#   One-token ranges (run 6, fresh / buffer): 128: 132x16 14.4 / 15.1 and 14.7 / 14.7 | 64x16 17.8
#   (more tasks than blocks);  256: 132x16 22.9-25.3. So a low-latency op whose tasks fit the SMs
#   takes them all (ONE_TOKEN_COMBINE); the table did not move.
# Within noise the smaller geometry wins (fewer warps in total). experts_per_rank was not varied,
# so the keys are exact, not wildcards. 1024 tokens was not swept: it takes the 4096 geometry.
DISPATCH_TABLE: dict[str, dict[tuple, list[Bucket]]] = {
    "bf16": {(2, 7168, 8, 128): [(512, 64, 8), (None, 132, 8)],
             (1, 7168, 8, 256): [(128, 64, 8), (None, 132, 16)]},
    "fp8": {(2, 7168, 8, 128): [(128, 64, 4), (None, 132, 8)]},
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
