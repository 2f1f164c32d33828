"""The spec registry: registering a :class:`~mori_jit.jit.spec.Spec` is all it takes to add a kernel.

Shipped specs are discovered, not listed: every module of the ``mori_jit`` package whose name is
``spec``/``specs`` or ends in ``_spec`` is imported by :func:`load_shipped_specs`, and registers
its specs at import time.
"""
from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .spec import Spec

__all__ = ["register", "get_spec", "all_specs", "load_shipped_specs"]

_SPECS: dict[str, "Spec"] = {}
_loaded = False
_load_lock = threading.Lock()


def register(spec: "Spec") -> "Spec":
    """Add ``spec`` under ``spec.name``; a second, different spec with the same name is an error."""
    old = _SPECS.get(spec.name)
    if old is not None and old is not spec:
        raise ValueError(f"spec {spec.name!r} is already registered by {type(old).__module__}")
    _SPECS[spec.name] = spec
    return spec


def _is_spec_module(modname: str) -> bool:
    last = modname.rsplit(".", 1)[-1]
    return last in ("spec", "specs") or last.endswith("_spec")


def load_shipped_specs() -> None:
    """Import every shipped spec module once (thread-safe)."""
    global _loaded
    if _loaded:
        return
    with _load_lock:
        if _loaded:
            return
        import mori_jit
        for info in pkgutil.walk_packages(mori_jit.__path__, "mori_jit."):
            if _is_spec_module(info.name):
                importlib.import_module(info.name)
        _loaded = True


def get_spec(name: str) -> "Spec":
    """The spec called ``name``; an unknown name raises ``KeyError`` listing the known ones."""
    load_shipped_specs()
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(f"unknown spec {name!r}; known specs: {', '.join(sorted(_SPECS)) or '(none)'}") from None


def all_specs() -> list["Spec"]:
    """Every registered spec (the shipped ones loaded first), by name."""
    load_shipped_specs()
    return [_SPECS[n] for n in sorted(_SPECS)]
