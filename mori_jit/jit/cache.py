"""The content-addressed on-disk cache.

Layout: ``<root>/<arch>_<nic>/kernel.<entry>.<key>/{kernel.hip, kernel.<hsaco|cubin>, meta.json}``.
An entry is built in ``<root>/tmp/<uuid>/``, its files and directory are fsynced, and the directory
is published with one ``rename``: readers see a whole entry or none. The loser of a race deletes its
own tmp and uses the winner's (same name = same content). ``meta.json`` records the binary's sha256;
an entry whose binary is missing or differs is corrupt: it is removed and rebuilt, never loaded.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from . import knobs

__all__ = ["Entry", "cache_root", "entry_dir", "new_tmp_dir", "publish", "verify_entry", "list_entries",
           "discard", "SOURCE_NAME", "META_NAME"]

SOURCE_NAME = "kernel.hip"
META_NAME = "meta.json"


@dataclasses.dataclass(frozen=True)
class Entry:
    """A published, verified cache entry."""

    path: Path
    binary: Path
    meta: dict


def cache_root() -> Path:
    """The cache directory (``MORI_JIT_CACHE_DIR``, see :mod:`mori_jit.jit.knobs`)."""
    return knobs.cache.dir


def entry_dir(arch: str, nic: str, entry_name: str, key: str) -> Path:
    """Where the entry for ``key`` lives (it need not exist)."""
    return cache_root() / f"{arch}_{nic}" / f"kernel.{entry_name}.{key}"


def new_tmp_dir() -> Path:
    """A fresh private directory under the cache's ``tmp/``, on the entries' filesystem (so a
    finished build is published by one rename)."""
    d = cache_root() / "tmp" / uuid.uuid4().hex
    d.mkdir(parents=True)
    return d


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(p: Path) -> str:
    """Hex SHA-256 of the file's bytes."""
    return hashlib.sha256(p.read_bytes()).hexdigest()


def discard(path: Path) -> None:
    """Remove a directory without ever exposing a half-deleted entry: rename into tmp/, then delete."""
    graveyard = cache_root() / "tmp" / f"dead-{uuid.uuid4().hex}"
    try:
        graveyard.parent.mkdir(parents=True, exist_ok=True)
        os.rename(path, graveyard)
    except FileNotFoundError:
        return
    shutil.rmtree(graveyard, ignore_errors=True)


def publish(tmp: Path, final: Path) -> bool:
    """Atomically move the finished ``tmp`` entry to ``final``; False if another process won the race.

    ``tmp`` must hold the source, the binary and ``meta.json``. The loser's ``tmp`` is deleted.
    """
    for f in tmp.iterdir():
        _fsync_path(f)
    _fsync_path(tmp)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    _fsync_path(final.parent)
    return True


def verify_entry(path: Path) -> Entry | None:
    """The entry at ``path`` if it is complete and its binary matches ``meta.json``, else None."""
    try:
        meta = json.loads((path / META_NAME).read_text())
        binary = path / meta["binary"]
        if sha256_file(binary) != meta["binary_sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Entry(path, binary, meta)


def list_entries() -> list[Path]:
    """Every published entry directory, sorted."""
    root = cache_root()
    if not root.is_dir():
        return []
    return sorted(p for d in root.iterdir() if d.is_dir() and d.name != "tmp" and d.name != "locks"
                  for p in d.iterdir() if p.is_dir() and p.name.startswith("kernel."))
