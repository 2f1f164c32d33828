"""Args packing: a kernel's args struct, written in one call from keyword fields.

The struct is written with ONE :meth:`struct.Struct.pack_into` whose format is derived from
:attr:`~mori_jit.jit.args.ArgsSchema.layout` (offsets and padding checked against ctypes' layout
at construction). Pointer fields take an ``int`` address, ``None`` (null) or a device tensor (its
``data_ptr()``); scalar fields take Python numbers, range-checked by ``struct``.

Exception contract: ``TypeError`` for unknown or missing field names (the message lists the valid
ones), for a value of the wrong type, or for a struct of another layout; ``ValueError`` for an
out-of-range scalar or a host tensor in a pointer field. Nothing is written on error.
"""
from __future__ import annotations

import ctypes
import operator
import struct as _struct
import sys
import threading
from typing import Any, Mapping, Sequence

from .args import ArgsSchema

__all__ = ["ArgsPacker", "layout_difference", "check_struct_type"]



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


def check_struct_type(obj: Any, layout: tuple, size: int, who: str) -> None:
    """Raise ``TypeError`` (naming ``who``) unless ``obj`` is a ctypes struct with ``layout`` and ``size``."""
    t = type(obj)
    if not (isinstance(obj, ctypes.Structure) and hasattr(t, "_fields_")):
        raise TypeError(f"{who}: expected an args struct (from .args()) or keyword fields, got {t.__name__}")
    other = tuple((n, getattr(t, n).offset, getattr(t, n).size) for n, *_ in t._fields_)
    diff = layout_difference(layout, other, size, ctypes.sizeof(t))
    if diff:
        raise TypeError(f"{who}: struct {t.__name__} has a different layout ({diff})")
