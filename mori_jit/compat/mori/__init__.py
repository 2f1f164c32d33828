"""mori's Python API on mori-jit's op, for code that imports ``mori`` (SGLang's and vLLM's mori
backends): after :func:`install`, ``import mori`` and ``import mori.<name>`` give this package and
its module ``<name>`` (the same module objects, so state is never duplicated). The guide, the
engine flags and what is refused: docs/mori_compat.md.

================================ =======================================================
``mori``                         this package
``mori.ops``                     :mod:`.ops`: mori's v1 names (``EpDispatchCombineConfig``,
                                 ``EpDispatchCombineKernelType``, ``EpDispatchCombineOp``)
``mori.ops.dispatch_combine``    :mod:`.ops.dispatch_combine`: the same (mori's v1 module)
``mori.ops.dispatch_combine_v2`` :mod:`.ops.dispatch_combine_v2`: mori-jit's op (mori's v2)
``mori.cco``                     :mod:`.cco`: ``Communicator`` on ``torch.distributed``
``mori.shmem``                   :mod:`.shmem`: the process group mori's v1 op runs on
================================ =======================================================

A real ``mori`` always wins: :func:`install` never shadows one that is loaded or importable, it
leaves it and warns. The aliases are an import hook of this process, installed at no cost (nothing
is imported until ``import mori``), so every process that imports ``mori`` calls :func:`install`
first (docs/mori_compat.md shows how for an engine's worker processes).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import warnings

__all__ = ["ALIASES", "install", "uninstall", "installed"]

_log = logging.getLogger(__name__)

#: the public import names and the modules they give (``mori.<name>`` gives ``<this package>.<name>``)
ALIASES = {alias: __name__ + alias[len("mori"):] for alias in
           ("mori", "mori.ops", "mori.ops.dispatch_combine", "mori.ops.dispatch_combine_v2", "mori.cco", "mori.shmem")}


class _AliasLoader(importlib.abc.Loader):
    """Gives the module of this package an alias stands for (imported once, under its own name)."""

    def __init__(self, target: str):
        self.target, self.spec = target, None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # (the import system set the alias's spec on it: the module keeps its own)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``mori`` and ``mori.<name>`` -> this package and its module ``<name>`` (where there is one)."""

    def find_spec(self, name, path=None, target=None):
        if name != "mori" and not name.startswith("mori."):
            return None
        real = __name__ + name[len("mori"):]
        spec = sys.modules[real].__spec__ if real in sys.modules else importlib.util.find_spec(real)
        if spec is None:
            return None
        return importlib.util.spec_from_loader(name, _AliasLoader(real),
                                               is_package=spec.submodule_search_locations is not None)


_FINDER = _AliasFinder()
#: ``mori.<name>`` an engine reads as an attribute right after ``import mori`` (mori loads them lazily)
_SUBMODULES = tuple(alias.split(".")[1] for alias in ALIASES if alias.count(".") == 1)


def __getattr__(name: str):
    """``mori.ops``, ``mori.cco``, ``mori.shmem`` load on first access, as mori's own do (PEP 562)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def installed() -> bool:
    """Whether ``import mori`` gives this package (:func:`install` ran and no real mori won)."""
    return _FINDER in sys.meta_path


def install() -> bool:
    """Make ``import mori`` (and ``mori.<name>``) run on mori-jit. Returns True when the aliases
    are in place (also when they already were); False, with a warning, when a real ``mori`` is
    loaded or importable: it is left alone."""
    if installed():
        return True
    loaded = sys.modules.get("mori")
    where = getattr(loaded, "__file__", None) or repr(loaded) if loaded is not None else None
    if loaded is None:
        spec = importlib.util.find_spec("mori")
        if spec is not None:
            where = spec.origin or ", ".join(spec.submodule_search_locations or ()) or "?"
    if where is not None:
        warnings.warn(f"mori_jit.compat.mori.install(): a real mori is {'loaded' if loaded else 'importable'} "
                      f"({where}); it is left alone and `import mori` keeps giving it", RuntimeWarning, stacklevel=2)
        return False
    sys.meta_path.insert(0, _FINDER)
    _log.info("mori_jit.compat.mori: `import mori` now runs on mori-jit (%s)", ", ".join(ALIASES))
    return True


def uninstall() -> None:
    """Undo :func:`install`: the hook, and the ``mori`` modules it gave (never a real mori's)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == "mori" or n.startswith("mori.")]:
        if getattr(sys.modules[name], "__name__", "").startswith(__name__):
            del sys.modules[name]
