"""One CUDA-graph capture for the GPU tests and the benchmarks, and one graph timer."""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

__all__ = ["capture", "graph_us", "QUEUE_AHEAD_CYCLES"]

#: GPU cycles a benchmark sleeps before a timed loop, so that the host queues the loop ahead of
#: the GPU (the loop then measures the device, not the launches).
QUEUE_AHEAD_CYCLES = 20_000_000


def capture(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``step()`` once on a side stream (the warm-up: everything it launches is compiled and
    allocated outside capture), then capture it in a CUDA graph; returns ``(graph, what the captured
    step returned)``. Replaying the graph rewrites those returned tensors in place."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def graph_us(fn: Callable[[], Any], iters: int) -> float:
    """Median µs of ``iters`` back-to-back replays of a graph of ``fn`` (each between two events,
    the loop queued behind a GPU sleep)."""
    g, _ = capture(fn)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
    ev[0].record()
    for i in range(iters):
        g.replay()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(iters)) * 1e3
