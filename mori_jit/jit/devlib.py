"""Device libraries: archives a kernel is device-linked against, their headers, and a module hook.

A :class:`DeviceLibrary` says where an install may be (settings first, then a Python package such
as a wheel), what must be in it (a headers directory and the archives to link), how to read its
version, and what to run on each module loaded from a binary linked against it (NVSHMEM:
``nvshmemx_cumodule_init``). A spec lists the libraries its kernel needs in
:attr:`~mori_jit.jit.spec.Spec.device_libraries`; the compile step then builds the source as
relocatable device code, device-links it with the archives into one binary
(:mod:`mori_jit.jit.compile`), and the plan runs the hooks after loading the module
(:mod:`mori_jit.jit.plan`).

Anything linked in as a binary enters the cache key by its bytes: :func:`link_inputs` hashes every
archive and every file under the library's headers directory (by its path relative to that
directory), so other bytes give another key and the same bytes at another path the same key. The
build links copies of the archives whose bytes it checks against the key's hashes
(:meth:`LinkInputs.stage`): what is linked is what was keyed.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

from .key import include_hash
from .knobs import Setting
from .toolchain import ToolchainError

__all__ = ["DeviceLibrary", "DeviceLibraryError", "Located", "LinkInputs", "link_inputs"]


class DeviceLibraryError(ToolchainError):
    """A device library is not installed where it was looked for, or changed while a build used it."""


@dataclasses.dataclass(frozen=True)
class Located:
    """An install of a device library: its root, headers, archives (absolute), version and origin."""

    name: str
    home: Path
    include_dir: Path
    archives: tuple[Path, ...]
    version: str
    origin: str


class DeviceLibrary(abc.ABC):
    """One device library. Subclass with the class attributes below; one instance per library."""

    #: short name (``nvshmem``): in errors, ``mori-jit info`` and the key
    name: str = ""
    #: the archives to link, relative to the install's root
    archives: tuple[str, ...] = ()
    #: the headers directory relative to the root (put on the include path; its files enter the key)
    include: str = "include"
    #: a header that must be in the headers directory (proves an install is one of this library)
    marker_header: str = ""
    #: settings naming an install's root, by precedence; the first one set is used and must hold the library
    home_settings: tuple[Setting, ...] = ()
    #: import name of a Python package that is such an install (its directory is the root), and its
    #: distribution name (what ``pip install`` takes)
    package: str = ""
    distribution: str = ""

    def __repr__(self) -> str:
        return f"<DeviceLibrary {self.name}>"

    def version(self, home: Path) -> str:
        """The version of the install at ``home`` (``unknown`` unless a subclass reads it)."""
        return "unknown"

    def init_module(self, handle: int) -> None:
        """Run on each module loaded from a binary linked against this library (``handle``: the
        driver's module handle as an int), with the module's device current. Default: nothing."""

    def install_hint(self) -> str:
        """How to get the library (the end of every not-found error)."""
        ways = [f"pip install {self.distribution}"] if self.distribution else []
        ways += [f"set {s.var} to an install holding {self._required_text()}" for s in self.home_settings[:1]]
        return " or ".join(ways) or f"install {self.name}"

    def _required(self, home: Path) -> list[Path]:
        files = [home / self.include / self.marker_header] if self.marker_header else [home / self.include]
        return files + [home / a for a in self.archives]

    def _required_text(self) -> str:
        return " and ".join(p.as_posix() for p in self._required(Path(".")))

    def package_home(self) -> Optional[Path]:
        """The directory of the Python package :attr:`package`, or None when it is not installed."""
        if not self.package:
            return None
        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):  # (a parent package missing)
            return None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        return Path(locations[0]) if locations else None

    def _at(self, home: Path, origin: str) -> Located:
        missing = [p for p in self._required(home) if not p.exists()]
        if missing:
            raise DeviceLibraryError(f"{self.name}: {origin} points at {home}, which lacks "
                                     f"{', '.join(str(p) for p in missing)}; {self.install_hint()}")
        home = home.resolve()
        return Located(self.name, home, home / self.include, tuple(home / a for a in self.archives),
                       self.version(home), origin)

    def locate(self) -> Located:
        """The install to use: the first of :attr:`home_settings` that is set (it must hold the
        library: an explicit choice never falls back), else the Python package :attr:`package`.
        None found raises :class:`DeviceLibraryError` naming every place looked at and how to get it."""
        for s in self.home_settings:
            home = s.read()
            if home is not None:
                return self._at(Path(home), s.var)
        home = self.package_home()
        if home is not None:
            return self._at(home, f"the Python package {self.distribution or self.package}")
        tried = [f"{s.var} is unset" for s in self.home_settings]
        if self.package:
            tried.append(f"the Python package {self.distribution or self.package} ({self.package}) is not installed")
        raise DeviceLibraryError(f"{self.name} not found: {', '.join(tried) or 'nowhere to look'}; "
                                 f"{self.install_hint()}")


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    # Memoized by the file's identity: a replaced or rewritten archive is hashed again.
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _archive_sha256(path: Path) -> str:
    st = os.stat(path)
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=16)
def _headers_sha256(include_dir: str) -> str:
    return include_hash(Path(include_dir), ["."])


@dataclasses.dataclass(frozen=True)
class LinkInputs:
    """What a spec's kernel is linked with: the located libraries, the sha256 of each archive
    (``archive_sha256[i][j]``: library i, archive j) and of each library's headers."""

    libraries: tuple[Located, ...]
    archive_sha256: tuple[tuple[str, ...], ...]
    headers_sha256: tuple[str, ...]

    @property
    def include_dirs(self) -> list[Path]:
        """The libraries' headers directories, for the compile's include path."""
        return [lib.include_dir for lib in self.libraries]

    def key_text(self) -> str:
        """What enters the cache key: each library's name, headers hash and archive hashes (no path)."""
        return "\n".join(f"{lib.name} headers={hdr} archives={','.join(shas)}"
                         for lib, hdr, shas in zip(self.libraries, self.headers_sha256, self.archive_sha256))

    def describe(self) -> list[dict]:
        """One JSON-able record per archive (for an entry's ``meta.json``)."""
        return [{"library": lib.name, "version": lib.version, "origin": lib.origin, "archive": str(a),
                 "sha256": sha}
                for lib, shas in zip(self.libraries, self.archive_sha256) for a, sha in zip(lib.archives, shas)]

    def stage(self, write: Callable[[str, bytes], None]) -> list[Path]:
        """Copy every archive into a build directory through ``write(name, data)`` and return the
        copies' names (relative to it), in link order. An archive whose bytes are not the ones keyed
        raises :class:`DeviceLibraryError` (the file changed since)."""
        out = []
        for i, (lib, shas) in enumerate(zip(self.libraries, self.archive_sha256)):
            for j, (src, want) in enumerate(zip(lib.archives, shas)):
                data = src.read_bytes()
                got = hashlib.sha256(data).hexdigest()
                if got != want:
                    raise DeviceLibraryError(f"{lib.name}: {src} changed after the cache key was computed "
                                             f"(sha256 {want[:16]}... then, {got[:16]}... now); run again")
                name = f"{i}.{j}.{src.name}"
                write(name, data)
                out.append(Path(name))
        return out


def link_inputs(libraries: Sequence[DeviceLibrary], *, fresh: bool = False) -> LinkInputs:
    """Locate ``libraries`` and hash their archives and headers. The headers hash is memoized per
    process by directory unless ``fresh`` (as the include hash is); an archive's by its identity
    (path, size, mtime, inode). A library not found raises :class:`DeviceLibraryError`."""
    located = tuple(lib.locate() for lib in libraries)
    if fresh:
        _headers_sha256.cache_clear()
    return LinkInputs(located, tuple(tuple(_archive_sha256(a) for a in lib.archives) for lib in located),
                      tuple(_headers_sha256(str(lib.include_dir)) for lib in located))
