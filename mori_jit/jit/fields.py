"""Config dataclasses: the one list of fields, and everything derived from it.

A kernel config ("Cfg") is a frozen dataclass whose field names are the C++ member names and whose
class name is the C++ struct name. Every consumer below iterates ``dataclasses.fields`` of the
class, so no other list of fields exists anywhere:

* :func:`cpp_struct` — the C++ struct (with the same defaults) for the generated header,
* :func:`render_cfg` — the designated initializer of the *non-default* fields (goes into the TU,
  hence into the cache key),
* :func:`describe` / :func:`request_schema` — JSON-able views for the CLI and users,
* :func:`apply_request` — name → value overrides, with errors naming the valid fields.

Field kinds are ``int``, ``bool`` and :class:`CEnum` subclasses. An ``int`` field is a C++ ``int``:
a value outside :data:`CPP_INT_RANGE` is refused (by :func:`coerce_field` and :func:`render_cfg`),
never rendered into a translation unit that would wrap it.
"""
from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Mapping

__all__ = [
    "CEnum", "CConst", "FieldInfo", "ConfigError", "cfg_fields", "render_cfg", "describe", "request_schema",
    "apply_request", "cpp_struct", "cpp_enum", "cpp_consts", "coerce_field", "CPP_INT_RANGE", "check_ranges",
]

#: The values a C++ ``int`` holds (the type an ``int`` field is declared with in C++).
CPP_INT_RANGE = (-(1 << 31), (1 << 31) - 1)


class ConfigError(ValueError):
    """A config value or request is invalid; the message names the field, value and what is allowed."""


class CEnum(enum.IntEnum):
    """An int enum mirrored into C++ as ``enum class <ClassName> : int``.

    Subclasses may override :meth:`_coerce_other` to accept extra spellings (e.g. torch dtypes).
    """

    @classmethod
    def _coerce_other(cls, value: Any) -> "CEnum | None":
        return None

    @classmethod
    def coerce(cls, value: Any) -> "CEnum":
        """Return the member for ``value``: a member, its name (any case), its int, or an alias."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for m in cls:
                if m.name.lower() == value.lower():
                    return m
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        other = cls._coerce_other(value)
        if other is not None:
            return other
        article = "an" if cls.__name__[:1] in "AEIO" else "a"
        raise ConfigError(f"{value!r} is not {article} {cls.__name__}; allowed: {', '.join(m.name for m in cls)} "
                          f"(a name in any case, or its number: {', '.join(str(int(m)) for m in cls)})")

    def cpp(self) -> str:
        """This member as C++ text (``Enum::Member``)."""
        return f"{type(self).__name__}::{self.name}"


class CConst(enum.IntEnum):
    """Named integer codes that kernels write and the host reads (wait ids, error codes, stamp
    slots), mirrored into C++ as an unscoped ``enum <ClassName> : <ctype()> { ... }`` so kernel code
    uses the bare names. Members are spelled as in C++ (``kWaitDispatchDone``)."""

    @classmethod
    def ctype(cls) -> str:
        """The enum's C++ underlying type."""
        return "int"


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One Cfg field as the consumers see it."""

    name: str
    kind: type  # int, bool or a CEnum subclass
    default: Any


def cfg_fields(cls_or_cfg: Any) -> list[FieldInfo]:
    """The fields of a Cfg dataclass (class or instance), in declaration order."""
    cls = cls_or_cfg if isinstance(cls_or_cfg, type) else type(cls_or_cfg)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if not (kind in (int, bool) or (isinstance(kind, type) and issubclass(kind, CEnum))):
            raise TypeError(f"{cls.__name__}.{f.name}: field kind {kind!r} is not int, bool or CEnum")
        out.append(FieldInfo(f.name, kind, f.default))
    return out


def _cpp_value(value: Any) -> str:
    if isinstance(value, CEnum):
        return value.cpp()
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(int(value))


def _short_int(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...{text[-6:]} ({len(text)} digits)"


def _check_int(value: int) -> int:
    lo, hi = CPP_INT_RANGE
    if not lo <= value <= hi:
        raise ConfigError(f"{_short_int(value)} is outside the C++ int range [{lo}, {hi}]")
    return value


def coerce_field(info: FieldInfo, value: Any, owner: str = "") -> Any:
    """Convert ``value`` to the field's kind or raise :class:`ConfigError` naming the field."""
    where = f"{owner}.{info.name}" if owner else info.name
    try:
        if issubclass(info.kind, CEnum):
            return info.kind.coerce(value)
        if info.kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ConfigError(f"{value!r} is not a bool")
        if isinstance(value, bool):
            raise ConfigError(f"{value!r} is a bool, expected an int")
        if isinstance(value, str):
            return _check_int(int(value, 0))
        if isinstance(value, int):
            return _check_int(value)
        raise ConfigError(f"{value!r} is not an int")
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def check_ranges(cfg: Any) -> None:
    """Raise :class:`ConfigError` naming the first ``int`` field of ``cfg`` outside :data:`CPP_INT_RANGE`."""
    for fi in cfg_fields(cfg):
        value = getattr(cfg, fi.name)
        if fi.kind is int and not isinstance(value, bool) and isinstance(value, int):
            try:
                _check_int(value)
            except ConfigError as e:
                raise ConfigError(f"{type(cfg).__name__}.{fi.name}: {e}") from None


def render_cfg(cfg: Any) -> str:
    """``EpCfg{.hiddenDim=2048, .dtype=EpDType::Fp8}``: only non-default fields, declaration order.
    A value a C++ ``int`` cannot hold is a :class:`ConfigError` (:func:`check_ranges`)."""
    check_ranges(cfg)
    parts = [f".{fi.name}={_cpp_value(getattr(cfg, fi.name))}" for fi in cfg_fields(cfg)
             if getattr(cfg, fi.name) != fi.default]
    return f"{type(cfg).__name__}{{{', '.join(parts)}}}"


def _json_value(value: Any) -> Any:
    return value.name if isinstance(value, CEnum) else value


def describe(cfg: Any) -> dict[str, Any]:
    """Every field's value (enum members by name), in declaration order."""
    return {fi.name: _json_value(getattr(cfg, fi.name)) for fi in cfg_fields(cfg)}


def request_schema(cls: type) -> list[dict[str, Any]]:
    """What a request may set: name, kind, default and (for enums) the allowed names."""
    out = []
    for fi in cfg_fields(cls):
        entry: dict[str, Any] = {"name": fi.name, "kind": fi.kind.__name__, "default": _json_value(fi.default)}
        if issubclass(fi.kind, CEnum):
            entry["choices"] = [m.name for m in fi.kind]
        out.append(entry)
    return out


def apply_request(base: Any, request: Mapping[str, Any]) -> Any:
    """A copy of Cfg ``base`` with ``request`` (field name → value) applied.

    Unknown names are an error listing the valid ones; values are coerced (enum names, torch
    dtypes where the enum accepts them, numeric strings). The dataclass's own validation runs.
    """
    infos = {fi.name: fi for fi in cfg_fields(base)}
    owner = type(base).__name__
    changes = {}
    for name, value in request.items():
        if name not in infos:
            raise ConfigError(f"{owner} has no field {name!r}; valid fields: {', '.join(infos)}")
        changes[name] = coerce_field(infos[name], value, owner)
    return dataclasses.replace(base, **changes)


def cpp_enum(enum_cls: type[CEnum]) -> str:
    """The C++ ``enum class`` for ``enum_cls``, with the same values."""
    members = ", ".join(f"{m.name} = {int(m)}" for m in enum_cls)
    return f"enum class {enum_cls.__name__} : int {{ {members} }};"


def cpp_consts(cls: type[CConst]) -> str:
    """The C++ unscoped enum for ``cls``, its docstring's first line as a comment."""
    doc = (cls.__doc__ or "").strip().splitlines()
    members = ", ".join(f"{m.name} = {int(m):#x}" if int(m) > 0xFFFF else f"{m.name} = {int(m)}" for m in cls)
    comment = f"// {doc[0]}\n" if doc else ""
    return f"{comment}enum {cls.__name__} : {cls.ctype()} {{ {members} }};"


def cpp_struct(cls: type) -> str:
    """The C++ aggregate for Cfg ``cls``, usable as a C++20 structural NTTP."""
    lines = [f"struct {cls.__name__} {{"]
    for fi in cfg_fields(cls):
        ctype = fi.kind.__name__ if issubclass(fi.kind, CEnum) else fi.kind.__name__
        lines.append(f"  {ctype} {fi.name} = {_cpp_value(fi.default)};")
    lines.append("};")
    return "\n".join(lines)
