"""Compile one specialization into the cache (or find it there).

:func:`resolve` renders the source and computes the key (no compiler run); :func:`build` returns a
verified :class:`~mori_jit.jit.cache.Entry`, compiling on a miss. A per-key file lock (package
``filelock``) keeps N ranks from running N identical compiles; it is an optimisation only: on a
lock timeout the build proceeds anyway and the atomic publish keeps the cache correct.

Exception contract: a failing compiler raises :class:`CompileError` (command, stderr, kept source
path); a missing compiler raises :class:`~mori_jit.jit.toolchain.ToolchainError`; nothing here
exits the interpreter.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import logging
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import filelock

from . import cache, knobs
from .key import cache_key, include_hash
from .log import apply_verbosity
from .paths import kernels_dir, source_root
from .spec import Spec
from .toolchain import Toolchain

__all__ = ["CompileError", "Resolved", "resolve", "build", "build_many"]

_logger = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """The device compiler failed. ``cmd``, ``stderr`` and ``source_path`` (None unless kept)."""

    def __init__(self, spec: str, cmd: list[str], returncode: int, stderr: str, source_path: Path | None):
        self.spec, self.cmd, self.returncode, self.stderr, self.source_path = spec, cmd, returncode, stderr, source_path
        kept = f"source kept at {source_path}" if source_path else "set MORI_JIT_KEEP_FAILED=1 to keep the source"
        super().__init__(f"compiling {spec} failed (exit {returncode}); {kept}\n"
                         f"command: {' '.join(cmd)}\n{stderr.strip()[-4000:]}")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A rendered specialization: its source, entry name, key and cache directory."""

    spec: str
    entry_name: str
    source: str
    key: str
    path: Path


@functools.lru_cache(maxsize=64)
def _include_hash_cached(root: str, deps: tuple[str, ...]) -> str:
    return include_hash(Path(root), deps)


def resolve(spec: Spec, cfg: Any, toolchain: Toolchain, *, fresh_include_hash: bool = False) -> Resolved:
    """Render ``cfg`` and compute its key. The include hash is memoized per process unless ``fresh``."""
    root = source_root()
    deps = tuple(spec.source_deps())
    inc = include_hash(root, deps) if fresh_include_hash else _include_hash_cached(str(root), deps)
    src = spec.render_source(cfg, toolchain)
    key = cache_key(spec.name, toolchain, inc, src)
    name = spec.entry_name(cfg)
    return Resolved(spec.name, name, src, key, cache.entry_dir(toolchain.arch, toolchain.nic, name, key))


def _compile_into(res: Resolved, toolchain: Toolchain, tmp: Path) -> None:
    src = tmp / cache.SOURCE_NAME
    src.write_text(res.source)
    binary = tmp / f"kernel.{toolchain.binary_ext}"
    cmd = toolchain.command(src, binary, [kernels_dir()])
    _logger.debug("%s", " ".join(cmd))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=toolchain.env(), cwd=tmp)
        rc, err = p.returncode, p.stderr + p.stdout
    except OSError as e:
        rc, err = -1, str(e)
    if rc != 0 or not binary.is_file() or binary.stat().st_size == 0:
        kept = None
        if knobs.cache.keep_failed:
            kept = cache.cache_root() / "failed" / f"{res.entry_name}.{res.key[:16]}"
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, kept / cache.SOURCE_NAME)
            kept = kept / cache.SOURCE_NAME
        raise CompileError(res.spec, cmd, rc, err or "(no output; empty binary)", kept)
    meta = {"spec": res.spec, "entry": res.entry_name, "key": res.key, "arch": toolchain.arch,
            "nic": toolchain.nic, "binary": binary.name, "binary_sha256": cache.sha256_file(binary),
            "command": cmd, "compile_s": round(time.perf_counter() - t0, 3)}
    (tmp / cache.META_NAME).write_text(json.dumps(meta, indent=1))


def build(spec: Spec, cfg: Any, toolchain: Toolchain, *, resolved: Resolved | None = None) -> cache.Entry:
    """The verified entry for ``cfg``, compiling it on a miss (or when the entry is corrupt)."""
    apply_verbosity()
    res = resolved or resolve(spec, cfg, toolchain)
    entry = cache.verify_entry(res.path)
    if entry is not None:
        _logger.debug("hit %s", res.path.name)
        return entry
    lock_path = cache.cache_root() / "locks" / f"{res.key}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path), timeout=knobs.cache.lock_timeout_s)
    try:
        lock.acquire()
        locked = True
    except filelock.Timeout:
        _logger.info("lock %s still held after %ss; compiling anyway", lock_path, knobs.cache.lock_timeout_s)
        locked = False
    try:
        # Look before verifying: an entry that appears between the two checks was just published by
        # another process (whose lock wait timed out) and must not be taken for a corrupt one.
        existed = res.path.exists()
        entry = cache.verify_entry(res.path)  # another process may have built it meanwhile
        if entry is not None:
            return entry
        if existed:
            _logger.info("corrupt entry %s: rebuilding", res.path)
            cache.discard(res.path)
        _logger.info("compiling %s for %s", res.entry_name, toolchain.arch)
        tmp = cache.new_tmp_dir()
        try:
            _compile_into(res, toolchain, tmp)
            cache.publish(tmp, res.path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if locked:
            lock.release()
    entry = cache.verify_entry(res.path)
    if entry is None:
        raise RuntimeError(f"cache entry {res.path} failed verification right after publishing")
    return entry


def build_many(requests: Sequence[tuple[Spec, Any]], toolchain: Toolchain, jobs: int | None = None) -> list[cache.Entry]:
    """:func:`build` for each ``(spec, cfg)``, compiling misses in parallel threads (compilers are
    subprocesses, so threads suffice). Entries come back in request order; the first failure raises
    after the other compiles have finished (so nothing is left half-written)."""
    if len(requests) <= 1:
        return [build(s, c, toolchain) for s, c in requests]
    workers = max(1, min(len(requests), jobs or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(build, s, c, toolchain) for s, c in requests]
    return [f.result() for f in futures]
