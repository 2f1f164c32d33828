"""The internode tuning table: geometry of each internode leg by token count.

Keyed ``(device_key, world_size, hidden, topk)`` (``device_key``: the target arch, e.g. ``sm_90a``),
then by the dispatch dtype's name; each entry is a list of paired rows
``(max_tokens | None, disp_block, disp_rdma, disp_warp, comb_block, comb_rdma, comb_warp)``: both
legs' geometry for calls of at most ``max_tokens`` tokens (``None``: every larger call). ``*_rdma``
are the blocks a hierarchical (``v2``) kernel gives to the network; the low-latency family (``v2_ll``)
has no such split and ignores them. ``device_key`` ``None`` is a wildcard over arches.

No row has been measured on a machine with a network yet (several PEs on one GPU measure the
protocol, not its speed), so every shape takes :data:`DEFAULT_ROWS`, whose first bucket is small
so that a decode-sized call leaves SMs to the rest of the step. Every geometry a lookup names is
built at construction; blocks are clamped to the rank's share of the SMs.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["NetRow", "NET_TABLE", "DEFAULT_ROWS", "net_rows", "check_rows"]

#: (max_tokens | None, disp_block, disp_rdma, disp_warp, comb_block, comb_rdma, comb_warp)
NetRow = tuple[Optional[int], int, int, int, int, int, int]

#: (device_key | None, world_size, hidden, topk) -> {dispatch dtype name: rows}
NET_TABLE: dict[tuple[Optional[str], int, int, int], dict[str, tuple[NetRow, ...]]] = {}

#: The geometry of every shape the table does not name (not measured; docs/performance.md,
#: decisions: "Internode default rows").
DEFAULT_ROWS: tuple[NetRow, ...] = ((128, 16, 0, 8, 16, 0, 8), (None, 32, 0, 8, 32, 0, 8))


def check_rows(rows: tuple[NetRow, ...], where: str = "internode tuning rows") -> None:
    """Raise ValueError unless ``rows`` are paired 7-tuples with rising edges, the last ``None``,
    blocks and warps >= 1 and network blocks >= 0 and below the blocks of their leg."""
    if not rows:
        raise ValueError(f"{where}: no rows")
    prev = 0
    for i, row in enumerate(rows):
        if len(row) != 7:
            raise ValueError(f"{where}: row {row!r} has {len(row)} values; expected (max_tokens|None, disp_block, "
                             f"disp_rdma, disp_warp, comb_block, comb_rdma, comb_warp)")
        edge, db, dr, dw, cb, cr, cw = row
        last = i == len(rows) - 1
        if last != (edge is None) or (edge is not None and (not isinstance(edge, int) or edge <= prev)):
            raise ValueError(f"{where}: row {row!r}: max_tokens must rise from row to row and be None in the last row only")
        prev = edge or prev
        if not all(isinstance(v, int) and v >= 1 for v in (db, dw, cb, cw)):
            raise ValueError(f"{where}: row {row!r}: blocks and warps must be ints >= 1")
        if not all(isinstance(v, int) and 0 <= v < b for v, b in ((dr, db), (cr, cb))):
            raise ValueError(f"{where}: row {row!r}: network blocks must be ints in [0, blocks of their leg)")


def net_rows(device_key: str, world_size: int, hidden: int, topk: int, dtype: str,
             budget: int) -> tuple[NetRow, ...]:
    """The rows for a shape: the table's entry for ``device_key`` or the wildcard, else
    :data:`DEFAULT_ROWS`; blocks clamped to ``budget`` (the rank's share of the SMs), network
    blocks kept below their leg's blocks."""
    entry = NET_TABLE.get((device_key, world_size, hidden, topk)) or NET_TABLE.get((None, world_size, hidden, topk)) or {}
    rows = entry.get(dtype, DEFAULT_ROWS)
    out = []
    for edge, db, dr, dw, cb, cr, cw in rows:
        db, cb = min(db, budget), min(cb, budget)
        out.append((edge, db, min(dr, db - 1), dw, cb, min(cr, cb - 1), cw))
    return tuple(out)
