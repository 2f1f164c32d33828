"""What every rank of a ``torch``-backend dispatch learns before any row moves (its split send too).

One ``all_gather`` gives every rank every rank's send counts (rows per destination rank) and, when
the op has an expert-major layout, every rank's (token, expert) pairs per expert (one per valid
top-k slot, as the receiver counts them). An error those counts decide is then raised by every
rank alike, before the payload exchange: a rank that would receive more rows than its capacity
(:class:`EpDeviceError`), an expert that would receive more pairs than ``expert_capacity``
(:class:`EpCapacityError`). No rank is left inside a collective, and every rank may retry.
"""
from __future__ import annotations

import torch

from mori_jit.ops.ep.core.watch import Exchange
from mori_jit.ops.ep.errors import EpCapacityError, EpDeviceError

__all__ = ["gather_counts"]


def gather_counts(mask: torch.Tensor, indices: torch.Tensor, rank: int, world_size: int, num_experts_per_rank: int,
                  recv_capacity: int, expert_capacity: int, ex: Exchange) -> tuple[list[int], list[int]]:
    """Collective: ``(send_counts, recv_counts)`` of this rank, from the destination ``mask``
    (``[n, world_size]``) of every rank; with ``expert_capacity > 0``, also each expert's pairs from
    ``indices`` (``[n, k]``). Raises on every rank as the module says."""
    ws, E = world_size, num_experts_per_rank
    row = mask.sum(dim=0, dtype=torch.int64)
    if expert_capacity:
        ids = indices.reshape(-1).to(device=row.device, dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < ws * E)]  # (the slots a receiver counts)
        row = torch.cat([row, torch.bincount(ids, minlength=ws * E)])
    rows = [torch.empty_like(row) for _ in range(ws)]
    ex.all_gather(rows, row)
    table = torch.stack(rows)
    sends = table[:, :ws].tolist()
    totals = [sum(r[d] for r in sends) for d in range(ws)]
    over = [(d, t) for d, t in enumerate(totals) if t > recv_capacity]
    if over:
        ex.stop()  # (every rank raises here, from the same counts)
        raise EpDeviceError(f"EP dispatch: {', '.join(f'rank {d} would receive {t} rows' for d, t in over)}, but "
                            f"recv_capacity is {recv_capacity}; no row was sent")
    if expert_capacity:
        pairs = table[:, ws:].sum(dim=0).tolist()  # by global expert id
        by_rank: dict[int, list[tuple[int, int]]] = {}
        for e, c in enumerate(pairs):
            if c > expert_capacity:
                by_rank.setdefault(e // E, []).append((e % E, c))
        if by_rank:
            ex.stop()
            where = "; ".join(f"rank {r}'s local experts {', '.join(f'{e} ({c} pairs)' for e, c in experts)}"
                              for r, experts in by_rank.items())
            most = max(c for experts in by_rank.values() for _, c in experts)
            raise EpCapacityError(f"EP dispatch: {where} would receive more than expert_capacity={expert_capacity} "
                                  f"(token, expert) pairs; raise expert_capacity to at least {most} (nothing was "
                                  f"sent or truncated: the dispatch returns on no rank)")
    return sends[rank], [r[rank] for r in sends]
