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

from mori_jit.ops.ep.train.functional import TrainDispatch, combine, combine_expert_major, dispatch, register
from mori_jit.ops.ep.train.packed import EpPackedLayout, combine_packed, pack, unpack

__all__ = ["TrainDispatch", "register", "dispatch", "combine", "combine_expert_major", "EpPackedLayout", "pack",
           "unpack", "combine_packed"]
