"""Plans: a compiled, loaded kernel with its geometry and args packer, ready to launch.

Two separate steps (docs/design.md §5):

* :func:`prepare` (``Plan.prepare``) — compile through the cache (:func:`mori_jit.jit.compile.build`),
  load the module (an in-process cache keyed by ``(device, entry directory)``), run the spec's
  module hooks on it once (:meth:`~mori_jit.jit.spec.Spec.module_init_hooks`) and look the kernel
  up by the same ``spec.entry_name(cfg)`` string that was rendered into the source. A repeat
  ``prepare`` with the same ``(spec.name, cfg, toolchain, device)`` is one dict lookup.
* :meth:`Plan.launch` — pack the args struct and enqueue the kernel on torch's current stream.
  Never compiles, never loads, never synchronizes: safe inside CUDA/HIP graph capture.

A :class:`~mori_jit.jit.launch_group.LaunchGroup` launches several plans that share one args layout
with a single packing.

The args struct is packed by :mod:`mori_jit.jit.packing` (one ``struct.pack_into`` per launch).

Exception contract
------------------
``prepare``: :class:`~mori_jit.jit.runtime.NoDeviceError` on a machine where torch sees no GPU,
naming what is missing and what to install, and ``ImportError`` without the launch bindings (both
before anything compiles); :class:`CaptureError` if called for a plan that is not yet prepared
while the current stream is capturing a graph (nothing is compiled or loaded then);
:class:`~mori_jit.jit.compile.CompileError` / :class:`~mori_jit.jit.toolchain.ToolchainError`
from the build; :class:`~mori_jit.jit.runtime.DriverError` from loading or symbol lookup;
``ValueError`` for a geometry the kernel cannot run with; ``RuntimeError`` if the cached entry
names a different kernel than ``spec.entry_name(cfg)``; whatever a module hook raises.

``launch``: ``TypeError`` for unknown or missing field names (the message lists the valid ones),
for a value of the wrong type, or for a struct of another layout; ``ValueError`` for an
out-of-range scalar or a host tensor in a pointer field;
:class:`~mori_jit.jit.runtime.DriverError` if the driver rejects the launch. Errors are raised
before anything is enqueued (except a driver rejection, which enqueues nothing either).

Thread safety: ``prepare`` is thread-safe. ``launch(**fields)`` reuses one struct per plan (per
group), so one plan must not be launched from two threads at once; give each thread its own
``plan.args()`` and use :meth:`Plan.launch_struct` (or :meth:`Plan.bind_struct`) instead.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

from .args import ArgsSchema
from .compile import build
from .packing import ArgsPacker, check_struct_type
from .runtime import Runtime, get_runtime, no_device_error
from .runtime.base import as_dim3, torch_current_device
from .spec import Geometry, Spec
from .toolchain import Toolchain, get_toolchain

__all__ = ["Plan", "CaptureError", "prepare", "forget_plans", "bind_launch_buffers"]


class CaptureError(RuntimeError):
    """``prepare`` was asked to compile/load while the current stream is capturing a graph."""


# --------------------------------------------------------------------------------------------------
# plans
# --------------------------------------------------------------------------------------------------

def bind_launch_buffers(obj: Any) -> None:
    """Give ``obj`` (a Plan or LaunchGroup with ``_ctype``) its reusable args struct and the
    ``void*[1]`` kernel-params arrays: one pointing at that struct, one filled per call with a
    caller's struct (``launch_struct``)."""
    obj._buf = obj._ctype()
    obj._kp = (ctypes.c_void_p * 1)(ctypes.addressof(obj._buf))
    obj._kp_addr = ctypes.addressof(obj._kp)
    obj._kp_user = (ctypes.c_void_p * 1)()
    obj._kp_user_addr = ctypes.addressof(obj._kp_user)


class Plan:
    """One kernel specialization, loaded on one device, with a bound launch path.

    Attributes: ``spec``, ``cfg``, ``name`` (the kernel symbol), ``geometry``, ``device``,
    ``toolchain``, ``entry`` (the cache entry, if prepared from the cache), ``runtime``,
    ``function`` (the driver handle), ``schema`` and ``layout`` (the args struct declaration and
    its ``(name, offset, size)`` sequence).

    Normally obtained from :func:`prepare`. The constructor only binds an already loaded
    ``function`` (any :class:`~mori_jit.jit.runtime.Runtime` works): it compiles and loads nothing.
    """

    def __init__(self, spec: Spec, cfg: Any, *, runtime: Runtime, function: Any, device: int,
                 toolchain: Toolchain | None = None, entry: Any = None):
        self.spec = spec
        self.cfg = cfg
        self.name: str = spec.entry_name(cfg)
        self.geometry: Geometry = spec.geometry(cfg)
        self.device = int(device)
        self.toolchain = toolchain
        self.entry = entry
        self.runtime = runtime
        self.function = function
        self.schema: ArgsSchema = spec.args
        self.layout: tuple = spec.args.layout
        self._ctype = spec.args.ctype
        self._packer = ArgsPacker.for_schema(spec.args)
        self._pack = self._packer.pack
        bind_launch_buffers(self)
        g = self.geometry
        self.grid, self.block, self.shared_bytes = as_dim3(g.grid), as_dim3(g.block), int(g.shared_bytes)
        self._launch = runtime.launcher(function, self.grid, self.block, self.shared_bytes, self.device)
        self._stream = runtime.stream_getter(self.device)

    def __repr__(self) -> str:
        return f"<Plan {self.name} device={self.device} grid={self.grid} block={self.block}>"

    def args(self, **fields: Any) -> Any:
        """A new, reusable args struct (``schema.ctype``); packed from ``fields`` if any are given.

        Set fields as attributes (``s.n = 10``; pointers as int addresses) and launch it with
        :meth:`launch_struct`, or re-pack it with :meth:`pack`.
        """
        return self._packer.struct(fields if fields else None)

    def pack(self, struct: Any, **fields: Any) -> Any:
        """Pack all ``fields`` into ``struct`` (same rules as :meth:`launch`); returns ``struct``."""
        self._pack(struct, fields)
        return struct

    def launch(self, *struct: Any, **fields: Any) -> None:
        """``launch(**fields)``: pack every field and launch; ``launch(s)``: launch a packed struct.

        Enqueues on torch's current stream of :attr:`device`; never compiles, loads or syncs.
        """
        if struct:
            if len(struct) != 1 or fields:
                raise TypeError(f"{self.name}: launch() takes one args struct or keyword fields, not both")
            return self.launch_struct(struct[0])
        self._pack(self._buf, fields)
        self._launch(self._stream(), self._kp_addr)

    def launch_struct(self, struct: Any) -> None:
        """Launch with an already packed struct (from :meth:`args`)."""
        if type(struct) is not self._ctype:
            check_struct_type(struct, self.layout, self.schema.size, self.name)
        self._kp_user[0] = ctypes.addressof(struct)
        self._launch(self._stream(), self._kp_user_addr)

    def bind_struct(self, struct: Any) -> Callable[[], None]:
        """A zero-argument launch of this kernel with ``struct``, the fastest path: the struct is
        checked and its address captured once, so each call is the stream lookup and the driver
        call. Rewrite the struct's fields between calls (the driver copies them at each launch).
        The callable keeps ``struct`` alive; for diagnostics it carries ``.plan`` (this plan),
        ``.struct`` and ``.params`` (the one-pointer array whose address the driver is given)."""
        if type(struct) is not self._ctype:
            check_struct_type(struct, self.layout, self.schema.size, self.name)
        kp = (ctypes.c_void_p * 1)(ctypes.addressof(struct))
        kp_addr, launch, stream = ctypes.addressof(kp), self._launch, self._stream

        def launch_bound() -> None:
            launch(stream(), kp_addr)
        launch_bound.plan, launch_bound.struct, launch_bound.params = self, struct, kp  # type: ignore[attr-defined]
        return launch_bound


_PLANS: dict[tuple, Plan] = {}
_MODULES: dict[tuple[int, str], Any] = {}
_prepare_lock = threading.RLock()


def _device_index(device: Any) -> int:
    if device is None:
        return torch_current_device()
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device
    if index is not None:
        return int(index)
    if getattr(device, "type", None) in ("cuda", "hip"):
        return torch_current_device()
    raise TypeError(f"device must be an int index or a torch.device, got {device!r}")


def _capturing() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def prepare(spec: Spec, cfg: Any, toolchain: Toolchain | None = None, device: Any = None) -> Plan:
    """The :class:`Plan` of ``cfg`` on ``device`` (default: current), compiling/loading on first use.

    ``toolchain`` defaults to the process-wide :func:`~mori_jit.jit.toolchain.get_toolchain`. A
    repeat call is a dict hit on ``(spec.name, cfg, toolchain, device)`` and is allowed during graph
    capture; a miss during capture raises :class:`CaptureError` (never compile inside a graph).
    """
    try:
        tc = toolchain if toolchain is not None else get_toolchain()
        dev = _device_index(device)
    except Exception:
        no_gpu = no_device_error("prepare()")  # (then that is what to say, not what failed for want of it)
        if no_gpu is not None:
            raise no_gpu from None
        raise
    key = (spec.name, cfg, tc, dev)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    return _prepare_miss(spec, cfg, tc, dev, key)


def _prepare_miss(spec: Spec, cfg: Any, tc: Toolchain, dev: int, key: tuple) -> Plan:
    with _prepare_lock:
        plan = _PLANS.get(key)
        if plan is not None:
            return plan
        name = spec.entry_name(cfg)
        if _capturing():
            raise CaptureError(f"prepare({spec.name}: {name}) was called while the current stream is capturing "
                               f"a graph; prepare every plan before capture (compiling or loading a module "
                               f"inside a graph is not allowed)")
        rt = get_runtime(tc.vendor)  # (before compiling: a machine that cannot launch says so at once)
        entry = build(spec, cfg, tc)
        built_name = entry.meta.get("entry")
        if built_name is not None and built_name != name:
            raise RuntimeError(f"cache entry {entry.path} holds kernel {built_name!r} but {spec.name} names it {name!r}")
        mkey = (dev, str(entry.path))
        module = _MODULES.get(mkey)
        if module is None:
            module = rt.load_module(entry.read_binary(), dev)
            hooks = spec.module_init_hooks()
            if hooks:  # once per loaded module; a failed hook leaves it unused, the next prepare reloads
                rt.init_module(module, dev, hooks)
            _MODULES[mkey] = module
        fn = rt.get_function(module, name)
        geom = spec.geometry(cfg)
        rt.configure(fn, as_dim3(geom.block), int(geom.shared_bytes), dev)
        plan = Plan(spec, cfg, runtime=rt, function=fn, device=dev, toolchain=tc, entry=entry)
        _PLANS[key] = plan
        return plan


Plan.prepare = staticmethod(prepare)  # type: ignore[attr-defined]


def forget_plans() -> None:
    """Drop the in-process plan memo (loaded modules stay loaded). For tests and benchmarks."""
    with _prepare_lock:
        _PLANS.clear()
