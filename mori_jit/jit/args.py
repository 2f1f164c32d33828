"""Kernel argument structs: declared once, emitted as C++ and as a ctypes struct.

An :class:`ArgsSchema` is the single declaration of a kernel's by-value argument struct. From it:

* :meth:`ArgsSchema.cpp_struct` — the C++ struct plus ``static_assert(offsetof(S, f) == N)`` for
  every field in order and ``static_assert(sizeof(S) == N)``: swapping two same-typed pointer
  fields in either place fails the device build instead of reading the wrong buffer;
* :attr:`ArgsSchema.ctype` — the ``ctypes.Structure`` the launch path packs;
* :attr:`ArgsSchema.layout` — the full ``(name, offset, size)`` sequence, which is what
  :class:`~mori_jit.jit.launch_group.LaunchGroup` compares.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Sequence

__all__ = ["ArgField", "ArgsSchema", "ptr", "i32", "u32", "i64", "u64", "f32"]

# kind -> (C++ type, ctypes type)
_KINDS = {
    "i32": ("int32_t", ctypes.c_int32),
    "u32": ("uint32_t", ctypes.c_uint32),
    "i64": ("int64_t", ctypes.c_int64),
    "u64": ("uint64_t", ctypes.c_uint64),
    "f32": ("float", ctypes.c_float),
}


@dataclasses.dataclass(frozen=True)
class ArgField:
    """One field: ``name``, a C++ type, its ctypes twin, an array length (0 = scalar) and a doc."""

    name: str
    cpp_type: str
    ctype: type
    count: int = 0
    doc: str = ""


def ptr(name: str, pointee: str = "void", doc: str = "") -> ArgField:
    """A device pointer (``pointee*`` in C++, ``c_void_p`` in ctypes)."""
    return ArgField(name, f"{pointee}*", ctypes.c_void_p, 0, doc)


def _scalar(kind: str):
    def make(name: str, count: int = 0, doc: str = "") -> ArgField:
        cpp, ct = _KINDS[kind]
        return ArgField(name, cpp, ct, count, doc)
    make.__doc__ = f"A {_KINDS[kind][0]} field (``count`` > 0 makes a fixed array)."
    return make


i32, u32, i64, u64, f32 = (_scalar(k) for k in ("i32", "u32", "i64", "u64", "f32"))


class ArgsSchema:
    """The declaration of one args struct (C++ name ``name``, fields in order)."""

    def __init__(self, name: str, fields: Sequence[ArgField]):
        names = [f.name for f in fields]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"{name}: duplicate arg fields {sorted(dup)}")
        self.name = name
        self.fields = tuple(fields)
        self.ctype = type(name, (ctypes.Structure,), {
            "_fields_": [(f.name, f.ctype * f.count if f.count else f.ctype) for f in self.fields]})
        self.size = ctypes.sizeof(self.ctype)
        self.layout = tuple((f.name, getattr(self.ctype, f.name).offset, getattr(self.ctype, f.name).size)
                            for f in self.fields)

    def names(self) -> tuple[str, ...]:
        """The field names, in declaration order."""
        return tuple(f.name for f in self.fields)

    def cpp_struct(self) -> str:
        """The C++ struct, with static_asserts that pin every offset and the size to the ctypes
        layout (a drift between the two fails the compile, not the launch)."""
        lines = [f"struct {self.name} {{"]
        for f in self.fields:
            arr = f"[{f.count}]" if f.count else ""
            doc = f"  // {f.doc}" if f.doc else ""
            lines.append(f"  {f.cpp_type} {f.name}{arr};{doc}")
        lines.append("};")
        for name, off, _ in self.layout:
            lines.append(f"static_assert(offsetof({self.name}, {name}) == {off}, \"{self.name}.{name} moved\");")
        lines.append(f"static_assert(sizeof({self.name}) == {self.size}, \"{self.name} size changed\");")
        return "\n".join(lines)
