"""Training and prefill on the EP op: differentiable dispatch and combine, registered as
``torch.library`` custom ops (namespace ``mori_jit``), and the packed expert-sorted layout.

Map::

    registry     live ops by int handle; where each dispatch's routing lives now (its placement)
    legs         the differentiable forward calls and the exchanges of their backward passes
    library      the custom ops: schemas, fake implementations, autograd formulas
    functional   the calls by handle (traceable): dispatch, combine, combine_expert_major
    hooks        the op's own methods, when an input requires grad
    packed       the packed expert-sorted layout (grouped GEMMs with offsets) and its way back

Imports ``core`` and the top files of ``ops/ep`` only (``tests/test_layout.py``). Semantics, the
routing rule of the backward legs and the gradient dtypes: ``legs`` and docs/design.md.
"""
from __future__ import annotations

import importlib

#: Each public name and the module that defines it. Importing this package imports neither torch
#: nor the custom ops (the spec registry walks every package); a name loads its module on first use.
_MODULE_OF = {**{name: ".functional" for name in ("TrainDispatch", "register", "dispatch", "combine",
                                                   "combine_expert_major")},
              **{name: ".packed" for name in ("EpPackedLayout", "pack", "unpack", "combine_packed", "rows_bound")}}

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
