"""Building many kernels at once (``mori-jit precompile``): deduplicate, resolve, build in parallel.

The caller says what to build (``(spec, cfg)`` pairs) and prints; this module only builds, and
reports each kernel's outcome as it completes, so a long precompile shows progress. An interrupt
stops the build (:func:`mori_jit.jit.procs.halt`): no kernel starts, running compiles are killed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, Callable, Iterable, Optional

from . import cache, procs
from .cache import CacheUnsafeError
from .compile import CompileError, Resolved, build, resolve
from .toolchain import Toolchain

__all__ = ["Outcome", "resolve_targets", "build_all"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One kernel's result: ``status`` is ``compiled``, ``hit``, ``FAILED`` (then ``error``: the
    :class:`CompileError`, or an ``OSError`` naming the path it could not write) or ``stopped`` (its
    compile was killed by a stop)."""

    entry_name: str
    status: str
    seconds: float
    error: Optional[Exception] = None


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
    except CacheUnsafeError:  # (the cache as a whole is refused: one error, not one per kernel)
        raise
    except OSError as e:  # a full disk, a read-only cache: this kernel fails, the others are tried
        return Outcome(res.entry_name, "FAILED", time.perf_counter() - t0, _write_error(e, res))
    except procs.Stopped:
        return Outcome(res.entry_name, "stopped", time.perf_counter() - t0)
    return Outcome(res.entry_name, "hit" if hit else "compiled", time.perf_counter() - t0)


def _write_error(e: OSError, res: Resolved) -> OSError:
    """``e`` as one line naming the path it failed on: its file, else the entry being built (whose
    build directory is on the same filesystem)."""
    code = f" ({errno.errorcode[e.errno]})" if e.errno in errno.errorcode else ""
    what = f"{e.filename} (building the cache entry {res.path})" if e.filename else f"the cache entry {res.path}"
    return OSError(f"cannot write {what}: {e.strerror or e}{code}")


def build_all(todo: list[tuple[Any, Any, Resolved]], toolchain: Toolchain, jobs: Optional[int] = None,
              report: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Build every item of ``todo`` on ``jobs`` threads (default: the CPU count); call ``report``
    with each :class:`Outcome` as it completes, in the calling thread, and return them all. A
    failed kernel does not stop the others.

    An exception in the calling thread (``KeyboardInterrupt``, the exception a signal handler
    raises, one that ``report`` raises) stops the build: no kernel starts, the running compiles
    are killed and their build directories removed, the kernels that ended meanwhile are
    reported (a killed one as ``stopped``), and the exception propagates.
    """
    workers = max(1, jobs or (os.cpu_count() or 1))
    done: dict[Future, Outcome] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_one, item, toolchain) for item in todo]
        try:
            for fut in as_completed(futures):
                done[fut] = fut.result()
                report(done[fut])
        except BaseException:
            procs.halt(futures)
            with contextlib.suppress(Exception):  # (the report that failed may fail again: the stop goes on)
                for fut in futures:
                    if fut not in done and fut.done() and not fut.cancelled() and fut.exception() is None:
                        done[fut] = fut.result()
                        report(done[fut])
            raise
    return list(done.values())
