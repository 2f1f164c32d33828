"""The kinds of setting (:class:`Setting` and its typed subclasses): how one environment variable is
read, parsed, named in errors and described in ``mori-jit info``. The settings themselves are
declared in groups (:mod:`mori_jit.jit.knobs`, and an op's own ``knobs.py``).
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

__all__ = ["Setting", "StrSetting", "BoolSetting", "LevelSetting", "PositiveFloatSetting", "IntListSetting",
           "PathSetting", "FlagsSetting", "NameSetting", "PrefixSetting"]

T = TypeVar("T")


class Setting(Generic[T]):
    """One environment variable: its name, type, default and doc. Read at each access through a group.

    An unset or empty variable gives the default (a callable default is called then); a value that
    does not parse is a ``ValueError`` naming the variable, the value and what is allowed.
    ``aliases``: other names of the same variable (e.g. mori's own), read when ``var`` is unset.

    ``default_doc`` says what the default is where the value alone does not (``~/.mori/jit``, or
    a default the reader finds elsewhere, as the current device's arch); ``default_value`` finds
    that value for ``mori-jit info`` (without reading this variable: it is the unset case).
    """

    #: the type's name in ``mori-jit info``
    type_name = "str"

    def __init__(self, var: str, default: Any, doc: str, *, default_doc: Optional[str] = None,
                 aliases: tuple[str, ...] = (), default_value: Optional[Callable[[], Any]] = None):
        self.var, self.default, self.doc, self.aliases = var, default, doc, tuple(aliases)
        self._default_doc, self._default_value = default_doc, default_value
        self.attr = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else self.read()

    def _found(self) -> Optional[tuple[str, str]]:
        """``(name, text)`` of the variable, else of its first alias that is set; None when all are unset or empty."""
        for name in (self.var, *self.aliases):
            v = os.environ.get(name)
            if v not in (None, ""):
                return name, v
        return None

    def raw(self) -> Optional[str]:
        """The variable's text (else its first alias that is set), or None when all are unset or empty."""
        found = self._found()
        return found[1] if found else None

    def read(self) -> T:
        """The current value: the parsed variable, or the default. A bad value's error names the
        variable that was set (an alias, when the value came from one)."""
        found = self._found()
        if found is None:
            return self.default() if callable(self.default) else self.default
        name, text = found
        try:
            return self.parse(text)
        except ValueError as e:
            if name == self.var:
                raise
            raise ValueError(f"{str(e).replace(self.var, name, 1)} ({name} is read as {self.var})") from None

    def parse(self, text: str) -> T:
        """The value of a set variable (subclasses convert and check)."""
        return text  # type: ignore[return-value]

    @property
    def label(self) -> str:
        """The variable as ``mori-jit info`` names it (with its aliases)."""
        return " | ".join((self.var, *self.aliases))

    def default_text(self) -> str:
        """The default as ``mori-jit info`` shows it: its value on this machine, then what it is where
        the value alone does not say (``/home/me/.mori/jit (~/.mori/jit)``)."""
        doc, find = self._default_doc, self._default_value or (self.default if callable(self.default) else None)
        if find is None:
            return doc or self._value_text(self.default)
        try:
            found = find()
        except Exception as e:  # noqa: BLE001 - shown, not raised: info reports what this machine lacks
            return f"{doc or '(none)'}: none here ({' '.join(str(e).split())})"
        if found is None:
            return f"{doc}: none here" if doc else "(none)"
        value = self._value_text(found)
        return f"{value} ({doc})" if doc and doc != value else value

    def _value_text(self, value: Any) -> str:
        return "(none)" if value is None else str(value)

    def matches(self, name: str) -> bool:
        """Whether the environment variable ``name`` is this setting's (or an alias)."""
        return name == self.var or name in self.aliases

    def is_set(self) -> bool:
        """Whether the environment sets this variable (non-empty)."""
        return self.raw() is not None


class StrSetting(Setting[Optional[str]]):
    """A string."""


class BoolSetting(Setting[bool]):
    """A flag: set and not ``0``/``false``/``no``/``off`` (any case) means on."""

    type_name = "bool"

    def parse(self, text: str) -> bool:
        return text.lower() not in ("0", "false", "no", "off")


class LevelSetting(Setting[int]):
    """A level: an integer, or a flag word (``yes`` is 1, ``off`` is 0)."""

    type_name = "int"

    def parse(self, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            return int(BoolSetting.parse(self, text))  # type: ignore[arg-type]


class PositiveFloatSetting(Setting[float]):
    """A number > 0."""

    type_name = "float"

    def parse(self, text: str) -> float:
        try:
            out = float(text)
        except ValueError:
            raise ValueError(f"{self.var}={text!r} is not a number") from None
        if out <= 0:
            raise ValueError(f"{self.var}={text!r} must be > 0")
        return out


class IntListSetting(Setting[tuple]):
    """Comma-separated integers >= 1 (``1,2,4,8``)."""

    type_name = "ints"

    def parse(self, text: str) -> tuple[int, ...]:
        try:
            out = tuple(int(w) for w in text.split(",") if w.strip())
        except ValueError:
            raise ValueError(f"{self.var}={text!r}: expected comma-separated integers (e.g. 1,2,4,8)") from None
        if not out or min(out) < 1:
            raise ValueError(f"{self.var}={text!r}: expected at least one integer, each >= 1")
        return out

    def _value_text(self, value: Any) -> str:
        return ",".join(map(str, value))


class PathSetting(Setting[Optional[Path]]):
    """A path (``~`` expanded)."""

    type_name = "path"

    def parse(self, text: str) -> Path:
        return Path(text).expanduser()


class FlagsSetting(Setting[tuple]):
    """Command-line flags, split as a shell would; at most ``max_bytes`` bytes of text."""

    type_name = "flags"

    def __init__(self, var: str, doc: str, *, max_bytes: int):
        super().__init__(var, (), doc, default_doc="(none)")
        self.max_bytes = max_bytes

    def parse(self, text: str) -> tuple[str, ...]:
        size = len(text.encode("utf-8", "surrogateescape"))
        if size > self.max_bytes:
            raise ValueError(f"{self.var} is {size} bytes long; at most {self.max_bytes} are allowed")
        return tuple(shlex.split(text))


class NameSetting(Setting[str]):
    """A name made of letters, digits, ``-``, ``_`` and ``.`` (it becomes part of a directory name)."""

    type_name = "name"

    def parse(self, text: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", text):
            raise ValueError(f"{self.var}={text!r}: only letters, digits, '-', '_' and '.' are allowed")
        return text


class PrefixSetting(Setting[dict]):
    """A family of variables ``<prefix><NAME>``, read as ``{NAME: text}`` (empty values skipped)."""

    type_name = "family"

    def __init__(self, prefix: str, doc: str, *, aliases: tuple[str, ...] = ()):
        super().__init__(prefix, {}, doc, default_doc="(none)", aliases=aliases)

    @property
    def label(self) -> str:
        return " | ".join(p + "*" for p in (self.var, *self.aliases))

    def read(self) -> dict[str, str]:
        """``{NAME: text}`` of every set variable of the family; a name under ``prefix`` wins over the
        same name under an alias prefix."""
        out: dict[str, str] = {}
        for prefix in reversed((self.var, *self.aliases)):
            out.update({k[len(prefix):]: v for k, v in os.environ.items()
                        if k.startswith(prefix) and len(k) > len(prefix) and v != ""})
        return out

    def matches(self, name: str) -> bool:
        return any(name.startswith(p) and len(name) > len(p) for p in (self.var, *self.aliases))

    def is_set(self) -> bool:
        return bool(self.read())
