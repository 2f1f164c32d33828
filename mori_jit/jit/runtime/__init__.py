"""Vendor runtimes behind one small interface (:class:`~.base.Runtime`).

:func:`get_runtime` imports only the vendor's module: ``cuda.bindings`` for ``nvidia``, hip-python
for ``amd``; a machine without the other vendor's package never imports it.
"""
from __future__ import annotations

import threading

from .base import DriverError, Runtime, as_dim3
from .support import BINDINGS, NoDeviceError, no_device_error, require_gpu

__all__ = ["Runtime", "DriverError", "NoDeviceError", "no_device_error", "get_runtime", "as_dim3"]

_RUNTIMES: dict[str, Runtime] = {}
_lock = threading.Lock()


def get_runtime(vendor: str) -> Runtime:
    """The process-wide runtime of ``vendor`` (``"nvidia"`` or ``"amd"``), created on first use.

    Raises ``ValueError`` for another vendor, :class:`~.support.NoDeviceError` (a ``RuntimeError``
    naming what is missing and what to install) when torch sees no GPU, ``ImportError`` (naming the
    extra to install) when the vendor's bindings are missing.
    """
    rt = _RUNTIMES.get(vendor)
    if rt is not None:
        return rt
    with _lock:
        rt = _RUNTIMES.get(vendor)
        if rt is None:
            if vendor not in BINDINGS:
                raise ValueError(f"unknown vendor {vendor!r}; expected 'nvidia' or 'amd'")
            require_gpu(f"the {vendor} runtime", vendor)
            b = BINDINGS[vendor]
            try:
                if vendor == "nvidia":
                    from .cuda import CudaRuntime as cls
                else:
                    from .hip import HipRuntime as cls  # type: ignore[assignment]
            except ImportError as e:
                matching = " (the hip-python matching your ROCm)" if vendor == "amd" else ""
                raise ImportError(f"the {vendor} runtime needs its launch bindings, {b.distribution}{matching}: "
                                  f"{b.install()}; {e}") from e
            rt = _RUNTIMES[vendor] = cls()
        return rt
