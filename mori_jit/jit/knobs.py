"""Settings read from the environment: each variable declared once, with its type, default and doc.

Settings live in groups (:class:`Group` subclasses, one instance each); a group's settings are
class attributes, read through the instance at access time, never at import time, so a test or a
launcher can set them late::

    from mori_jit.jit import knobs
    knobs.compiler.arch        # MORI_JIT_ARCH, or None
    knobs.cache.dir            # MORI_JIT_CACHE_DIR, or ~/.mori/jit

This module declares the framework's groups; an op declares its own in a ``knobs.py`` of its
package (the EP op: :mod:`mori_jit.ops.ep.knobs`). :func:`all_groups` finds every one of them, and
``mori-jit info`` lists each setting from its declaration. Nothing in the compile step reads the
environment except through the toolchain, whose resolved values all enter the cache key (arch,
compiler signature, flags, NIC).
"""
from __future__ import annotations

import functools
import importlib
import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

__all__ = ["Setting", "StrSetting", "BoolSetting", "LevelSetting", "PositiveFloatSetting", "IntListSetting",
           "PathSetting", "FlagsSetting", "NameSetting", "PrefixSetting", "Group", "all_groups", "all_settings",
           "CompilerKnobs", "SourceKnobs", "CacheKnobs", "LogKnobs", "EngineKnobs", "compiler", "source", "cache",
           "log", "engine"]

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


class Group:
    """A named group of settings: subclass with :class:`Setting` class attributes, create one instance."""

    #: the group's name in ``mori-jit info``
    name = ""

    def settings(self) -> list[Setting]:
        """The group's settings, in declaration order."""
        return [v for k, v in vars(type(self)).items() if isinstance(v, Setting)]


def _later(module: str, name: str, *args: Any) -> Callable[[], Any]:
    """``module.name(*args)`` (``name`` may be dotted), called when needed: a default found outside its
    declaration, for ``mori-jit info`` (imported then, as those modules read their settings here)."""
    return lambda: functools.reduce(getattr, name.split("."), importlib.import_module(module, __package__))(*args)


class CompilerKnobs(Group):
    """Which compiler builds for which arch, and what enters its command line."""

    name = "compiler"
    arch = StrSetting("MORI_JIT_ARCH", None, "target arch (gfx90a, sm_90a, ...)", default_doc="the current device's",
                      default_value=_later(".toolchain", "detect_arch"))
    hipcc = StrSetting("MORI_JIT_HIPCC", None, "the hipcc to use (a path, or a name on PATH)",
                       default_doc="the first of $ROCM_PATH/bin, /opt/rocm/bin, PATH",
                       default_value=_later(".toolchain", "search_compiler", "amd"))
    nvcc = StrSetting("MORI_JIT_NVCC", None, "the nvcc to use (a path, or a name on PATH)",
                      default_doc="the first of $CUDA_HOME/bin (else $CUDA_PATH/bin), /usr/local/cuda/bin, PATH",
                      default_value=_later(".toolchain", "search_compiler", "nvidia"))
    rocm_path = StrSetting("ROCM_PATH", "/opt/rocm", "the ROCm install whose bin/hipcc is tried")
    cuda_home = StrSetting("CUDA_HOME", None, "the CUDA install whose bin/nvcc is tried")
    cuda_path = StrSetting("CUDA_PATH", None, "the CUDA install whose bin/nvcc is tried when CUDA_HOME is unset")
    # (bounded: each entry's meta.json records the compile command, and a reader accepts 64 KiB)
    extra_flags = FlagsSetting("MORI_JIT_EXTRA_FLAGS", "extra compiler flags (shell-split, at most 16384 bytes); they "
                               "enter the key. They can make the compiler write elsewhere ('-MD -MF <path>', nvcc "
                               "--keep-dir): no privilege boundary, as whoever sets them can set MORI_JIT_NVCC",
                               max_bytes=16384)
    device_nic = NameSetting("MORI_JIT_DEVICE_NIC", "none", "the NIC the kernels are built for; enters the key and "
                                                            "the cache directory name", aliases=("MORI_DEVICE_NIC",))


class SourceKnobs(Group):
    """Where the device sources come from."""

    name = "source"
    root = PathSetting("MORI_JIT_SOURCE_ROOT", None, "a directory holding kernels/ and templates/",
                       default_doc="the checkout, else the packaged copy", aliases=("MORI_SOURCE_ROOT",),
                       default_value=_later(".paths", "default_source_root"))


class CacheKnobs(Group):
    """The kernel cache and the compiles that fill it."""

    name = "cache"
    dir = PathSetting("MORI_JIT_CACHE_DIR", lambda: Path.home() / ".mori" / "jit", "the kernel cache",
                      default_doc="~/.mori/jit")
    lock_timeout_s = PositiveFloatSetting("MORI_JIT_LOCK_TIMEOUT_S", 600.0,
                                          "how long to wait for another process's compile of the same key")
    keep_failed = BoolSetting("MORI_JIT_KEEP_FAILED", False,
                              "keep the source of a failed compile (its path is in the error)")
    shared = BoolSetting("MORI_JIT_SHARED_CACHE", False,
                         "use a cache directory other users own or may write (a team's cache); without it such a "
                         "directory is refused, as a file planted there would be loaded as a kernel. Its files are "
                         "then only read as data (names, sizes and sha256 checked), and it may be read-only")


class LogKnobs(Group):
    """What mori-jit reports while it works."""

    name = "log"
    verbose = LevelSetting("MORI_JIT_VERBOSE", 0, "the mori_jit logger's level: 1 INFO (compiles), 2 DEBUG (also "
                                                  "compile commands, cache hits, and the CLI's tracebacks)")


_NVSHMEM_PACKAGE = _later(".nvshmem", "NVSHMEM.package_home")


class EngineKnobs(Group):
    """Where the device libraries (communication engines) that kernels are device-linked against live."""

    name = "engine"
    nvshmem_home = PathSetting("MORI_JIT_NVSHMEM_HOME", None,
                               "the NVSHMEM install (include/, lib/libnvshmem_device.a) that kernels calling "
                               "NVSHMEM are device-linked against; wins over NVSHMEM_HOME",
                               default_doc="NVSHMEM_HOME, else the installed nvidia-nvshmem-cu13 package",
                               default_value=lambda: engine.nvshmem_home_fallback or _NVSHMEM_PACKAGE())
    nvshmem_home_fallback = PathSetting("NVSHMEM_HOME", None,
                                        "NVSHMEM's own install variable, used when MORI_JIT_NVSHMEM_HOME is unset",
                                        default_doc="the installed nvidia-nvshmem-cu13 package",
                                        default_value=_NVSHMEM_PACKAGE)


compiler = CompilerKnobs()
source = SourceKnobs()
cache = CacheKnobs()
log = LogKnobs()
engine = EngineKnobs()


def all_groups() -> list[Group]:
    """Every settings group of the package: this module's first, then those of each other ``knobs``
    module in it (found by file name, like the spec registry finds spec modules)."""
    import mori_jit
    root = Path(mori_jit.__file__).resolve().parent
    mods = [__name__] + sorted(
        "mori_jit." + ".".join(p.relative_to(root).with_suffix("").parts)
        for p in root.rglob("knobs.py") if p.resolve() != Path(__file__).resolve())
    out: list[Group] = []
    for name in mods:
        mod = importlib.import_module(name)
        out += [v for v in vars(mod).values() if isinstance(v, Group) and v not in out]
    return out


def all_settings() -> list[Setting]:
    """Every setting of every group (:func:`all_groups`), in order."""
    return [s for g in all_groups() for s in g.settings()]
