"""AMD runtime over hip-python (``from hip import hip``), imported only when the vendor is ``amd``.

hip-python's calls return tuples ``(hipError_t, *results)`` and accept plain ``int`` addresses
wherever the C API takes a pointer or handle (stream, ``void** kernelParams``); the module image is
passed as ``bytes`` (buffer protocol). The HIP runtime keeps one primary context per device, the
same one torch (ROCm build) uses; a module for another device is loaded with that device set
current and the previous device restored.

Launch uses ``kernelParams`` (a ``void*[1]`` pointing to the packed struct), which HIP expands
using the kernel's argument metadata — the same contract as ``cuLaunchKernel``. ``extra`` is not
used.

Exception contract: every failing call raises :class:`~.base.DriverError` naming the call and the
hipError_t name; ``ValueError`` for a block size the kernel cannot run with.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from hip import hip as _hip  # hip-python; present only on ROCm installs

from .base import DriverError, Runtime, as_dim3, error_name, require_torch_gpu, unpack_result

__all__ = ["HipRuntime"]

_SUCCESS = _hip.hipError_t.hipSuccess


def _err_name(err: Any) -> str:
    return error_name(err, _hip.hipGetErrorName, "hipError_t")


def _check(result: Any, call: str, detail: str = "") -> Any:
    """Unpack a hip-python result tuple; raise :class:`DriverError` unless it succeeded."""
    return unpack_result(result, _SUCCESS, _err_name, call, detail)


class HipRuntime(Runtime):
    """The HIP runtime (a process-wide singleton; see :func:`~mori_jit.jit.runtime.get_runtime`)."""

    vendor = "amd"

    def __init__(self) -> None:
        require_torch_gpu("the HIP runtime")

    @contextlib.contextmanager
    def _on_device(self, device: int) -> Iterator[None]:
        cur = _check(_hip.hipGetDevice(), "hipGetDevice")
        if int(cur) == int(device):
            yield
            return
        _check(_hip.hipSetDevice(int(device)), "hipSetDevice", f"device {device}")
        try:
            yield
        finally:
            _check(_hip.hipSetDevice(int(cur)), "hipSetDevice", f"restoring device {cur}")

    def load_module(self, image: bytes, device: int | None = None) -> Any:
        dev = self.current_device() if device is None else int(device)
        with self._on_device(dev):
            r = _hip.hipModuleLoadData(image)
        if r[0] != _SUCCESS:
            hint = ""
            if r[0] in (getattr(_hip.hipError_t, "hipErrorNoBinaryForGpu", None),
                        getattr(_hip.hipError_t, "hipErrorInvalidImage", None)):
                hint = f"the code object was not built for device {dev}'s gfx arch (check MORI_JIT_ARCH)"
            raise DriverError("hipModuleLoadData", int(r[0]), _err_name(r[0]), hint)
        return r[1]

    def get_function(self, module: Any, name: str) -> Any:
        r = _hip.hipModuleGetFunction(module, name.encode())
        if r[0] != _SUCCESS:
            raise DriverError("hipModuleGetFunction", int(r[0]), _err_name(r[0]), f"kernel symbol {name!r}")
        return r[1]

    def configure(self, fn: Any, block: Sequence[int], shared_bytes: int, device: int) -> None:
        b = as_dim3(block)
        threads = b[0] * b[1] * b[2]
        attr = getattr(getattr(_hip, "hipFunction_attribute", None), "HIP_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK", None)
        if attr is None:
            return
        with self._on_device(device):
            r = _hip.hipFuncGetAttribute(attr, fn)
        if r[0] == _SUCCESS and threads > int(r[1]):
            raise ValueError(f"block of {threads} threads exceeds this kernel's limit of {int(r[1])}")

    def launch(self, fn: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int, stream: int,
               params_ptr: int) -> None:
        g, b = as_dim3(grid), as_dim3(block)
        r = _hip.hipModuleLaunchKernel(fn, *g, *b, int(shared_bytes), stream, params_ptr, None)
        if r[0] != _SUCCESS:
            raise DriverError("hipModuleLaunchKernel", int(r[0]), _err_name(r[0]),
                              f"grid={g} block={b} shared={shared_bytes} stream={stream:#x}")

    def launcher(self, fn: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
                 device: int) -> Callable[[int, int], None]:
        gx, gy, gz = as_dim3(grid)
        bx, by, bz = as_dim3(block)
        shm = int(shared_bytes)
        hip_launch = _hip.hipModuleLaunchKernel
        ok = _SUCCESS

        def launch(stream: int, params_ptr: int) -> None:
            err = hip_launch(fn, gx, gy, gz, bx, by, bz, shm, stream, params_ptr, None)[0]
            if err != ok:
                raise DriverError("hipModuleLaunchKernel", int(err), _err_name(err),
                                  f"grid={(gx, gy, gz)} block={(bx, by, bz)} shared={shm} stream={stream:#x}")
        return launch
