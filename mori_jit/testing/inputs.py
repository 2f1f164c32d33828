"""Random inputs of the EP checks: tokens, top-k weights and expert ids (``make_inputs``), and the
experts per rank a check uses at small world sizes (``experts_per_rank_at``). Values are drawn on
the CPU and then moved, so a check's inputs do not depend on the device."""

from __future__ import annotations

import torch

__all__ = ["make_inputs", "experts_per_rank_at"]


def experts_per_rank_at(world_size: int, experts_per_rank: int, top_k: int) -> int:
    """A check's experts per rank at ``world_size`` ranks: ``experts_per_rank``, or more where the
    ranks would hold fewer experts than a token picks (top-k of fewer experts is refused)."""
    return max(experts_per_rank, -(-top_k // world_size))


def make_inputs(
    rank: int,
    n: int,
    hidden: int,
    topk: int,
    num_experts_total: int,
    dtype: torch.dtype,
    device,
    generator: torch.Generator | None,
    *,
    drop_frac: float = 0.0,
    all_to_rank: int | None = None,
    world_size: int | None = None,
    index_dtype: torch.dtype = torch.int32,
):
    """Random dispatch inputs ``(x [n, H] dtype, weights [n, k] f32, indices [n, k] index_dtype)``.

    Values are drawn on the CPU from ``generator`` (a fresh one seeded with ``rank`` if None) and
    then moved to ``device``, so they do not depend on the device. No value is zero: ``x`` is
    ``randn`` (1-byte dtypes: random bytes 1..255 reinterpreted), weights are in ``[0.05, 1.05)``.

    Args:
        indices: per token, the first ``topk`` of a random permutation of all experts.
        drop_frac: probability that a slot is replaced by an invalid id (half ``-1``-like
            negatives, half ``>= num_experts_total``).
        all_to_rank: if given, every slot picks a (possibly repeated) expert living on that rank;
            needs ``world_size`` to know the experts per rank.
        index_dtype: int32, or int64, whose dropped slots are ids ``2**32`` away from a valid one
            (a cast to int32 would turn them into that valid id).
    """
    g = generator if generator is not None else torch.Generator().manual_seed(rank)
    if dtype.itemsize == 1:
        x = torch.randint(1, 256, (n, hidden), generator=g, dtype=torch.int32).to(torch.uint8)
        x = x.view(dtype)
    else:
        x = (torch.randn(n, hidden, generator=g, dtype=torch.float32) * 2.0).to(dtype)
    weights = torch.rand(n, topk, generator=g, dtype=torch.float32) + 0.05

    if all_to_rank is not None:
        if world_size is None or num_experts_total % world_size:
            raise ValueError("all_to_rank needs world_size dividing num_experts_total")
        epr = num_experts_total // world_size
        indices = all_to_rank * epr + torch.randint(0, epr, (n, topk), generator=g)
    else:
        if topk > num_experts_total:
            raise ValueError(f"topk {topk} > num_experts_total {num_experts_total}")
        indices = torch.rand(n, num_experts_total, generator=g).argsort(dim=1)[:, :topk]
    if drop_frac > 0:
        drop = torch.rand(n, topk, generator=g) < drop_frac
        neg = torch.rand(n, topk, generator=g) < 0.5
        bad = torch.where(neg, -1 - torch.randint(0, 4, (n, topk), generator=g),
                          num_experts_total + torch.randint(0, num_experts_total + 1, (n, topk), generator=g))
        if index_dtype == torch.int64:
            bad = torch.where(neg, indices - 2**32, indices + 2**32)
        indices = torch.where(drop, bad, indices)
    return x.to(device), weights.to(device), indices.to(index_dtype).contiguous().to(device)
