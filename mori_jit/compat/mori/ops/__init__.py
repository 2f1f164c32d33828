"""``mori.ops``: mori's v1 names on mori-jit's op (:mod:`.dispatch_combine`), and
``dispatch_combine_v2``, mori's v2 op, which is the op mori-jit implements.

The names load on first use (PEP 562), as mori's own ``mori.ops`` loads its submodules: importing
the package imports neither torch nor the op (the spec registry walks every package of mori-jit,
and the CLI verbs that only render or key a kernel start without torch).
"""
from __future__ import annotations

import importlib

#: each public name and the module of this package that defines it (None: the name is a module)
_MODULE_OF = {"EpDispatchCombineConfig": ".dispatch_combine", "EpDispatchCombineKernelType": ".dispatch_combine",
              "EpDispatchCombineOp": ".dispatch_combine", "dispatch_combine": None, "dispatch_combine_v2": None}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    """Load a public name's module on first access."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _MODULE_OF[name]
    value = importlib.import_module(f".{name}", __name__) if module is None else \
        getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
