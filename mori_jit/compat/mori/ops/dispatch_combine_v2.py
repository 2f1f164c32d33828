"""``mori.ops.dispatch_combine_v2``: mori's v2 op is the op mori-jit implements; these are its names.

``EpDispatchCombineOp(cfg, comm)`` takes mori's ``mori.cco.Communicator`` (:mod:`..cco`) for its
group; the config is mori-jit's (:class:`mori_jit.ops.ep.EpDispatchCombineConfig`, mori's v2
fields plus mori-jit's own). Its calls: docs/design.md §6, docs/mori_compat.md.
"""
from __future__ import annotations

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp"]
