"""Where the device sources come from (``kernels/`` and ``templates/``).

Order: ``MORI_JIT_SOURCE_ROOT`` → the checkout this package sits in (an editable install or
``PYTHONPATH=.`` compiles the live tree) → the copy shipped inside the wheel (``mori_jit/_sources``).
The checkout wins over any packaged copy, so editing a header is never silently ignored.
"""
from __future__ import annotations

import functools
from pathlib import Path

from . import knobs

__all__ = ["source_root", "default_source_root", "source_root_origin", "kernels_dir", "templates_dir",
           "SourceRootError"]

_PKG = Path(__file__).resolve().parent.parent  # .../mori_jit


class SourceRootError(RuntimeError):
    """No directory with both ``kernels/`` and ``templates/`` was found."""


def _is_root(p: Path) -> bool:
    return (p / "kernels").is_dir() and (p / "templates").is_dir()


def source_root() -> Path:
    """The resolved source root (re-read each call: ``MORI_JIT_SOURCE_ROOT`` may change in tests)."""
    env = knobs.source.root
    if env is not None:
        if not _is_root(env):
            raise SourceRootError(f"MORI_JIT_SOURCE_ROOT={env} does not hold kernels/ and templates/")
        return env.resolve()
    return default_source_root()


def source_root_origin(root: Path) -> str:
    """Where ``root`` (a :func:`source_root` answer) comes from: ``MORI_JIT_SOURCE_ROOT``, ``packaged copy`` or ``checkout``."""
    if knobs.source.root is not None:
        return "MORI_JIT_SOURCE_ROOT"
    packaged = _PKG / "_sources"
    return "packaged copy" if root in (packaged, packaged.resolve()) else "checkout"


@functools.lru_cache(maxsize=1)
def default_source_root() -> Path:
    """The source root while ``MORI_SOURCE_ROOT`` is unset: the checkout, else the packaged copy."""
    for cand in (_PKG.parent, _PKG / "_sources"):
        if _is_root(cand):
            return cand
    raise SourceRootError(f"no kernels/ and templates/ next to {_PKG} or in {_PKG / '_sources'}; "
                          f"set MORI_JIT_SOURCE_ROOT to a checkout")


def kernels_dir() -> Path:
    """``kernels/`` under the source root (the include directory of every kernel)."""
    return source_root() / "kernels"


def templates_dir() -> Path:
    """``templates/`` under the source root (the Jinja translation-unit templates)."""
    return source_root() / "templates"
