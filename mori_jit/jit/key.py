"""The cache key: sha256 over everything that can change the binary, and nothing else.

``key = sha256(spec name, compiler signature, NIC, flags, include hash, source text[, link text])``.
The include hash walks the spec's source-dependency directories in sorted order over each file's path
*relative to the source root* and its bytes: coarse on purpose (it may over-invalidate, never
under-invalidate), and independent of where the tree lives. A spec with device libraries adds the
link text (:meth:`~mori_jit.jit.devlib.LinkInputs.key_text`: the sha256 of each linked archive's
bytes and of the library's headers); the key of a spec without any is what it was before linking
existed.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from .toolchain import Toolchain

__all__ = ["include_hash", "cache_key"]

_SEP = b"\x00$$\x00"


def include_hash(root: Path, deps: Iterable[str]) -> str:
    """sha256 over (relative path, bytes) of every file under ``root/<dep>`` for each dep, sorted."""
    h = hashlib.sha256()
    files: list[tuple[str, Path]] = []
    for dep in deps:
        base = root / dep
        if base.is_file():
            files.append((dep, base))
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for fn in filenames:
                p = Path(dirpath) / fn
                files.append((p.relative_to(root).as_posix(), p))
    for rel, p in sorted(files):
        h.update(rel.encode() + _SEP + p.read_bytes() + _SEP)
    return h.hexdigest()


def cache_key(spec_name: str, toolchain: Toolchain, inc_hash: str, source: str, link_text: str = "") -> str:
    """The hex key of one specialization (``link_text``: what it is device-linked with, if anything)."""
    h = hashlib.sha256()
    for part in (spec_name, *toolchain.key_parts(), inc_hash, source, *([link_text] if link_text else [])):
        h.update(part.encode() + _SEP)
    return h.hexdigest()
