"""NVSHMEM as a device library: where it is installed, its version, and its module hook.

NVSHMEM's device functions live in ``lib/libnvshmem_device.a``, so a kernel calling them is
compiled as relocatable device code and device-linked against that archive (see
:mod:`mori_jit.jit.devlib`). An install is found through ``MORI_JIT_NVSHMEM_HOME``, else
``NVSHMEM_HOME``, else the ``nvidia-nvshmem-cu13`` wheel (``pip install nvidia-nvshmem-cu13``, or
the ``nvshmem`` extra of mori-jit). Each module loaded from such a binary joins the process's
NVSHMEM instance through ``nvshmemx_cumodule_init``, reached through torch's binding
``torch._C._distributed_c10d._nvshmemx_cumodule_init`` (present in torch builds with NVSHMEM).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

from . import knobs
from .devlib import DeviceLibrary

__all__ = ["Nvshmem", "NVSHMEM", "VERSION_HEADER", "torch_cumodule_init"]

#: The header, under ``include/``, that carries NVSHMEM's version macros.
VERSION_HEADER = "non_abi/nvshmem_version.h"
_VERSION_RE = re.compile(r'#define\s+NVSHMEM_VENDOR_BASE_VERSION_STRING\s+"([^"]+)"')
_PART_RE = re.compile(r"#define\s+NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")


def torch_cumodule_init() -> Optional[Callable[[int], None]]:
    """torch's ``_nvshmemx_cumodule_init`` binding, or None when this torch is built without NVSHMEM."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    c10d = getattr(torch._C, "_distributed_c10d", None)
    return getattr(c10d, "_nvshmemx_cumodule_init", None)


class Nvshmem(DeviceLibrary):
    """NVIDIA's NVSHMEM (the ``nvidia-nvshmem-cu13`` wheel, or an install named by a setting)."""

    name = "nvshmem"
    archives = ("lib/libnvshmem_device.a",)
    include = "include"
    marker_header = "nvshmem.h"
    home_settings = (knobs.EngineKnobs.nvshmem_home, knobs.EngineKnobs.nvshmem_home_fallback)
    package = "nvidia.nvshmem"
    distribution = "nvidia-nvshmem-cu13"

    def version(self, home: Path) -> str:
        """The version macros of ``include/non_abi/nvshmem_version.h`` (``unknown`` without that header)."""
        try:
            text = (home / self.include / VERSION_HEADER).read_text(errors="replace")
        except OSError:
            return "unknown"
        m = _VERSION_RE.search(text)
        if m:
            return m.group(1)
        parts = dict(_PART_RE.findall(text))
        return ".".join(parts[k] for k in ("MAJOR", "MINOR", "PATCH")) if len(parts) == 3 else "unknown"

    def init_module(self, handle: int) -> None:
        """``nvshmemx_cumodule_init(handle)`` through torch; a torch without NVSHMEM is an error
        (the module's NVSHMEM calls would read an uninitialised device state)."""
        init = torch_cumodule_init()
        if init is None:
            raise RuntimeError("a kernel linked against NVSHMEM needs nvshmemx_cumodule_init, which this torch "
                               "lacks (torch._C._distributed_c10d._nvshmemx_cumodule_init); use a CUDA build "
                               "of torch with NVSHMEM")
        init(int(handle))


NVSHMEM = Nvshmem()
