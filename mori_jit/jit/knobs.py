"""Settings read from the environment: each variable declared once, with its type, default and doc.

Settings live in groups (:class:`Group` subclasses, one instance each); a group's settings are
class attributes, read through the instance at access time, never at import time, so a test or a
launcher can set them late::

    from mori_jit.jit import knobs
    knobs.compiler.arch        # MORI_JIT_ARCH, or None
    knobs.cache.dir            # MORI_JIT_CACHE_DIR, or ~/.mori/jit

The kinds of setting (how a variable is parsed and described) are :mod:`mori_jit.jit.settings`.
This module declares the framework's groups; an op declares its own in a ``knobs.py`` of its
package (the EP op: :mod:`mori_jit.ops.ep.knobs`). :func:`all_groups` finds every one of them, and
``mori-jit info`` lists each setting from its declaration. Nothing in the compile step reads the
environment except through the toolchain, whose resolved values all enter the cache key (arch,
compiler signature, flags, NIC).
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any, Callable

from mori_jit.jit.settings import (BoolSetting, FlagsSetting, IntListSetting, LevelSetting, NameSetting, PathSetting,
                                   PositiveFloatSetting, PrefixSetting, Setting, StrSetting)

__all__ = ["Setting", "StrSetting", "BoolSetting", "LevelSetting", "PositiveFloatSetting", "IntListSetting",
           "PathSetting", "FlagsSetting", "NameSetting", "PrefixSetting", "Group", "all_groups", "all_settings",
           "CompilerKnobs", "SourceKnobs", "CacheKnobs", "LogKnobs", "EngineKnobs", "compiler", "source", "cache",
           "log", "engine"]

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
