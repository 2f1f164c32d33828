"""Vendor runtimes behind one small interface (:class:`~.base.Runtime`).

:func:`get_runtime` imports only the vendor's module: ``cuda.bindings`` for ``nvidia``, hip-python
for ``amd``; a machine without the other vendor's package never imports it.
"""
from __future__ import annotations

import threading

from .base import DriverError, Runtime, as_dim3

__all__ = ["Runtime", "DriverError", "get_runtime", "as_dim3"]

_RUNTIMES: dict[str, Runtime] = {}
_lock = threading.Lock()


def get_runtime(vendor: str) -> Runtime:
    """The process-wide runtime of ``vendor`` (``"nvidia"`` or ``"amd"``), created on first use.

    Raises ``ValueError`` for another vendor, ``ImportError`` (naming the package to install) when
    the vendor's bindings are missing, ``RuntimeError`` when no GPU is visible.
    """
    rt = _RUNTIMES.get(vendor)
    if rt is not None:
        return rt
    with _lock:
        rt = _RUNTIMES.get(vendor)
        if rt is None:
            if vendor == "nvidia":
                try:
                    from .cuda import CudaRuntime as cls
                except ImportError as e:
                    raise ImportError(f"the NVIDIA runtime needs cuda-python's driver bindings "
                                      f"(pip install cuda-bindings): {e}") from e
            elif vendor == "amd":
                try:
                    from .hip import HipRuntime as cls  # type: ignore[assignment]
                except ImportError as e:
                    raise ImportError(f"the AMD runtime needs hip-python (pip install hip-python "
                                      f"matching your ROCm): {e}") from e
            else:
                raise ValueError(f"unknown vendor {vendor!r}; expected 'nvidia' or 'amd'")
            rt = _RUNTIMES[vendor] = cls()
        return rt
