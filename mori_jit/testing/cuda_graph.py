"""One CUDA-graph capture for the GPU tests and the benchmarks."""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["capture"]


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
