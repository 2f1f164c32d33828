"""The cache's tree: the shape of each thing mori-jit makes there, which directories it trusts,
how it makes them, and the mark of a cache root.

Layout under the root (``MORI_JIT_CACHE_DIR``)::

    CACHEDIR.TAG                              marks the root as mori-jit's
    <arch>_<nic>/kernel.<entry>.<key>/        an entry: kernel.hip, kernel.<hsaco|cubin>, meta.json
    tmp/<uuid>/                               a build in progress: private (0700), flock-ed by its process
    tmp/dead-<uuid>/                          an entry being deleted
    locks/<key>.lock                          per-key compile locks
    failed/<entry>.<key[:16]>/kernel.hip      the source of a failed compile (MORI_JIT_KEEP_FAILED)
    jinja/__jinja2_<sha1>.cache               template bytecode of older versions (no longer read)

:func:`classify` sorts what is under a root into entries, the cache's bookkeeping and everything
else, by these shapes: ``mori-jit cache clear`` removes only the first two.

The cache holds kernels that get loaded onto the GPU, so a directory someone else can write is a
way to run their code as the user. A private cache (the default) is used only when its root and
every directory under it that mori-jit reads or writes is owned by the user (or by root) and is not
writable by group or others; anything else is refused with :class:`CacheUnsafeError`, which names
the directory, its owner and mode, and the fix. ``MORI_JIT_SHARED_CACHE=1`` accepts a directory of
another user (a team's cache): its files are then read as data only, and they are still checked,
and what mori-jit writes or removes there goes through directory handles that refuse links
(:mod:`~mori_jit.jit.cache_fs`), as the directories' owners can swap any of them for a link.

The root of a cache carries ``CACHEDIR.TAG`` (the standard marker that also keeps backup tools out),
naming mori-jit: only under a marked root does ``cache clear`` remove the cache's bookkeeping.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import re
import stat
import uuid
from pathlib import Path

from . import knobs
from .toolchain import ARCH_PATTERN

__all__ = ["CacheUnsafeError", "check_dir", "check_stat", "make_dir", "dir_mode", "file_mode", "MARKER_NAME",
           "is_marked", "write_marker", "classify", "Contents", "is_real_dir", "children", "SOURCE_NAME",
           "META_NAME", "BINARY_NAMES", "ENTRY_FILES", "ARCH_DIR_RE", "ENTRY_DIR_RE", "BUILD_DIR_RE", "TMP",
           "LOCKS", "FAILED"]

SOURCE_NAME = "kernel.hip"
META_NAME = "meta.json"
#: The binary's file name, by vendor (an entry reads no other name).
BINARY_NAMES = {"amd": "kernel.hsaco", "nvidia": "kernel.cubin"}
ENTRY_FILES = frozenset({SOURCE_NAME, META_NAME, *BINARY_NAMES.values()})
TMP, LOCKS, FAILED, LEGACY_JINJA = "tmp", "locks", "failed", "jinja"

ARCH_DIR_RE = re.compile(rf"({ARCH_PATTERN})_([A-Za-z0-9._-]+)")
ENTRY_DIR_RE = re.compile(r"kernel\.([A-Za-z0-9_]+)\.([0-9a-f]{64})")
BUILD_DIR_RE = re.compile(r"(dead-)?[0-9a-f]{32}")
_LOCK_RE = re.compile(r"[0-9a-f]{64}\.lock")
_FAILED_RE = re.compile(r"[A-Za-z0-9_]+\.[0-9a-f]{16}")
_JINJA_RE = re.compile(r"__jinja2_[0-9a-f]{40}\.cache")

MARKER_NAME = "CACHEDIR.TAG"
_MARKER_TMP_RE = re.compile(rf"\.{re.escape(MARKER_NAME)}\.[0-9a-f]{{32}}\.tmp")
_MARKER_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"  # https://bford.info/cachedir/
_MARKER_TEXT = (f"{_MARKER_SIGNATURE}\n"
                "# This directory is a mori-jit kernel cache (MORI_JIT_CACHE_DIR).\n"
                "# 'mori-jit cache clear' removes what mori-jit made here and nothing else.\n")


class CacheUnsafeError(PermissionError):
    """A cache directory others could write, or a link where a directory belongs: such a cache is not used."""


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _trusted_owner(uid: int) -> bool:
    # root can replace any file anyway, so a root-owned directory adds no one who could
    return uid in (os.geteuid(), 0)


def check_stat(path: Path, st: os.stat_result) -> None:
    """Raise :class:`CacheUnsafeError` unless ``st`` (of ``path``) is a directory the cache may
    trust: a real directory, and (unless ``MORI_JIT_SHARED_CACHE``) owned by the user or root and
    not writable by group or others."""
    if stat.S_ISLNK(st.st_mode):
        raise CacheUnsafeError(f"cache directory {path} is a symbolic link: mori-jit follows no link below the "
                               f"cache root. Fix: remove it ('mori-jit cache clear' leaves it alone)")
    if not stat.S_ISDIR(st.st_mode):
        raise CacheUnsafeError(f"cache path {path} is not a directory (mode {stat.filemode(st.st_mode)}). "
                               f"Fix: move it away, or point MORI_JIT_CACHE_DIR elsewhere")
    if knobs.cache.shared:
        return
    foreign = not _trusted_owner(st.st_uid)
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if not (foreign or writable):
        return
    why = []
    if foreign:
        why.append(f"owned by {_owner(st.st_uid)}, not by you ({_owner(os.geteuid())})")
    if writable:
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
        why.append(f"writable by {who}")
    fix = ("point MORI_JIT_CACHE_DIR at a directory of your own, or set MORI_JIT_SHARED_CACHE=1 to use it as a "
           "shared cache (read as data, entries still checked)")
    if not foreign:
        fix = f"'chmod go-w {path}', or " + fix
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}" if foreign else f"owner {_owner(st.st_uid)}, mode " \
                                                                  f"{stat.S_IMODE(st.st_mode):04o}"
    raise CacheUnsafeError(f"cache directory {path} is {' and '.join(why)} ({mode}): another user could plant "
                           f"a kernel there that mori-jit would load. Fix: {fix}")


def check_dir(path: Path, *, follow: bool = False) -> None:
    """:func:`check_stat` of ``path`` (``follow``: the root may be a link to a directory; nothing
    below it may). ``FileNotFoundError`` if it does not exist."""
    check_stat(path, os.stat(path) if follow else os.lstat(path))


def dir_mode() -> int:
    """Mode for a new cache directory: private 0755 (others may read, so a colleague can use it as
    a shared cache), shared 0777 (the umask decides, as a team's directory needs)."""
    return 0o777 if knobs.cache.shared else 0o755


def file_mode() -> int:
    """Mode for a file the cache writes: private 0644, shared 0666 (the umask decides)."""
    return 0o666 if knobs.cache.shared else 0o644


def make_dir(path: Path, *, follow: bool = False) -> Path:
    """Create ``path`` (one level; its parent must exist) unless it exists, then check it."""
    try:
        os.mkdir(path, dir_mode())
    except FileExistsError:
        pass
    check_dir(path, follow=follow)
    return path


def is_marked(root: Path) -> bool:
    """Whether ``root`` carries mori-jit's ``CACHEDIR.TAG`` (a regular file naming mori-jit)."""
    p = root / MARKER_NAME
    try:
        if not stat.S_ISREG(os.lstat(p).st_mode):
            return False
        with open(p, encoding="utf-8", errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return False
    return text.startswith(_MARKER_SIGNATURE) and "mori-jit" in text


def write_marker(root: Path) -> None:
    """Write mori-jit's ``CACHEDIR.TAG`` into ``root`` (atomically: tmp file + rename). On an error
    (a full disk) the tmp file is removed again and the error names the marker."""
    tmp = root / f".{MARKER_NAME}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode())
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_MARKER_TEXT)
        os.replace(tmp, root / MARKER_NAME)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {root / MARKER_NAME}: {e.strerror or e}") from None
        raise


# ------------------------------------------------------------------------------------------------
# what is under a root
# ------------------------------------------------------------------------------------------------

def children(d: Path) -> list[Path]:
    """The entries of directory ``d``, sorted (none if it is missing or not a directory)."""
    try:
        return sorted(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _lmode(p: Path) -> int:
    try:
        return os.lstat(p).st_mode
    except OSError:
        return 0


def is_real_dir(p: Path) -> bool:
    """Whether ``p`` is a directory and not a link to one."""
    return stat.S_ISDIR(_lmode(p))


def _only_files(d: Path, allowed: frozenset[str]) -> bool:
    """Whether ``d`` is a real directory holding nothing but non-directories named in ``allowed``."""
    return is_real_dir(d) and all(p.name in allowed and not stat.S_ISDIR(_lmode(p)) for p in children(d))


def _only_names(d: Path, allowed: frozenset[str]) -> bool:
    """Whether ``d`` is a real directory holding nothing but names in ``allowed`` (whatever they are)."""
    return is_real_dir(d) and all(p.name in allowed for p in children(d))


@dataclasses.dataclass
class Contents:
    """What is under a cache root, by kind (paths, sorted).

    ``entries``: entry-shaped directories holding only entry file names; ``builds``: build dirs in
    ``tmp/``; ``bookkeeping``: lock files, kept failed sources, legacy template bytecode;
    ``containers``: the directories holding them (removed when emptied); ``foreign``: the rest, at
    the first level where it differs from the cache's shapes, each with why it is not the cache's.
    """

    entries: list[Path] = dataclasses.field(default_factory=list)
    builds: list[Path] = dataclasses.field(default_factory=list)
    bookkeeping: list[Path] = dataclasses.field(default_factory=list)
    containers: list[Path] = dataclasses.field(default_factory=list)
    foreign: list[tuple[Path, str]] = dataclasses.field(default_factory=list)


_BOOKKEEPING = {  # directory -> (shape of an item, is that item a directory holding only these names)
    LOCKS: (_LOCK_RE, None),
    FAILED: (_FAILED_RE, frozenset({SOURCE_NAME})),
    LEGACY_JINJA: (_JINJA_RE, None),
}


def _entry_extras(d: Path) -> str:
    extras = [p.name for p in children(d) if p.name not in ENTRY_FILES]
    return ("an entry holding what mori-jit did not make: " + ", ".join(extras[:3]) +
            (f" and {len(extras) - 3} more" if len(extras) > 3 else "")) if extras else "not a directory"


def classify(root: Path) -> Contents:
    """Sort what is under ``root`` by the cache's shapes (no link is followed)."""
    out = Contents()
    alien = "not made by mori-jit"
    for top in children(root):
        name, mode = top.name, _lmode(top)
        if not mode:  # gone since the listing (a marker renamed into place, an entry deleted)
            continue
        if name == MARKER_NAME and stat.S_ISREG(mode):
            continue
        if _MARKER_TMP_RE.fullmatch(name) and stat.S_ISREG(mode):  # a marker being written
            out.bookkeeping.append(top)
            continue
        if not is_real_dir(top):
            out.foreign.append((top, alien))
            continue
        if ARCH_DIR_RE.fullmatch(name):
            for p in children(top):
                # (a member that is a directory or a link is a damaged entry: still the cache's)
                if ENTRY_DIR_RE.fullmatch(p.name) and _only_names(p, ENTRY_FILES):
                    out.entries.append(p)
                else:
                    out.foreign.append((p, _entry_extras(p) if ENTRY_DIR_RE.fullmatch(p.name) else alien))
        elif name == TMP:
            for p in children(top):
                if BUILD_DIR_RE.fullmatch(p.name) and is_real_dir(p):
                    out.builds.append(p)
                else:
                    out.foreign.append((p, alien))
        elif name in _BOOKKEEPING:
            shape, files = _BOOKKEEPING[name]
            for p in children(top):
                if shape.fullmatch(p.name) and (_only_files(p, files) if files else stat.S_ISREG(_lmode(p))):
                    out.bookkeeping.append(p)
                else:
                    out.foreign.append((p, alien))
        else:
            out.foreign.append((top, alien))
            continue
        out.containers.append(top)
    return out
