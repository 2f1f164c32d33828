"""Build directories and publishing: where a compile writes an entry, how it becomes one, how one
is discarded, and the leftovers of killed compiles.

A build runs in a private directory ``tmp/<uuid>/`` under the cache root (mode 0700, owned by the
user; on the entries' filesystem, so the finished entry is published by one rename) and holds a
``flock`` on it while it runs; the kernel drops the lock when the process dies. Everything goes
through the handle on that directory (:mod:`~mori_jit.jit.cache_fs`): its files are written
relative to it, the compiler runs in it (its working directory is set through ``/proc/self/fd``
to that very directory) and is given names relative to it, and the entry is published by moving
exactly its three files into a fresh subdirectory and renaming that, relative to held handles.
So a ``tmp/`` or build directory renamed or swapped for a link mid-build (the owner of a shared
cache can) redirects no write, and what else a compiler leaves in its working directory (the
files of ``-save-temps``) never enters the entry.

A build dir that no process holds and that is older than :data:`STALE_BUILD_S` is a killed
compile's leftover: the next compile removes it (:func:`sweep_stale_builds`), ``mori-jit cache
ls`` counts it. Being private, in a shared cache only its owner (or root) can remove it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Iterator, Sequence

from . import cache_fs, knobs
from .cache import cache_root, writable_root
from .cache_layout import (BUILD_DIR_RE, FAILED, SOURCE_NAME, TMP, CacheUnsafeError, dir_mode, file_mode)

__all__ = ["BuildDir", "build_dir", "publish", "discard", "keep_failed_source", "build_dir_state",
           "build_dir_states", "sweep_stale_builds", "STALE_BUILD_S"]

#: A build dir this old whose process holds no flock on it is a killed compile's leftover. Any age
#: above the instant between a build dir's mkdir and its flock would do; minutes leave room for
#: the clocks of a network filesystem.
STALE_BUILD_S = 600.0

#: The subdirectory of a build dir that becomes the entry.
_STAGE = "entry"


@dataclasses.dataclass(frozen=True)
class BuildDir:
    """A private build directory, reached only through ``fd`` (``path`` names it in messages) and
    ``root_fd``, a handle on the cache root it is published into."""

    path: Path
    fd: int
    root_fd: int

    @contextlib.contextmanager
    def working_dir(self) -> Iterator[tuple[str, int]]:
        """``(cwd, fd)`` that run a subprocess in this directory: ``cwd`` is ``/proc/self/fd/<fd>``, the
        held directory whatever its path names now; pass ``fd`` on (``pass_fds``). It is a fresh
        handle, not the flock-ed one, so a compiler outliving a killed build does not keep it active."""
        fd = os.open(".", cache_fs.DIR_FLAGS, dir_fd=self.fd)
        try:
            yield f"/proc/self/fd/{fd}", fd
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes) -> None:
        """Create the file ``name`` holding ``data`` (it must not exist)."""
        cache_fs.write_file_at(self.fd, name, data, file_mode())

    def read(self, name: str) -> bytes | None:
        """The bytes of the regular file ``name``; None if it is missing or not a regular file."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()


def _check_private(path: Path, fd: int) -> None:
    """Refuse a build dir that is not the fresh private one just made (another was put in its place)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or os.listdir(fd):
        raise CacheUnsafeError(f"build directory {path} was replaced right after it was made (owner uid "
                               f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): someone who can write "
                               f"{path.parent} is interfering; nothing was compiled")


@contextlib.contextmanager
def build_dir() -> Iterator[BuildDir]:
    """A fresh private directory under ``tmp/``, flock-ed while the build runs and removed afterwards
    (what was published is no longer in it)."""
    root = writable_root()
    name = uuid.uuid4().hex
    path = root / TMP / name
    with cache_fs.open_dir(root, follow=True) as rfd, cache_fs.make_dir_at(rfd, TMP, root / TMP) as tfd:
        os.mkdir(name, 0o700, dir_fd=tfd)
        with cache_fs.open_dir_at(tfd, name, path) as fd:
            _check_private(path, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)  # (released by the kernel if this process dies)
            try:
                yield BuildDir(path, fd, rfd)
            finally:
                with contextlib.suppress(OSError):
                    cache_fs.empty_dir(fd)
                    if cache_fs.is_same_dir(tfd, name, fd):  # (not whatever was renamed to its name)
                        os.rmdir(name, dir_fd=tfd)


def _seal(dfd: int, name: str) -> None:
    """Make the staged file ``name`` read-only for others (a private cache) and fsync it."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        if not knobs.cache.shared:  # (a umask of 002 would leave it group-writable)
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~0o022)
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(build: BuildDir, final: Path, members: Sequence[str]) -> bool:
    """Publish the build's files ``members`` as the entry ``final`` (``<root>/<arch>_<nic>/<name>``):
    they move into a fresh subdirectory, are fsynced, and it is renamed to ``final`` in one step, so
    readers see a whole entry or none. False if another process published it first (this build's
    copy goes with the build dir; same name, same content)."""
    os.mkdir(_STAGE, dir_mode(), dir_fd=build.fd)
    with cache_fs.open_dir_at(build.fd, _STAGE, build.path / _STAGE) as sfd:
        for name in members:
            os.rename(name, name, src_dir_fd=build.fd, dst_dir_fd=sfd)
            _seal(sfd, name)
        os.fsync(sfd)
    with cache_fs.make_dir_at(build.root_fd, final.parent.name, final.parent) as afd:
        try:
            os.rename(_STAGE, final.name, src_dir_fd=build.fd, dst_dir_fd=afd)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return False
        os.fsync(afd)
    return True


def discard(path: Path) -> None:
    """Remove the entry directory ``path`` without ever exposing a half-deleted entry: it is renamed
    into ``tmp/``, then deleted there, through directory handles (a link in its place is unlinked;
    nothing it points to is touched). Failing to delete it there leaves a ``dead-`` dir that the
    next compile's sweep removes."""
    root = writable_root()
    grave = f"dead-{uuid.uuid4().hex}"
    with cache_fs.open_dir(root, follow=True) as rfd, cache_fs.make_dir_at(rfd, TMP, root / TMP) as tfd:
        try:
            with cache_fs.open_dir_at(rfd, path.parent.name, path.parent) as afd:
                os.rename(path.name, grave, src_dir_fd=afd, dst_dir_fd=tfd)
        except FileNotFoundError:
            return
        with contextlib.suppress(OSError):
            cache_fs.remove_at(tfd, grave)


def keep_failed_source(entry_name: str, key: str, source: str) -> Path:
    """Keep the source of a failed compile at ``failed/<entry>.<key[:16]>/kernel.hip``; returns it.
    It is written to a fresh name and renamed over ``kernel.hip``, so a link planted there is
    replaced, never written through."""
    root = writable_root()
    name = f"{entry_name}.{key[:16]}"
    with cache_fs.open_dir(root, follow=True) as rfd, \
            cache_fs.make_dir_at(rfd, FAILED, root / FAILED) as ffd, \
            cache_fs.make_dir_at(ffd, name, root / FAILED / name) as dfd:
        cache_fs.replace_file_at(dfd, SOURCE_NAME, source.encode(), file_mode())
    return root / FAILED / name / SOURCE_NAME


# ------------------------------------------------------------------------------------------------
# leftovers
# ------------------------------------------------------------------------------------------------

def build_dir_state(tmp_fd: int, name: str, now: float | None = None, min_age_s: float = STALE_BUILD_S) -> str:
    """``"active"`` (a live build holds its flock, or it is younger than ``min_age_s``: too young to
    tell) or ``"stale"`` (a killed build's leftover), of the build dir ``name`` in ``tmp/`` (``tmp_fd``)."""
    try:
        fd = os.open(name, cache_fs.DIR_FLAGS, dir_fd=tmp_fd)
    except OSError:
        return "active"
    try:
        if (now or time.time()) - os.fstat(fd).st_mtime < min_age_s:
            return "active"
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return "active"
        return "stale"
    finally:
        os.close(fd)


@contextlib.contextmanager
def _tmp_dir() -> Iterator[int | None]:
    """A handle on ``tmp/`` (None when there is none, or none to trust)."""
    root = cache_root()
    with contextlib.ExitStack() as stack:
        try:
            rfd = stack.enter_context(cache_fs.open_dir(root, follow=True))
            tfd = stack.enter_context(cache_fs.open_dir_at(rfd, TMP, root / TMP))
        except (FileNotFoundError, CacheUnsafeError):
            tfd = None
        yield tfd


def _is_dir_at(dfd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def build_dir_states(min_age_s: float = STALE_BUILD_S) -> dict[str, str]:
    """Each build dir in ``tmp/`` (live, stale or being deleted) by name: its :func:`build_dir_state`."""
    now = time.time()
    with _tmp_dir() as tfd:
        if tfd is None:
            return {}
        return {n: build_dir_state(tfd, n, now, min_age_s) for n in sorted(os.listdir(tfd))
                if BUILD_DIR_RE.fullmatch(n) and _is_dir_at(tfd, n)}


def sweep_stale_builds() -> int:
    """Remove killed builds' leftovers (see :func:`build_dir_state`); returns how many were removed."""
    removed = 0
    with _tmp_dir() as tfd:
        if tfd is None:
            return 0
        now = time.time()
        for name in sorted(os.listdir(tfd)):
            if BUILD_DIR_RE.fullmatch(name) and build_dir_state(tfd, name, now) == "stale":
                try:
                    cache_fs.remove_at(tfd, name)
                except OSError:  # (another user's private build dir, or gone meanwhile)
                    continue
                removed += 1
    return removed
