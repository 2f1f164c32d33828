"""NVIDIA runtime over ``cuda.bindings.driver`` (cuda-python's driver bindings).

Modules are loaded into the device's *primary* context — the one torch's runtime API uses — so
raw streams and device pointers from torch are valid for our kernels. torch creates that context
(``torch.cuda.init()``); if a thread has no current context we retain the primary one and make it
current, and a module for another device is loaded with that device's primary context pushed.

The launch path is one dict lookup (raw stream → cached ``CUstream``), one ``cuLaunchKernel`` and
one identity check of the result. Anything unusual (no current context in this thread, the
context of another device current) is handled on the error path only, then retried once.

Exception contract: every failing driver call raises :class:`~.base.DriverError` naming the call
and the CUresult name; ``ValueError`` for a geometry the kernel cannot run with.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

from cuda.bindings import driver as _drv

from .base import DriverError, Runtime, as_dim3, error_name, require_torch_gpu, unpack_result

__all__ = ["CudaRuntime"]

_SUCCESS = _drv.CUresult.CUDA_SUCCESS
_STREAM_CACHE_MAX = 1024


def _err_name(err: Any) -> str:
    return error_name(err, _drv.cuGetErrorName, "CUresult")


def _check(result: Any, call: str, detail: str = "") -> Any:
    """Unpack a cuda-bindings result tuple; raise :class:`DriverError` unless it succeeded."""
    return unpack_result(result, _SUCCESS, _err_name, call, detail)


class CudaRuntime(Runtime):
    """The NVIDIA driver runtime (a process-wide singleton; see :func:`~mori_jit.jit.runtime.get_runtime`)."""

    vendor = "nvidia"

    def __init__(self) -> None:
        require_torch_gpu("the CUDA runtime")
        _check(_drv.cuInit(0), "cuInit")
        self._lock = threading.Lock()
        self._primary: dict[int, Any] = {}
        self._streams: dict[int, Any] = {}

    # ---- contexts -------------------------------------------------------------------------------
    def _primary_ctx(self, device: int) -> Any:
        ctx = self._primary.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._primary.get(device)
                if ctx is None:
                    dev = _check(_drv.cuDeviceGet(int(device)), "cuDeviceGet", f"device {device}")
                    ctx = _check(_drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain", f"device {device}")
                    self._primary[device] = ctx  # retained for the life of the process
        return ctx

    @contextlib.contextmanager
    def _in_context(self, device: int) -> Iterator[None]:
        """Run the block with ``device``'s primary context current (set if none, else push/pop)."""
        target = self._primary_ctx(device)
        cur = _check(_drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if cur is None or int(cur) == 0:
            _check(_drv.cuCtxSetCurrent(target), "cuCtxSetCurrent")  # what torch itself would do
            yield
            return
        if int(cur) == int(target):
            yield
            return
        _check(_drv.cuCtxPushCurrent(target), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _check(_drv.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def _current_is(self, device: int) -> bool:
        r = _drv.cuCtxGetCurrent()
        return r[0] == _SUCCESS and r[1] is not None and int(r[1]) == int(self._primary_ctx(device))

    # ---- modules --------------------------------------------------------------------------------
    def load_module(self, image: bytes, device: int | None = None) -> Any:
        dev = self.current_device() if device is None else int(device)
        with self._in_context(dev):
            r = _drv.cuModuleLoadData(image)
        if r[0] != _SUCCESS:
            hint = ""
            if r[0] in (_drv.CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU, _drv.CUresult.CUDA_ERROR_INVALID_IMAGE,
                        _drv.CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION):
                hint = f"the binary was not built for device {dev}'s arch (check MORI_JIT_ARCH)"
            raise DriverError("cuModuleLoadData", int(r[0]), _err_name(r[0]), hint)
        return r[1]

    def init_module(self, module: Any, device: int, hooks: Sequence[Callable[[int], None]]) -> None:
        with self._in_context(int(device)):  # (nvshmemx_cumodule_init works on the current context)
            super().init_module(module, device, hooks)

    def get_function(self, module: Any, name: str) -> Any:
        r = _drv.cuModuleGetFunction(module, name.encode())
        if r[0] != _SUCCESS:
            raise DriverError("cuModuleGetFunction", int(r[0]), _err_name(r[0]), f"kernel symbol {name!r}")
        return r[1]

    def configure(self, fn: Any, block: Sequence[int], shared_bytes: int, device: int) -> None:
        b = as_dim3(block)
        threads = b[0] * b[1] * b[2]
        with self._in_context(device):
            max_threads = _check(_drv.cuFuncGetAttribute(
                _drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn), "cuFuncGetAttribute")
            if threads > max_threads:
                raise ValueError(f"block of {threads} threads exceeds this kernel's limit of {max_threads} "
                                 f"(registers / __launch_bounds__)")
            if shared_bytes > 48 * 1024:
                _check(_drv.cuFuncSetAttribute(
                    fn, _drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    int(shared_bytes)), "cuFuncSetAttribute", f"{shared_bytes} bytes of dynamic shared memory")

    # ---- launch ---------------------------------------------------------------------------------
    def _stream(self, raw: int) -> Any:
        s = self._streams.get(raw)
        if s is None:
            if len(self._streams) >= _STREAM_CACHE_MAX:
                self._streams.clear()
            s = self._streams[raw] = _drv.CUstream(raw)
        return s

    def _retry(self, err: Any, fn: Any, g: tuple, b: tuple, shm: int, stream: int, params_ptr: int,
               device: int | None) -> None:
        """Error path of a launch: fix a missing/foreign current context and retry once, else raise."""
        if err == _SUCCESS:  # an enum that is equal but not identical: not an error
            return
        if device is not None and not self._current_is(device):
            with self._in_context(device):
                r = _drv.cuLaunchKernel(fn, *g, *b, shm, self._stream(stream), params_ptr, 0)
            if r[0] == _SUCCESS:
                return
            err = r[0]
        raise DriverError("cuLaunchKernel", int(err), _err_name(err),
                          f"grid={g} block={b} shared={shm} stream={stream:#x}")

    def launch(self, fn: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int, stream: int,
               params_ptr: int) -> None:
        g, b = as_dim3(grid), as_dim3(block)
        r = _drv.cuLaunchKernel(fn, *g, *b, int(shared_bytes), self._stream(stream), params_ptr, 0)
        if r[0] != _SUCCESS:
            self._retry(r[0], fn, g, b, int(shared_bytes), stream, params_ptr, self.current_device())

    def launcher(self, fn: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
                 device: int) -> Callable[[int, int], None]:
        gx, gy, gz = as_dim3(grid)
        bx, by, bz = as_dim3(block)
        shm = int(shared_bytes)
        cu_launch = _drv.cuLaunchKernel
        streams = self._streams
        make_stream = self._stream
        retry = self._retry
        ok = _SUCCESS

        def launch(stream: int, params_ptr: int) -> None:
            s = streams.get(stream)
            if s is None:
                s = make_stream(stream)
            err = cu_launch(fn, gx, gy, gz, bx, by, bz, shm, s, params_ptr, 0)[0]
            if err is not ok:
                retry(err, fn, (gx, gy, gz), (bx, by, bz), shm, stream, params_ptr, device)
        return launch
