"""The content-addressed on-disk cache: reading entries, and the root that is written into.

The tree's layout, the shapes of its items and which directories are trusted are in
:mod:`~mori_jit.jit.cache_layout`; listing, verifying and clearing the whole cache in
:mod:`~mori_jit.jit.cache_admin`; building, publishing and discarding entries in
:mod:`~mori_jit.jit.cache_builds`.

Reading trusts nothing in the entry: it opens only the entry's own fixed file names, relative to
the entry directory, as regular files (no link, FIFO or device) of bounded size, and checks
``meta.json`` field by field against the directory's name (key, entry, arch, NIC, binary name) and
the binary against its sha256. Anything else is :class:`CorruptEntry`: the compiler rebuilds it,
``mori-jit cache verify`` reports it. A hit writes nothing, so a read-only cache serves hits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Iterator

from . import knobs
from .cache_layout import (ARCH_DIR_RE, BINARY_NAMES, ENTRY_DIR_RE, LOCKS, META_NAME, SOURCE_NAME,
                           CacheUnsafeError, check_dir, check_stat, children, classify, is_marked, is_real_dir,
                           make_dir, write_marker)
from .toolchain import vendor_of

__all__ = ["Entry", "CorruptEntry", "CacheUnsafeError", "cache_root", "entry_dir", "read_entry", "verify_entry",
           "list_entries", "lock_path", "writable_root", "sha256_file", "SOURCE_NAME", "META_NAME", "BINARY_NAMES",
           "MAX_BYTES"]

#: Size bounds of an entry's files (far above any real one; a bigger file is corrupt, never read).
MAX_BYTES = {META_NAME: 1 << 16, SOURCE_NAME: 16 << 20, **{b: 256 << 20 for b in BINARY_NAMES.values()}}


class CorruptEntry(Exception):
    """An entry directory exists but is not a whole, consistent entry; the message says why."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """A published, verified cache entry. ``binary`` is its path; :meth:`read_binary` its checked bytes."""

    path: Path
    binary: Path
    meta: dict

    def read_binary(self) -> bytes:
        """The binary's bytes, read once more through the same checks and matched against the
        sha256 in ``meta.json`` (what is loaded is what was verified). :class:`CorruptEntry` if not."""
        with _open_dir(self.path) as dfd:
            data = _read_member(dfd, self.binary.name)
        if hashlib.sha256(data).hexdigest() != self.meta["binary_sha256"]:
            raise CorruptEntry(f"{self.binary} changed after it was verified")
        return data


def cache_root() -> Path:
    """The cache directory (``MORI_JIT_CACHE_DIR``, see :mod:`mori_jit.jit.knobs`)."""
    return knobs.cache.dir


def entry_dir(arch: str, nic: str, entry_name: str, key: str) -> Path:
    """Where the entry for ``key`` lives (it need not exist)."""
    name = f"kernel.{entry_name}.{key}"
    if not ENTRY_DIR_RE.fullmatch(name) or not ARCH_DIR_RE.fullmatch(f"{arch}_{nic}"):
        raise ValueError(f"no cache entry can be named {arch}_{nic}/{name} (entry names are letters, digits "
                         f"and '_'; keys are sha256 hex)")
    return cache_root() / f"{arch}_{nic}" / name


def sha256_file(p: Path) -> str:
    """Hex SHA-256 of the file's bytes."""
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------
# reading an entry
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _open_dir(path: Path) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptEntry(f"{path.name} is not a directory") from None
        raise
    try:
        check_stat(path, os.fstat(fd))
        yield fd
    finally:
        os.close(fd)


def _read_member(dfd: int, name: str) -> bytes:
    """The bytes of ``name`` in the directory ``dfd``: a regular file (opened without following a
    link or blocking on a FIFO) within its size bound, written by a trusted owner."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise CorruptEntry(f"{name} missing") from None
    except OSError as e:
        raise CorruptEntry(f"{name} cannot be opened ({'a symbolic link' if e.errno == errno.ELOOP else e.strerror})") \
            from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # (checked before reading: a directory cannot be read as a file)
        os.close(fd)
        raise CorruptEntry(f"{name} is not a regular file ({stat.filemode(st.st_mode)})")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_BYTES[name]:
            raise CorruptEntry(f"{name} has {st.st_size} bytes, more than the {MAX_BYTES[name]} allowed")
        if not knobs.cache.shared and (st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022):
            raise CorruptEntry(f"{name} is writable by another user (owner uid {st.st_uid}, mode "
                               f"{stat.S_IMODE(st.st_mode):04o})")
        data = f.read(MAX_BYTES[name] + 1)
    if len(data) > MAX_BYTES[name]:
        raise CorruptEntry(f"{name} grew beyond {MAX_BYTES[name]} bytes while read")
    return data


_META_FIELDS = {"spec": str, "entry": str, "key": str, "arch": str, "nic": str, "binary": str, "binary_sha256": str}


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _parse_meta(data: bytes, arch_dir: str, entry: str, key: str, binary_name: str) -> dict:
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError) as e:  # (RecursionError: nesting deeper than the parser's stack)
        raise CorruptEntry(f"{META_NAME} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise CorruptEntry(f"{META_NAME} is not a JSON object")
    for k, t in _META_FIELDS.items():
        if not isinstance(meta.get(k), t):
            raise CorruptEntry(f"{META_NAME} field {k!r} is missing or not a {t.__name__} (got {_short(meta.get(k))})")
    expect = {"key": key, "entry": entry, "binary": binary_name}
    for k, want in expect.items():
        if meta[k] != want:
            raise CorruptEntry(f"{META_NAME} {k} {_short(meta[k])} does not match this entry's {want!r}")
    if f"{meta['arch']}_{meta['nic']}" != arch_dir:
        raise CorruptEntry(f"{META_NAME} arch/nic {_short(meta['arch'])}/{_short(meta['nic'])} do not match "
                           f"the directory {arch_dir!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", meta["binary_sha256"]):
        raise CorruptEntry(f"{META_NAME} binary_sha256 {_short(meta['binary_sha256'])} is not a sha256")
    return meta


def _entry_names(path: Path) -> tuple[str, str, str]:
    """(binary name, entry name, key) of an entry path, from its directory names."""
    a, e = ARCH_DIR_RE.fullmatch(path.parent.name), ENTRY_DIR_RE.fullmatch(path.name)
    if a is None or e is None:
        raise ValueError(f"{path} is not a cache entry path (<arch>_<nic>/kernel.<entry>.<key>)")
    return BINARY_NAMES[vendor_of(a.group(1))], e.group(1), e.group(2)


def read_entry(path: Path) -> Entry | None:
    """The entry at ``path``; None if there is none. :class:`CorruptEntry` if the directory exists
    but is not a whole entry; :class:`~mori_jit.jit.cache_layout.CacheUnsafeError` if a directory on
    the way is one others could write."""
    binary_name, entry, key = _entry_names(path)
    try:
        check_dir(path.parent.parent, follow=True)
        check_dir(path.parent)
    except FileNotFoundError:
        return None
    try:
        with _open_dir(path) as dfd:
            meta = _parse_meta(_read_member(dfd, META_NAME), path.parent.name, entry, key, binary_name)
            data = _read_member(dfd, binary_name)
            _read_member(dfd, SOURCE_NAME)
    except FileNotFoundError:  # (only the directory: a missing member is CorruptEntry)
        return None
    if not data:
        raise CorruptEntry(f"{binary_name} is empty")
    sha = hashlib.sha256(data).hexdigest()
    if sha != meta["binary_sha256"]:
        raise CorruptEntry(f"binary sha256 {sha[:16]}... of {binary_name} does not match {META_NAME} "
                           f"({meta['binary_sha256'][:16]}...)")
    return Entry(path, path / binary_name, meta)


def verify_entry(path: Path) -> Entry | None:
    """The entry at ``path`` if it is whole and consistent, else None (see :func:`read_entry`)."""
    try:
        return read_entry(path)
    except CorruptEntry:
        return None


def list_entries() -> list[Path]:
    """Every path shaped like an entry (``<arch>_<nic>/kernel.<entry>.<key>``) in the arch
    directories (links are not followed; a link or file with an entry's name is listed, to be
    reported as corrupt), sorted."""
    return sorted(p for d in children(cache_root()) if ARCH_DIR_RE.fullmatch(d.name) and is_real_dir(d)
                  for p in children(d) if ENTRY_DIR_RE.fullmatch(p.name))


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------

def writable_root() -> Path:
    """The cache root, ready to write into: created (and marked) if new, checked, and marked if it
    holds nothing but cache items. A directory holding anything else that is not marked as
    mori-jit's is refused (``RuntimeError`` naming what is there): it is not a cache."""
    root = cache_root()
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
    make_dir(root, follow=True)
    if not is_marked(root):
        foreign = [str(p.relative_to(root)) for p, _ in classify(root).foreign]
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise RuntimeError(f"MORI_JIT_CACHE_DIR={root} is not a mori-jit cache (no CACHEDIR.TAG naming "
                               f"mori-jit) and holds what mori-jit did not make: {shown}. Fix: point "
                               f"MORI_JIT_CACHE_DIR at a new or empty directory")
        write_marker(root)
    return root


def lock_path(key: str) -> Path:
    """The per-key compile lock file (its directory created and checked)."""
    return make_dir(writable_root() / LOCKS) / f"{key}.lock"
