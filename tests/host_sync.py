"""``forbid_host_sync()``: a context in which a torch op that makes the host wait for a device's
values raises AssertionError naming it, on any device (so a CPU test can prove a GPU step sync-free).

Caught: a scalar read (``.item()``, ``int()``/``float()``/``bool()`` of a tensor), ``.tolist()`` and
``.numpy()``, and the ops whose output size depends on values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` with tensor repeats).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "bincount", "repeat_interleave"}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class _Forbid(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS or (name in ("index", "index_put", "index_put_") and _bool_index(args)):
            raise AssertionError(f"host sync: aten.{name} waits for the device's values")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def forbid_host_sync():
    """Raise AssertionError at the first op inside the block that syncs the host."""
    saved = torch.Tensor.tolist, torch.Tensor.numpy

    def refuse(name):
        def method(*_a, **_k):
            raise AssertionError(f"host sync: Tensor.{name}() reads the device's values")
        return method

    torch.Tensor.tolist, torch.Tensor.numpy = refuse("tolist"), refuse("numpy")
    try:
        with _Forbid():
            yield
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = saved
