"""Building many kernels at once (``mori-jit precompile``): deduplicate, resolve, build in parallel.

The caller says what to build (``(spec, cfg)`` pairs) and prints; this module only builds, and
reports each kernel's outcome as it completes, so a long precompile shows progress.
"""
from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Iterable, Iterator, Optional

from . import cache
from .compile import CompileError, Resolved, build, resolve
from .toolchain import Toolchain

__all__ = ["Outcome", "resolve_targets", "build_all"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One kernel's result: ``status`` is ``compiled``, ``hit`` or ``FAILED`` (then ``error``)."""

    entry_name: str
    status: str
    seconds: float
    error: Optional[CompileError] = None


def resolve_targets(targets: Iterable[tuple[Any, Any]], toolchain: Toolchain) -> list[tuple[Any, Any, Resolved]]:
    """``(spec, cfg, resolved)`` for each distinct ``(spec, cfg)`` of ``targets``, in order. The
    include hash is read afresh (the sources may have changed since this process hashed them)."""
    seen: set = set()
    out = []
    for spec, cfg in targets:
        if (spec.name, cfg) in seen:
            continue
        seen.add((spec.name, cfg))
        out.append((spec, cfg, resolve(spec, cfg, toolchain, fresh_include_hash=True)))
    return out


def _one(item: tuple[Any, Any, Resolved], toolchain: Toolchain) -> Outcome:
    spec, cfg, res = item
    t0 = time.perf_counter()
    hit = cache.verify_entry(res.path) is not None
    try:
        build(spec, cfg, toolchain, resolved=res)
    except CompileError as e:
        return Outcome(res.entry_name, "FAILED", time.perf_counter() - t0, e)
    return Outcome(res.entry_name, "hit" if hit else "compiled", time.perf_counter() - t0)


def build_all(todo: list[tuple[Any, Any, Resolved]], toolchain: Toolchain, jobs: Optional[int] = None) -> Iterator[Outcome]:
    """Build every item of ``todo`` on ``jobs`` threads (default: the CPU count); yield each
    :class:`Outcome` as it completes. A failed kernel does not stop the others."""
    workers = max(1, jobs or (os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for fut in as_completed([pool.submit(_one, item, toolchain) for item in todo]):
            yield fut.result()
