"""What launching a kernel needs on this machine, and what to install when a part is missing.

Three parts: a torch built for GPUs (CUDA or ROCm), a GPU that torch sees, and the vendor's launch
bindings (NVIDIA: ``cuda-bindings``, AMD: ``hip-python``; the ``cuda`` and ``rocm`` extras of
mori-jit). Compiling needs none of them (``mori-jit compile`` / ``precompile --arch``).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
from typing import Optional

__all__ = ["Bindings", "BINDINGS", "NoDeviceError", "bindings_version", "gpu_problem", "launch_problems",
           "no_device_error", "require_gpu"]


@dataclasses.dataclass(frozen=True)
class Bindings:
    """One vendor's launch bindings: the distribution, the module it provides, the extra that installs it."""

    distribution: str
    module: str
    extra: str

    def install(self) -> str:
        return f"pip install 'mori-jit[{self.extra}]'"


#: The launch bindings of each vendor (pyproject.toml's ``cuda`` and ``rocm`` extras install them).
BINDINGS = {"nvidia": Bindings("cuda-bindings", "cuda.bindings", "cuda"),
            "amd": Bindings("hip-python", "hip", "rocm")}


_NAME = {"nvidia": "NVIDIA", "amd": "AMD"}


class NoDeviceError(RuntimeError):
    """This machine cannot launch kernels; the message names each missing part and what to install."""


def bindings_version(vendor: str) -> Optional[str]:
    """The installed version of ``vendor``'s launch bindings, or None when they cannot be imported."""
    b = BINDINGS[vendor]
    try:
        if importlib.util.find_spec(b.module) is None:
            return None
    except (ImportError, ValueError):  # (its parent package is missing)
        return None
    try:
        return importlib.metadata.version(b.distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _torch_vendor(torch) -> Optional[str]:
    if getattr(torch.version, "hip", None):
        return "amd"
    return "nvidia" if torch.version.cuda else None


def gpu_problem() -> Optional[str]:
    """Why torch sees no GPU (a CPU-only build, or none visible), with what to do; None when it sees one."""
    import torch
    if torch.cuda.is_available():
        return None
    if _torch_vendor(torch) is None:
        return (f"torch {torch.__version__} is a CPU-only build (torch.version.cuda and torch.version.hip are "
                f"None): install a CUDA or ROCm build of torch on a machine with a GPU")
    return (f"torch {torch.__version__} sees no GPU (torch.cuda.device_count() is 0): check the driver, and "
            f"CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES")


def launch_problems(vendor: Optional[str] = None) -> list[str]:
    """Each part missing for launching on ``vendor`` (default: the one torch is built for, else
    either), with what to install; empty when nothing is."""
    import torch
    problems = [p for p in (gpu_problem(),) if p]
    vendor = vendor or _torch_vendor(torch)
    vendors = [vendor] if vendor else list(BINDINGS)
    if all(bindings_version(v) is None for v in vendors):
        problems.append("the launch bindings are not installed: " + " or ".join(
            f"{BINDINGS[v].install()} ({_NAME[v]}: {BINDINGS[v].distribution})" for v in vendors))
    return problems


def no_device_error(what: str = "launching a kernel", vendor: Optional[str] = None) -> Optional[NoDeviceError]:
    """The :class:`NoDeviceError` naming every missing part when torch sees no GPU; None when it sees one."""
    if gpu_problem() is None:
        return None
    return NoDeviceError(f"{what} needs a GPU, and this machine has none usable: {'; '.join(launch_problems(vendor))}"
                         f". Compiling needs no GPU: mori-jit compile / precompile --arch <arch>")


def require_gpu(what: str = "launching a kernel", vendor: Optional[str] = None) -> None:
    """Raise :func:`no_device_error` when torch sees no GPU."""
    err = no_device_error(what, vendor)
    if err is not None:
        raise err
