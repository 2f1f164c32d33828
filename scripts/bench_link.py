"""The link's ceiling and what SM loads and stores get of it, measured in the benchmark's own run
(``scripts/bench_ep.py``): the copy engine's GPU0 -> GPU1 rate, and SM-driven peer traffic over a
symmetric buffer."""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from mori_jit.testing.cuda_graph import QUEUE_AHEAD_CYCLES

__all__ = ["link_ceiling_reps_gbps", "link_ceiling", "back_to_back_median_us", "sm_link_rates"]


def link_ceiling_reps_gbps(nbytes: int = 1 << 30, reps: int = 11) -> list[float]:
    """One-direction GPU0 -> GPU1 copy-engine rate of ``nbytes`` (GB/s), once per rep after one
    warm-up copy, each timed between events on the copy's stream (GPU0's current stream: torch
    runs a cross-device copy there). Timed with ``perf_counter`` around host syncs, the medians of
    5 reps spread 379-393 GB/s between runs while the op's own times moved 0.3 %: the ceiling, not
    the link, would be the noisy term of the link share."""
    if torch.cuda.device_count() < 2:
        return []
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    rates = []
    with torch.cuda.device(0):
        for i in range(reps + 1):
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a, non_blocking=True)
            end.record()
            end.synchronize()
            if i:  # the first copy sets up the peer mapping
                rates.append(nbytes / (start.elapsed_time(end) * 1e-3) / 1e9)
    torch.cuda.synchronize(1)
    assert torch.equal(a[:4096].cpu(), b[:4096].cpu()) and torch.equal(a[-4096:].cpu(), b[-4096:].cpu())
    return rates


def link_ceiling(reps: list[float]) -> float:
    """The ceiling a run reports: the median of its reps (NaN without a second GPU)."""
    return statistics.median(reps) if reps else float("nan")


def back_to_back_median_us(fn, reps: int) -> float:
    """Median µs of ``reps`` back-to-back calls of ``fn``, each timed between events, all queued
    behind a GPU sleep so the host's launch speed stays out of the figure."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
    ev[0].record()
    for i in range(reps):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(reps)) * 1e3


def sm_link_rates(rank, ws, nbytes: int = 256 << 20, reps: int = 10) -> dict:
    """GB/s of SM-driven peer traffic (a vectorized elementwise kernel over a peer's symmetric
    buffer): ``pull`` reads the peer, ``push`` writes it; ``one`` = rank 0 alone, ``both`` = every
    rank at once (the op's pattern). The copy-engine ceiling above bounds what the link carries;
    these show what SM loads and stores get of it."""
    if ws < 2:
        return {}
    import torch.distributed._symmetric_memory as symm_mem
    dev = torch.device("cuda", rank)
    n = nbytes // 4
    buf = symm_mem.empty(n, dtype=torch.float32, device=dev)
    buf.normal_()
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = hdl.get_buffer((rank + 1) % ws, (n,), torch.float32)
    local = torch.randn(n, device=dev)
    fns = {"pull": lambda: torch.neg(peer, out=local), "push": lambda: torch.neg(local, out=peer)}
    # Every rank runs every kernel once first: with lazy module loading, a rank's first call loads
    # the module (milliseconds), so rank 1 would start its "both" pull loop late and rank 0 time
    # most of its loop alone (372 GB/s instead of 336 with both really pulling).
    for fn in fns.values():
        fn()
    out = {}
    for who in ("one", "both"):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            dist.barrier()
            if who == "both" or rank == 0:
                out[f"sm_{name}_{who}_gbps"] = nbytes / back_to_back_median_us(fn, reps) / 1e3
            torch.cuda.synchronize()
            dist.barrier()
    peer = hdl = buf = None  # release the symmetric buffer (the lambdas above hold `peer` until then)
    return out
