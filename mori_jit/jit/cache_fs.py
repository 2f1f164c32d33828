"""File operations below the cache root through directory handles: no path is resolved twice.

In a shared cache (``MORI_JIT_SHARED_CACHE``) the directories belong to others, who can rename
anything in them at any moment: a directory that was checked can be a link by the time a path
through it is used again, and a write or a removal by path would then land outside the cache. So
what mori-jit writes or removes below the root goes through a handle on the directory that holds
it: each level is opened relative to the one above with ``O_NOFOLLOW`` (a link is refused, never
followed), files are created with ``O_EXCL | O_NOFOLLOW`` and renamed into place, and removals
are ``unlinkat``/``rmdir`` relative to the held directory. The root itself may be a link (the
user's own choice of ``MORI_JIT_CACHE_DIR``).
"""
from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path
from typing import Iterator

from .cache_layout import CacheUnsafeError, check_stat, dir_mode

__all__ = ["open_dir", "open_dir_at", "make_dir_at", "remove_at", "empty_dir", "write_file_at",
           "replace_file_at", "is_same_dir", "DIR_FLAGS"]

#: Flags that open a directory and nothing else: a link, a file or a FIFO fails at once.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: How deep :func:`remove_at` descends: the cache's own trees are three levels deep, and a tree
#: nested deeper is left (and reported) rather than recursed into without bound.
_MAX_DEPTH = 32


def _refused(path: Path, e: OSError) -> OSError:
    if e.errno == errno.ELOOP:
        return CacheUnsafeError(f"cache directory {path} is a symbolic link: mori-jit follows no link below the "
                                f"cache root. Fix: remove it ('mori-jit cache clear' leaves it alone)")
    if e.errno == errno.ENOTDIR:
        return CacheUnsafeError(f"cache path {path} is not a directory. Fix: move it away, or point "
                                f"MORI_JIT_CACHE_DIR elsewhere")
    return e


@contextlib.contextmanager
def _held(fd: int, path: Path) -> Iterator[int]:
    try:
        check_stat(path, os.fstat(fd))
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_dir(path: Path, *, follow: bool = False) -> Iterator[int]:
    """A handle on the directory ``path`` (``follow``: the root may be a link to one), checked as
    :func:`~mori_jit.jit.cache_layout.check_stat` checks it; closed on exit."""
    flags = DIR_FLAGS & ~os.O_NOFOLLOW if follow else DIR_FLAGS
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise _refused(path, e) from None
    with _held(fd, path):
        yield fd


@contextlib.contextmanager
def open_dir_at(dfd: int, name: str, path: Path) -> Iterator[int]:
    """A handle on the directory ``name`` in the directory ``dfd`` (``path`` names it in errors),
    refusing a link; checked and closed as :func:`open_dir`. ``FileNotFoundError`` if missing."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dfd)
    except OSError as e:
        raise _refused(path, e) from None
    with _held(fd, path):
        yield fd


@contextlib.contextmanager
def make_dir_at(dfd: int, name: str, path: Path) -> Iterator[int]:
    """:func:`open_dir_at` of ``name`` in ``dfd``, created first (mode :func:`dir_mode`) if missing."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, dir_mode(), dir_fd=dfd)
    with open_dir_at(dfd, name, path) as fd:
        yield fd


def is_same_dir(dfd: int, name: str, fd: int) -> bool:
    """Whether ``name`` in ``dfd`` is (still) the directory held by ``fd``, not a link or another one."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def empty_dir(fd: int, _depth: int = 0) -> None:
    """Remove everything in the directory held by ``fd`` (see :func:`remove_at`)."""
    for name in os.listdir(fd):
        remove_at(fd, name, _depth)


def remove_at(dfd: int, name: str, _depth: int = 0) -> None:
    """Remove ``name`` in the directory ``dfd``: a file or a link is unlinked (what a link points to
    is never touched); a directory is opened without following a link, emptied through that handle,
    then removed. Errors raise (``FileNotFoundError`` when it is gone)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dfd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=dfd)  # (a link or a file: only the name goes)
        return
    try:
        if _depth >= _MAX_DEPTH:
            raise OSError(errno.ENOTEMPTY, f"{name} nests directories more than {_MAX_DEPTH} deep; left alone")
        empty_dir(fd, _depth + 1)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


def write_file_at(dfd: int, name: str, data: bytes, mode: int) -> None:
    """Create ``name`` in ``dfd`` (it must not exist, and is never a link followed) holding ``data``,
    fsynced. On any error, a partly written file is removed again."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
        raise
    os.close(fd)


def replace_file_at(dfd: int, name: str, data: bytes, mode: int) -> None:
    """Put ``data`` at ``name`` in ``dfd`` atomically: written to a fresh hidden name, then renamed
    over ``name`` (a link there is replaced, never followed). Nothing is left on error."""
    tmp = f".{name}.{uuid.uuid4().hex}.tmp"
    write_file_at(dfd, tmp, data, mode)
    try:
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
