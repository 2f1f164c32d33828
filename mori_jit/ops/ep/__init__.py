"""Expert-parallel dispatch/combine (docs/design.md §6).

Importing this package imports neither torch nor a backend: the spec registry walks it to find
``specs.py``, and the CLI verbs that only render or key a kernel must start without torch. The public
names below load their modules (and torch) on first use.
"""
from __future__ import annotations

import importlib

#: Each public name and the module that defines it.
_MODULE_OF = {"EpDispatchCombineConfig": ".config", "EpDispatchCombineOp": ".op", "EpDeviceError": ".kernel_set",
              "EpUnsupportedError": ".kernel_set", "EpPeerError": ".arguments", "KernelSet": ".kernel_set",
              "EpDispatchResult": ".results", "EpExpertLayout": ".results", "EpCapacityError": ".results"}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    """Load a public name's module on first access (PEP 562)."""
    try:
        module = _MODULE_OF[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
