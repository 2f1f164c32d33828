"""Compile one specialization into the cache (or find it there).

:func:`resolve` renders the source and computes the key (no compiler run); :func:`build` returns a
verified :class:`~mori_jit.jit.cache.Entry`, compiling on a miss. The compiler runs in a private
build directory (:mod:`~mori_jit.jit.cache_builds`) and is given names relative to it; only the
entry's three files are published from there, whatever else it wrote. A spec with device libraries
(:mod:`mori_jit.jit.devlib`) is compiled as relocatable device code and device-linked with their
archives into the entry's one binary; the object and the archive copies stay in the build
directory, so an entry holds the same three files either way. A per-key file lock (package
``filelock``) keeps N ranks from running N identical compiles; it is an optimisation only: on a
lock timeout the build proceeds anyway and the atomic publish keeps the cache correct.

Exception contract: a failing compiler or device linker raises :class:`CompileError` (step, command,
stderr, kept source path); a missing compiler raises :class:`~mori_jit.jit.toolchain.ToolchainError`,
a missing device library its subclass :class:`~mori_jit.jit.devlib.DeviceLibraryError`; a compile
that a stop killed raises :class:`~mori_jit.jit.procs.Stopped`; nothing here exits the interpreter.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Optional, Sequence

import filelock

from . import cache, cache_builds, knobs, procs
from .devlib import LinkInputs, link_inputs
from .key import cache_key, include_hash
from .log import apply_verbosity, level_for
from .paths import kernels_dir, source_root
from .spec import Spec
from .toolchain import Toolchain

__all__ = ["CompileError", "Resolved", "resolve", "build", "build_many"]


class CompileError(RuntimeError):
    """The device compiler (or linker) failed. ``step`` (``compiling``/``linking``), ``cmd``,
    ``stderr`` and ``source_path`` (None unless kept)."""

    def __init__(self, spec: str, cmd: list[str], returncode: int, stderr: str, source_path: Path | None,
                 step: str = "compiling"):
        self.spec, self.cmd, self.returncode, self.stderr, self.source_path = spec, cmd, returncode, stderr, source_path
        self.step = step
        kept = f"source kept at {source_path}" if source_path else "set MORI_JIT_KEEP_FAILED=1 to keep the source"
        super().__init__(f"{step} {spec} failed (exit {returncode}); {kept}\n"
                         f"command: {' '.join(cmd)}\n{stderr.strip()[-4000:]}")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A rendered specialization: its source, entry name, key, cache directory, and what it is
    device-linked with (None: nothing)."""

    spec: str
    entry_name: str
    source: str
    key: str
    path: Path
    link: Optional[LinkInputs] = None


@functools.lru_cache(maxsize=64)
def _include_hash_cached(root: str, deps: tuple[str, ...]) -> str:
    return include_hash(Path(root), deps)


def resolve(spec: Spec, cfg: Any, toolchain: Toolchain, *, fresh_include_hash: bool = False) -> Resolved:
    """Render ``cfg`` and compute its key. The include hash (and a device library's headers hash)
    is memoized per process unless ``fresh``. A device library not found raises
    :class:`~mori_jit.jit.devlib.DeviceLibraryError`."""
    root = source_root()
    deps = tuple(spec.source_deps())
    inc = include_hash(root, deps) if fresh_include_hash else _include_hash_cached(str(root), deps)
    src = spec.render_source(cfg, toolchain)
    link = link_inputs(spec.device_libraries, fresh=fresh_include_hash) if spec.device_libraries else None
    key = cache_key(spec.name, toolchain, inc, src, link.key_text() if link else "")
    name = spec.entry_name(cfg)
    return Resolved(spec.name, name, src, key, cache.entry_dir(toolchain.arch, toolchain.nic, name, key), link)


_logger = logging.getLogger(__name__)


def _log(msg: str, level: int = 1) -> None:
    """Log ``msg`` at the level a ``MORI_JIT_VERBOSE`` of ``level`` shows (0: always, as a warning)."""
    _logger.log(level_for(level), msg)


def _keep_source(res: Resolved) -> Path | None:
    """The kept source of a failed compile (``MORI_JIT_KEEP_FAILED``), or None; failing to keep it
    is logged and never hides the compile's own error."""
    if not knobs.cache.keep_failed:
        return None
    try:
        return cache_builds.keep_failed_source(res.entry_name, res.key, res.source)
    except OSError as e:
        _log(f"could not keep the failed source of {res.entry_name}: {e}", 0)
        return None


def _run_step(res: Resolved, toolchain: Toolchain, cmd: list[str], out: str, build_dir: cache_builds.BuildDir,
              step: str) -> None:
    """Run one compiler command in the build dir that must write ``out`` there; :class:`CompileError`
    if it does not."""
    _log(" ".join(cmd), 2)
    try:  # (procs.Stopped, when a stop kills it, propagates: a stopped compile is no failure)
        with build_dir.working_dir() as (cwd, fd):
            rc, err = procs.run(cmd, env=toolchain.env(), cwd=cwd, pass_fds=(fd,))
    except OSError as e:
        rc, err = -1, str(e)
    if rc != 0 or not build_dir.read(out):
        raise CompileError(res.spec, cmd, rc, err or "(no output; empty binary)", _keep_source(res), step)


def _compile_into(res: Resolved, toolchain: Toolchain, build_dir: cache_builds.BuildDir) -> list[str]:
    """Compile (and link) ``res`` in the build dir, with names relative to it; returns the names of
    the entry's files there (anything else the compiler wrote stays out of the entry)."""
    src = Path(cache.SOURCE_NAME)
    build_dir.write(src.name, res.source.encode())
    binary = Path(cache.BINARY_NAMES[toolchain.vendor])
    t0 = time.perf_counter()
    meta: dict[str, Any] = {}
    if res.link is None:
        cmd = toolchain.command(src, binary, [kernels_dir()])
        _run_step(res, toolchain, cmd, binary.name, build_dir, "compiling")
    else:
        obj = Path("kernel.rdc.o")
        cmd = toolchain.command(src, obj, [kernels_dir(), *res.link.include_dirs], relocatable=True)
        _run_step(res, toolchain, cmd, obj.name, build_dir, "compiling")
        link_cmd = toolchain.link_command([obj, *res.link.stage(build_dir.write)], binary)
        _run_step(res, toolchain, link_cmd, binary.name, build_dir, "linking")
        meta = {"link_command": link_cmd, "linked": res.link.describe()}
    meta = {"spec": res.spec, "entry": res.entry_name, "key": res.key, "arch": toolchain.arch,
            "nic": toolchain.nic, "binary": binary.name,
            "binary_sha256": hashlib.sha256(build_dir.read(binary.name) or b"").hexdigest(),
            "command": cmd, **meta, "compile_s": round(time.perf_counter() - t0, 3)}
    text = json.dumps(meta, indent=1).encode()
    if len(text) > cache.MAX_BYTES[cache.META_NAME]:  # (a reader would refuse it: never publish one)
        raise RuntimeError(f"{cache.META_NAME} of {res.entry_name} would have {len(text)} bytes, more than the "
                           f"{cache.MAX_BYTES[cache.META_NAME]} a reader accepts: the commands it records are too "
                           f"long (they hold MORI_JIT_EXTRA_FLAGS and the include paths)")
    build_dir.write(cache.META_NAME, text)
    return [src.name, binary.name, cache.META_NAME]


def _lookup(path: Path) -> cache.Entry | None:
    """The entry at ``path``; None if missing; a corrupt one is reported, removed and None."""
    try:
        return cache.read_entry(path)
    except cache.CorruptEntry as e:
        _log(f"corrupt cache entry {path}: {e}; rebuilding it", 0)
        cache_builds.discard(path)
        return None


def _acquire(lock_path: Path) -> filelock.FileLock | None:
    """The per-key lock, or None when it cannot be had in time (or at all, as in a cache another
    user's lock files fill): it only saves duplicate compiles, the atomic publish keeps the cache right."""
    lock = filelock.FileLock(str(lock_path), timeout=knobs.cache.lock_timeout_s)
    try:
        lock.acquire()
    except filelock.Timeout:
        _log(f"lock {lock_path} still held after {knobs.cache.lock_timeout_s}s; compiling anyway")
        return None
    except OSError as e:
        _log(f"lock {lock_path} unusable ({e.strerror or e}); compiling without it")
        return None
    return lock


def build(spec: Spec, cfg: Any, toolchain: Toolchain, *, resolved: Resolved | None = None) -> cache.Entry:
    """The verified entry for ``cfg``, compiling it on a miss (or when the entry is corrupt).

    A hit only reads the cache. A corrupt entry is reported on stderr and rebuilt. Raises
    :class:`~mori_jit.jit.cache.CacheUnsafeError` for a cache directory others could write.
    """
    apply_verbosity()
    res = resolved or resolve(spec, cfg, toolchain)
    try:
        entry = cache.read_entry(res.path)
    except cache.CorruptEntry:
        entry = None  # looked at again under the lock (another process may be replacing it)
    if entry is not None:
        _log(f"hit {res.path.name}", 2)
        return entry
    lock = _acquire(cache.lock_path(res.key))
    try:
        entry = _lookup(res.path)  # another process may have built it meanwhile
        if entry is not None:
            return entry
        swept = cache_builds.sweep_stale_builds()
        if swept:
            _log(f"removed {swept} build dirs of killed compiles from {cache.cache_root() / 'tmp'}")
        _log(f"compiling {res.entry_name} for {toolchain.arch}")
        with cache_builds.build_dir() as build_dir:
            cache_builds.publish(build_dir, res.path, _compile_into(res, toolchain, build_dir))
    finally:
        if lock is not None:
            lock.release()
    try:
        entry = cache.read_entry(res.path)
    except cache.CorruptEntry as e:
        raise RuntimeError(f"cache entry {res.path} failed verification right after publishing: {e}") from None
    if entry is None:
        raise RuntimeError(f"cache entry {res.path} vanished right after publishing")
    return entry


def build_many(requests: Sequence[tuple[Spec, Any]], toolchain: Toolchain, jobs: int | None = None) -> list[cache.Entry]:
    """:func:`build` for each ``(spec, cfg)``, compiling misses in parallel threads (compilers are
    subprocesses, so threads suffice). Entries come back in request order; the first failure raises
    after the other compiles have finished (so nothing is left half-written). An interrupt stops
    them instead (:func:`~mori_jit.jit.procs.halt`) and propagates."""
    if len(requests) <= 1:
        return [build(s, c, toolchain) for s, c in requests]
    workers = max(1, min(len(requests), jobs or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(build, s, c, toolchain) for s, c in requests]
        try:
            wait(futures)
        except BaseException:
            procs.halt(futures)
            raise
    return [f.result() for f in futures]
