"""Shims that let code written against another package's API run on mori-jit's op.

* :mod:`mori_jit.compat.mori`: mori's Python API (``import mori``) as SGLang's and vLLM's mori
  backends call it (docs/mori_compat.md).

Direction: compat builds on :mod:`mori_jit.ops.ep` (its public names and the op's own arguments);
nothing in :mod:`mori_jit.ops` imports compat (``tests/test_mori_compat_cpu.py`` checks it).
"""
