"""Plans: a compiled, loaded kernel with its geometry and args packer, ready to launch.

Two separate steps (DESIGN §5):

* :func:`prepare` (``Plan.prepare``) — compile through the cache (:func:`mori_jit.jit.compile.build`),
  load the module (an in-process cache keyed by ``(device, entry directory)``) and look the kernel
  up by the same ``spec.entry_name(cfg)`` string that was rendered into the source. A repeat
  ``prepare`` with the same ``(spec.name, cfg, toolchain, device)`` is one dict lookup.
* :meth:`Plan.launch` — pack the args struct and enqueue the kernel on torch's current stream.
  Never compiles, never loads, never synchronizes: safe inside CUDA/HIP graph capture.

A :class:`LaunchGroup` launches several plans that share one args layout with a single packing.

Packing: the args struct is written with ONE :meth:`struct.Struct.pack_into` whose format is
derived from :attr:`ArgsSchema.layout` (offsets and padding checked against ctypes' layout at
construction). Pointer fields take an ``int`` address, ``None`` (null) or a device tensor (its
``data_ptr()``); scalar fields take Python numbers, range-checked by ``struct``.

Exception contract
------------------
``prepare``: :class:`CaptureError` if called for a plan that is not yet prepared while the current
stream is capturing a graph (nothing is compiled or loaded then);
:class:`~mori_jit.jit.compile.CompileError` / :class:`~mori_jit.jit.toolchain.ToolchainError`
from the build; :class:`~mori_jit.jit.runtime.DriverError` from loading or symbol lookup;
``ValueError`` for a geometry the kernel cannot run with; ``RuntimeError`` if the cached entry
names a different kernel than ``spec.entry_name(cfg)``.

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
import operator
import struct as _struct
import sys
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

from .args import ArgsSchema
from .compile import build
from .runtime import Runtime, get_runtime
from .runtime.base import as_dim3, torch_current_device
from .spec import Geometry, Spec
from .toolchain import Toolchain, get_toolchain

__all__ = ["Plan", "LaunchGroup", "ArgsPacker", "CaptureError", "prepare", "forget_plans", "layout_difference"]


class CaptureError(RuntimeError):
    """``prepare`` was asked to compile/load while the current stream is capturing a graph."""


# --------------------------------------------------------------------------------------------------
# packing
# --------------------------------------------------------------------------------------------------

_INT_CODES = {False: {1: "b", 2: "h", 4: "i", 8: "q"}, True: {1: "B", 2: "H", 4: "I", 8: "Q"}}
_UNSIGNED_CTYPE_CODES = set("BHILQ")
_SIGNED_CTYPE_CODES = set("bhilq")


def _fmt_char(ct: type, where: str) -> tuple[str, bool]:
    """The ``struct`` format character of ctypes simple type ``ct`` and whether it is a pointer."""
    code = getattr(ct, "_type_", None)
    size = ctypes.sizeof(ct)
    if code == "P":
        if size != 8:
            raise TypeError(f"{where}: only 64-bit pointers are supported")
        return "Q", True
    if code in _SIGNED_CTYPE_CODES or code in _UNSIGNED_CTYPE_CODES:
        return _INT_CODES[code in _UNSIGNED_CTYPE_CODES][size], False
    if code in ("f", "d", "?"):
        return code, False
    raise TypeError(f"{where}: ctypes type {ct.__name__} is not supported by the args packer")


def _tensor_type() -> type:
    try:
        import torch
        return torch.Tensor
    except ImportError:  # pragma: no cover - torch is a dependency
        return type("_NoTensor", (), {})


_Tensor: type | None = None


def _as_ptr(value: Any, name: str) -> int:
    """An address for a pointer field: int, None, ctypes.c_void_p or a device tensor."""
    global _Tensor
    if _Tensor is None:
        _Tensor = _tensor_type()
    if isinstance(value, _Tensor):  # the common non-int case first
        if not value.is_cuda:
            raise ValueError(f"field {name!r} is a device pointer; got a tensor on {value.device}")
        return value.data_ptr()
    if value is None:
        return 0
    if isinstance(value, bool):
        raise TypeError(f"field {name!r} is a pointer; got a bool")
    data_ptr = getattr(value, "data_ptr", None)  # other tensor-likes
    if data_ptr is not None and callable(data_ptr):
        if getattr(value, "is_cuda", True) is False:
            raise ValueError(f"field {name!r} is a device pointer; got a tensor on {getattr(value, 'device', 'the host')}")
        return int(data_ptr())
    if isinstance(value, ctypes.c_void_p):
        return value.value or 0
    if isinstance(value, int) or hasattr(value, "__index__"):  # int subclasses, numpy integers
        return operator.index(value)
    raise TypeError(f"field {name!r} is a pointer: pass an int address, a device tensor or None, "
                    f"not {type(value).__name__}")


class ArgsPacker:
    """Packs keyword field values into the bytes of one :class:`~mori_jit.jit.args.ArgsSchema` struct.

    Built once per schema (:meth:`for_schema`). ``pack(buf, fields)`` writes the whole struct with a
    single ``struct.pack_into``; ``buf`` is any writable buffer of ``schema.size`` bytes (normally an
    instance of ``schema.ctype``). Every field must be given: a struct reused across launches must
    never keep a stale pointer from an earlier call.
    """

    _cache: dict[int, "ArgsPacker"] = {}
    _cache_lock = threading.Lock()

    def __init__(self, schema: ArgsSchema):
        if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
            raise RuntimeError("the args packer assumes a little-endian host")
        self.schema = schema
        self.names: tuple[str, ...] = schema.names()
        self.n = len(self.names)
        self._valid = ", ".join(self.names)
        fmt, pos = ["<"], 0
        ptr_slots, arrays, chars = [], [], []
        for i, (f, (name, off, size)) in enumerate(zip(schema.fields, schema.layout)):
            where = f"{schema.name}.{name}"
            elem = f.ctype
            ch, is_ptr = _fmt_char(elem, where)
            if off < pos:
                raise TypeError(f"{where}: offset {off} overlaps the previous field")
            if off > pos:
                fmt.append(f"{off - pos}x")
            count = f.count
            fmt.append(f"{count}{ch}" if count else ch)
            if _struct.calcsize("<" + (f"{count}{ch}" if count else ch)) != size:
                raise TypeError(f"{where}: packer size {_struct.calcsize('<' + ch)}×{count or 1} != ctypes size {size}")
            pos = off + size
            chars.append(ch)
            if count:
                arrays.append((i, count, is_ptr))
            elif is_ptr:
                ptr_slots.append(i)
        if schema.size > pos:
            fmt.append(f"{schema.size - pos}x")
        self.format = "".join(fmt)
        self._st = _struct.Struct(self.format)
        if self._st.size != schema.size:
            raise TypeError(f"{schema.name}: packer size {self._st.size} != ctypes size {schema.size}")
        self._chars = tuple(chars)
        self.ptr_slots = tuple(ptr_slots)
        self._arrays = tuple(arrays)
        self._pack_into = self._st.pack_into
        if self.n == 0:
            self._get = lambda fields: ()
        elif self.n == 1:
            only = self.names[0]
            self._get = lambda fields: (fields[only],)
        else:
            self._get = operator.itemgetter(*self.names)

    @classmethod
    def for_schema(cls, schema: ArgsSchema) -> "ArgsPacker":
        """The (cached) packer of ``schema``."""
        p = cls._cache.get(id(schema))
        if p is None or p.schema is not schema:
            with cls._cache_lock:
                p = cls._cache.get(id(schema))
                if p is None or p.schema is not schema:
                    p = cls._cache[id(schema)] = cls(schema)
        return p

    # -- errors (slow path only) ------------------------------------------------------------------
    def _bad_names(self, fields: Mapping[str, Any]) -> None:
        unknown = [k for k in fields if k not in self.names]
        missing = [k for k in self.names if k not in fields]
        parts = []
        if unknown:
            parts.append(f"unknown field(s) {unknown}")
        if missing:
            parts.append(f"missing field(s) {missing}")
        raise TypeError(f"{self.schema.name}: {' and '.join(parts) or 'bad fields'}; valid fields: {self._valid}")

    def _explain(self, values: list, err: Exception) -> None:
        """Find the field that ``struct`` rejected and raise a ``TypeError``/``ValueError`` naming it."""
        for i, name in enumerate(self.names):
            f = self.schema.fields[i]
            ch = self._chars[i]
            items = list(values[i]) if f.count else [values[i]]
            if f.ctype is ctypes.c_void_p:
                items = [_as_ptr(x, name) for x in items]
            for v in items:
                try:
                    _struct.pack("<" + ch, v)
                except (_struct.error, TypeError) as e:
                    numeric = isinstance(v, int) if ch not in ("f", "d", "?") else isinstance(v, (int, float))
                    kind = ValueError if numeric and not isinstance(v, bool) else TypeError
                    raise kind(f"field {name!r} ({f.cpp_type}): cannot pack {v!r}: {e}") from None
        raise TypeError(f"{self.schema.name}: cannot pack {values!r}: {err}")

    def _flatten(self, values: list) -> list:
        out: list = []
        start = 0
        for i, count, is_ptr in self._arrays:
            out.extend(values[start:i])
            v = values[i]
            try:
                seq = list(v)
            except TypeError:
                raise TypeError(f"field {self.names[i]!r} is an array of {count}; got {type(v).__name__}") from None
            if len(seq) != count:
                raise ValueError(f"field {self.names[i]!r} is an array of {count}; got {len(seq)} values")
            if is_ptr:
                seq = [_as_ptr(x, self.names[i]) for x in seq]
            out.extend(seq)
            start = i + 1
        out.extend(values[start:])
        return out

    # -- the hot path -----------------------------------------------------------------------------
    def _convert(self, vals: Sequence[Any]) -> list:
        out = list(vals)
        for i in self.ptr_slots:
            v = out[i]
            if type(v) is not int:
                out[i] = _as_ptr(v, self.names[i])
        return out

    def _in_order(self, fields: Mapping[str, Any]) -> Sequence[Any]:
        """Raw field values in schema order; unknown or missing names raise (naming the valid ones)."""
        if len(fields) != self.n:
            self._bad_names(fields)
        try:
            return self._get(fields)
        except KeyError:
            self._bad_names(fields)

    def values(self, fields: Mapping[str, Any]) -> tuple:
        """Field values in schema order (pointers converted to ints), validating the names."""
        return tuple(self._convert(self._in_order(fields)))

    def pack(self, buf: Any, fields: Mapping[str, Any]) -> None:
        """Write every field of ``fields`` into ``buf`` (see the class docstring for the rules)."""
        vals = self._in_order(fields)
        for i in self.ptr_slots:
            if type(vals[i]) is not int:
                vals = self._convert(vals)
                break
        if self._arrays:
            vals = self._flatten(list(vals))
        try:
            self._pack_into(buf, 0, *vals)
        except (_struct.error, TypeError) as e:
            self._explain(list(self._get(fields)) if self.n else [], e)

    def struct(self, fields: Mapping[str, Any] | None = None) -> Any:
        """A new ``schema.ctype`` instance, packed from ``fields`` if given."""
        s = self.schema.ctype()
        if fields is not None:
            self.pack(s, fields)
        return s


def layout_difference(a: Sequence[tuple], b: Sequence[tuple], size_a: int | None = None,
                      size_b: int | None = None) -> str | None:
    """A description of the first difference between two ``(name, offset, size)`` layouts, or None."""
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            return f"field #{i}: {x if x is not None else '(none)'} vs {y if y is not None else '(none)'}"
    if size_a is not None and size_b is not None and size_a != size_b:
        return f"struct size {size_a} vs {size_b}"
    return None


def _check_struct_type(obj: Any, layout: tuple, size: int, who: str) -> None:
    t = type(obj)
    if not (isinstance(obj, ctypes.Structure) and hasattr(t, "_fields_")):
        raise TypeError(f"{who}: expected an args struct (from .args()) or keyword fields, got {t.__name__}")
    other = tuple((n, getattr(t, n).offset, getattr(t, n).size) for n, *_ in t._fields_)
    diff = layout_difference(layout, other, size, ctypes.sizeof(t))
    if diff:
        raise TypeError(f"{who}: struct {t.__name__} has a different layout ({diff})")


# --------------------------------------------------------------------------------------------------
# plans
# --------------------------------------------------------------------------------------------------

def _bind_launch_buffers(obj: Any) -> None:
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
        _bind_launch_buffers(self)
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
            _check_struct_type(struct, self.layout, self.schema.size, self.name)
        self._kp_user[0] = ctypes.addressof(struct)
        self._launch(self._stream(), self._kp_user_addr)

    def bind_struct(self, struct: Any) -> Callable[[], None]:
        """A zero-argument launch of this kernel with ``struct``, the fastest path: the struct is
        checked and its address captured once, so each call is the stream lookup and the driver
        call. Rewrite the struct's fields between calls (the driver copies them at each launch).
        The callable keeps ``struct`` alive; for diagnostics it carries ``.plan`` (this plan),
        ``.struct`` and ``.params`` (the one-pointer array whose address the driver is given)."""
        if type(struct) is not self._ctype:
            _check_struct_type(struct, self.layout, self.schema.size, self.name)
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
    tc = toolchain if toolchain is not None else get_toolchain()
    dev = _device_index(device)
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
        entry = build(spec, cfg, tc)
        built_name = entry.meta.get("entry")
        if built_name is not None and built_name != name:
            raise RuntimeError(f"cache entry {entry.path} holds kernel {built_name!r} but {spec.name} names it {name!r}")
        rt = get_runtime(tc.vendor)
        mkey = (dev, str(entry.path))
        module = _MODULES.get(mkey)
        if module is None:
            module = _MODULES[mkey] = rt.load_module(entry.binary.read_bytes(), dev)
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


# --------------------------------------------------------------------------------------------------
# groups
# --------------------------------------------------------------------------------------------------

class LaunchGroup:
    """Several plans sharing one args layout, launched in order with a single packing.

    Construction raises ``ValueError`` if the plans' ``layout`` (the full ``(name, offset, size)``
    sequence) differ — naming the first difference — or if they live on different devices or
    runtimes, or if there are none. Geometry and function handles are bound up front.
    """

    def __init__(self, plans: Iterable[Plan]):
        self.plans: tuple[Plan, ...] = tuple(plans)
        if not self.plans:
            raise ValueError("LaunchGroup needs at least one plan")
        first = self.plans[0]
        for i, p in enumerate(self.plans[1:], 1):
            diff = layout_difference(first.layout, p.layout, first.schema.size, p.schema.size)
            if diff:
                raise ValueError(f"LaunchGroup: plan {i} ({p.name}, {p.schema.name}) has a different args layout "
                                 f"than plan 0 ({first.name}, {first.schema.name}): {diff}")
            if p.device != first.device:
                raise ValueError(f"LaunchGroup: plan {i} ({p.name}) is on device {p.device}, plan 0 on {first.device}")
            if p.runtime is not first.runtime:
                raise ValueError(f"LaunchGroup: plan {i} ({p.name}) uses another runtime than plan 0")
        self.layout = first.layout
        self.schema = first.schema
        self.device = first.device
        self._ctype = first._ctype
        self._packer = first._packer
        self._pack = self._packer.pack
        _bind_launch_buffers(self)
        self._launchers = tuple(p._launch for p in self.plans)
        self._stream = first._stream

    def __len__(self) -> int:
        return len(self.plans)

    def __repr__(self) -> str:
        return f"<LaunchGroup {[p.name for p in self.plans]} device={self.device}>"

    def args(self, **fields: Any) -> Any:
        """A new reusable args struct of the shared layout (see :meth:`Plan.args`)."""
        return self._packer.struct(fields if fields else None)

    def launch(self, *struct: Any, **fields: Any) -> None:
        """Pack once, then launch every plan in order on the current stream (or launch a struct)."""
        if struct:
            if len(struct) != 1 or fields:
                raise TypeError("LaunchGroup.launch() takes one args struct or keyword fields, not both")
            return self.launch_struct(struct[0])
        self._pack(self._buf, fields)
        stream = self._stream()
        kp = self._kp_addr
        for launch in self._launchers:
            launch(stream, kp)

    def launch_struct(self, struct: Any) -> None:
        """Launch every plan with one already packed struct."""
        if type(struct) is not self._ctype:
            _check_struct_type(struct, self.layout, self.schema.size, "LaunchGroup")
        self._kp_user[0] = ctypes.addressof(struct)
        stream = self._stream()
        kp = self._kp_user_addr
        for launch in self._launchers:
            launch(stream, kp)
