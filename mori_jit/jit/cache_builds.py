"""Build directories: where a compile writes an entry before it is published, and their leftovers.

A build runs in ``tmp/<uuid>/`` under the cache root (the entries' filesystem, so the finished
entry is published by one rename) and holds a ``flock`` on it while it runs; the kernel drops the
lock when the process dies. A build dir that no process holds and that is older than
:data:`STALE_BUILD_S` is a killed compile's leftover: the next compile removes it
(:func:`sweep_stale_builds`), ``mori-jit cache ls`` counts it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

from .cache import cache_root, writable_root
from .cache_layout import BUILD_DIR_RE, TMP, children, dir_mode, is_real_dir, make_dir

__all__ = ["build_dir", "build_dir_state", "build_dirs", "sweep_stale_builds", "remove_tree", "STALE_BUILD_S"]

#: A build dir this old whose process holds no flock on it is a killed compile's leftover. Any age
#: above the instant between a build dir's mkdir and its flock would do; minutes leave room for
#: the clocks of a network filesystem.
STALE_BUILD_S = 600.0


@contextlib.contextmanager
def build_dir() -> Iterator[Path]:
    """A fresh private directory under ``tmp/`` (on the entries' filesystem, so a finished build is
    published by one rename), flock-ed while the build runs and removed afterwards unless published."""
    d = make_dir(writable_root() / TMP) / uuid.uuid4().hex
    os.mkdir(d, dir_mode())  # (its mode is the published entry's)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # (released by the kernel if this process dies)
        yield d
    finally:
        if os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
        os.close(fd)


def build_dir_state(d: Path, now: float | None = None, min_age_s: float = STALE_BUILD_S) -> str:
    """``"active"`` (a live build holds its flock, or it is younger than ``min_age_s``: too young to
    tell) or ``"stale"`` (a killed build's leftover)."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
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


def build_dirs() -> list[Path]:
    """The build directories under ``tmp/`` (live, stale or being deleted)."""
    return [d for d in children(cache_root() / TMP) if BUILD_DIR_RE.fullmatch(d.name) and is_real_dir(d)]


def sweep_stale_builds() -> int:
    """Remove killed builds' leftovers (see :func:`build_dir_state`); returns how many were removed."""
    now, removed = time.time(), 0
    for d in build_dirs():
        if build_dir_state(d, now) == "stale":
            shutil.rmtree(d, ignore_errors=True)
            removed += not d.exists()
    return removed


def remove_tree(p: Path) -> None:
    """Remove the file or directory tree at ``p``, following no link; errors raise."""
    if is_real_dir(p):
        shutil.rmtree(p)  # (refuses a link at the top, unlinks links inside)
    else:
        os.unlink(p)
