"""The runtime interface: load a binary, find a kernel, launch it on a raw stream.

A :class:`Runtime` is the only place that talks to the vendor driver. It is deliberately small:

* :meth:`Runtime.load_module` — a code object / cubin (``bytes``) → module handle, loaded into the
  primary context of ``device``;
* :meth:`Runtime.get_function` — module + kernel symbol → function handle;
* :meth:`Runtime.init_module` — run a spec's module hooks (a device library's init, such as
  ``nvshmemx_cumodule_init``) on a freshly loaded module, with its device current;
* :meth:`Runtime.launch` — function, grid, block, dynamic shared bytes, raw stream handle (``int``)
  and ``params_ptr``: the address of a ``void*[1]`` array whose only element points to the packed
  args struct (every mori-jit kernel takes ONE by-value struct argument);
* :meth:`Runtime.current_stream` / :meth:`Runtime.current_device` — torch's current stream as a
  raw handle and torch's current device index (cheap: straight to ``torch._C``).

:meth:`Runtime.launcher` returns a pre-bound ``(stream, params_ptr) -> None`` callable: that is
what :class:`~mori_jit.jit.plan.Plan` calls per launch, so vendors can pre-unpack everything that
does not change between launches.

Exception contract: every driver error raises :class:`DriverError` (a ``RuntimeError``) naming the
call and the driver's error name; nothing here exits the interpreter, synchronizes the device
or compiles.
"""
from __future__ import annotations

import abc
import functools
from typing import Any, Callable, Sequence

__all__ = ["Runtime", "DriverError", "Dim3", "as_dim3", "torch_stream_getter", "torch_current_device",
           "error_name", "require_torch_gpu"]

Dim3 = tuple[int, int, int]


class DriverError(RuntimeError):
    """A driver call failed. ``call`` is the API name, ``code`` the numeric result, ``name`` its name."""

    def __init__(self, call: str, code: int, name: str, detail: str = ""):
        self.call, self.code, self.name = call, int(code), name
        super().__init__(f"{call} failed: {name} ({int(code)})" + (f"; {detail}" if detail else ""))


def unpack_result(result: Any, success: Any, err_name: Callable[[Any], str], call: str, detail: str = "") -> Any:
    """Unpack a driver-binding result tuple ``(err, *values)``; raise :class:`DriverError` on failure.

    Shared by the CUDA (cuda-bindings) and HIP (hip-python) runtimes, whose calls return the same shape.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err = result[0]
    if err != success:
        raise DriverError(call, int(err), err_name(err), detail)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def error_name(err: Any, lookup: Callable[[Any], Any], enum_name: str) -> str:
    """The driver's name for ``err``: its enum ``.name``, else what the binding's ``GetErrorName``
    (``lookup``) returns (a result tuple's last item, bytes or str), else ``"<enum_name> <int>"``.
    Naming never raises: it must not mask the error being reported."""
    name = getattr(err, "name", None)
    if name:
        return name
    try:
        r = lookup(err)
        s = r[-1] if isinstance(r, tuple) else r
        if isinstance(s, bytes) and s:
            return s.decode()
        if isinstance(s, str) and s:
            return s
    except Exception:  # pragma: no cover - naming must never mask the real error
        pass
    return f"{enum_name} {int(err)}"


def require_torch_gpu(what: str) -> None:
    """Raise :class:`~.support.NoDeviceError` (naming what is missing) unless torch sees a GPU;
    then make sure torch's context on it exists."""
    import torch

    from .support import require_gpu
    require_gpu(what)
    torch.cuda.init()  # creates/uses the primary context of the current device


def as_dim3(v: int | Sequence[int]) -> Dim3:
    """``7`` → ``(7, 1, 1)``; a 1-3 element sequence is padded with 1s. Each entry must be ≥ 1."""
    t = (int(v),) if isinstance(v, int) else tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3 or any(x < 1 for x in t):
        raise ValueError(f"launch dimension {v!r} must be 1-3 positive ints")
    return (t + (1, 1))[:3]  # type: ignore[return-value]


def torch_current_device() -> int:
    """torch's current device index (CUDA or ROCm), without torch's Python-level wrappers."""
    import torch
    get = getattr(torch._C, "_cuda_getDevice", None)
    return int(get()) if get is not None else int(torch.cuda.current_device())


def torch_stream_getter(device: int) -> Callable[[], int]:
    """A zero-argument callable returning torch's current raw stream handle for ``device``.

    Uses ``torch._C._cuda_getCurrentRawStream(device)`` (one C call, ~0.1 µs) when this torch has
    it, else the public (slower) ``torch.cuda.current_stream(device).cuda_stream``. During graph
    capture this is the capturing stream, so launches land in the graph.
    """
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return functools.partial(raw, int(device))
    return lambda: int(torch.cuda.current_stream(device).cuda_stream)


class Runtime(abc.ABC):
    """One vendor's driver. Instances are process-wide singletons (see :func:`get_runtime`)."""

    #: ``"nvidia"`` or ``"amd"`` (matches :attr:`~mori_jit.jit.toolchain.Toolchain.vendor`)
    vendor: str = ""

    @abc.abstractmethod
    def load_module(self, image: bytes, device: int | None = None) -> Any:
        """Load a binary image into ``device``'s primary context (default: the current device)."""

    @abc.abstractmethod
    def get_function(self, module: Any, name: str) -> Any:
        """The kernel ``name`` (the exact ``extern "C"`` symbol) of ``module``; a missing one raises."""

    def module_handle(self, module: Any) -> int:
        """The driver's handle of ``module`` as an int (what a module hook is given)."""
        return int(module)

    def init_module(self, module: Any, device: int, hooks: Sequence[Callable[[int], None]]) -> None:
        """Run each of ``hooks`` on ``module``'s handle, in order (a vendor runtime makes ``device``
        current around them). Whatever a hook raises propagates."""
        handle = self.module_handle(module)
        for hook in hooks:
            hook(handle)

    @abc.abstractmethod
    def launch(self, fn: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int, stream: int,
               params_ptr: int) -> None:
        """Enqueue ``fn`` on raw ``stream``. ``params_ptr`` is the address of a ``void*[1]`` array.

        The driver copies the argument bytes during this call, so the struct may be reused (or
        rewritten) as soon as it returns. Never synchronizes.
        """

    def configure(self, fn: Any, block: Sequence[int], shared_bytes: int, device: int) -> None:
        """Check/prepare ``fn`` for this geometry once, at prepare time (default: nothing).

        Raises ``ValueError`` when the kernel cannot run with this block size / shared memory.
        """

    def launcher(self, fn: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
                 device: int) -> Callable[[int, int], None]:
        """A pre-bound ``(stream, params_ptr) -> None`` launch of ``fn`` with a fixed geometry."""
        g, b, s = as_dim3(grid), as_dim3(block), int(shared_bytes)

        def launch(stream: int, params_ptr: int) -> None:
            self.launch(fn, g, b, s, stream, params_ptr)
        return launch

    def current_device(self) -> int:
        """The current device index (torch's notion, shared with the vendor runtime)."""
        return torch_current_device()

    def stream_getter(self, device: int) -> Callable[[], int]:
        """A cheap callable returning the current raw stream of ``device``."""
        return torch_stream_getter(device)

    def current_stream(self, device: int | None = None) -> int:
        """torch's current stream on ``device`` (default: current device), as a raw handle."""
        return self.stream_getter(self.current_device() if device is None else device)()
