"""Every environment variable mori-jit reads, each read in exactly one function here.

Values are read at call time (not import time) so a test or a launcher can set them late. Nothing
in the compile step reads the environment except through the toolchain, whose resolved values all
enter the cache key (arch, compiler signature, flags, NIC).
"""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

__all__ = [
    "jit_arch", "hipcc_path", "nvcc_path", "rocm_path", "cuda_home", "source_root", "cache_dir",
    "shared_cache", "extra_flags", "device_nic", "verbose", "keep_failed", "lock_timeout_s", "kernel_backend",
    "ep_timeout_s", "ep_geometry_overrides",
]


def _get(name: str) -> str | None:
    v = os.environ.get(name)
    return v if v not in (None, "") else None


def _bool(name: str) -> bool:
    v = _get(name)
    return v is not None and v.lower() not in ("0", "false", "no", "off")


def _float(name: str, default: float) -> float:
    v = _get(name)
    if v is None:
        return default
    try:
        out = float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a number") from None
    if out <= 0:
        raise ValueError(f"{name}={v!r} must be > 0")
    return out


def jit_arch() -> str | None:
    """``MORI_JIT_ARCH``: target arch (``gfx90a``, ``sm_90a``, ...); else the current device's."""
    return _get("MORI_JIT_ARCH")


def hipcc_path() -> str | None:
    """``MORI_JIT_HIPCC``: the hipcc to use."""
    return _get("MORI_JIT_HIPCC")


def nvcc_path() -> str | None:
    """``MORI_JIT_NVCC``: the nvcc to use."""
    return _get("MORI_JIT_NVCC")


def rocm_path() -> str:
    """``ROCM_PATH`` (default ``/opt/rocm``)."""
    return _get("ROCM_PATH") or "/opt/rocm"


def cuda_home() -> str | None:
    """``CUDA_HOME`` or ``CUDA_PATH``."""
    return _get("CUDA_HOME") or _get("CUDA_PATH")


def source_root() -> Path | None:
    """``MORI_SOURCE_ROOT``: a directory holding ``kernels/`` and ``templates/``."""
    v = _get("MORI_SOURCE_ROOT")
    return Path(v) if v else None


def cache_dir() -> Path:
    """``MORI_JIT_CACHE_DIR`` (default ``~/.mori/jit``)."""
    v = _get("MORI_JIT_CACHE_DIR")
    return Path(v).expanduser() if v else Path.home() / ".mori" / "jit"


def shared_cache() -> bool:
    """``MORI_JIT_SHARED_CACHE`` (default off): use a cache directory that other users own or may
    write (a team's cache). Without it such a directory is refused: a file planted there would be
    loaded as a kernel. With it the cache is read as data only (names, sizes and sha256 are still
    checked; nothing in it is executed or unpickled on the host), and it may be read-only."""
    return _bool("MORI_JIT_SHARED_CACHE")


def extra_flags() -> tuple[str, ...]:
    """``MORI_JIT_EXTRA_FLAGS``: extra compiler flags (shell-split); they enter the key."""
    v = _get("MORI_JIT_EXTRA_FLAGS")
    return tuple(shlex.split(v)) if v else ()


def device_nic() -> str:
    """``MORI_DEVICE_NIC`` (default ``none``); enters the key and the cache directory name."""
    v = _get("MORI_DEVICE_NIC") or "none"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", v):
        raise ValueError(f"MORI_DEVICE_NIC={v!r}: only letters, digits, '-', '_' and '.' are allowed")
    return v


def verbose() -> int:
    """``MORI_JIT_VERBOSE``: 0 silent, 1 compiles and hits, 2 also commands."""
    v = _get("MORI_JIT_VERBOSE")
    if v is None:
        return 0
    try:
        return int(v)
    except ValueError:
        return 1 if _bool("MORI_JIT_VERBOSE") else 0


def keep_failed() -> bool:
    """``MORI_JIT_KEEP_FAILED``: keep the source of a failed compile (its path is in the error)."""
    return _bool("MORI_JIT_KEEP_FAILED")


def lock_timeout_s() -> float:
    """``MORI_JIT_LOCK_TIMEOUT_S`` (default 600): how long to wait for another process's compile."""
    return _float("MORI_JIT_LOCK_TIMEOUT_S", 600.0)


def kernel_backend() -> str | None:
    """``MORI_V2_KERNEL_BACKEND``: the EP backend when the config names none."""
    return _get("MORI_V2_KERNEL_BACKEND")


def ep_timeout_s() -> float:
    """``MORI_EP_TIMEOUT_S`` (default 30): how long an EP kernel spin-waits before giving up."""
    return _float("MORI_EP_TIMEOUT_S", 30.0)


_EP_PREFIX = "MORI_V2_EP_"


def ep_geometry_overrides() -> dict[str, str]:
    """``MORI_V2_EP_<FIELD>`` variables, as ``{FIELD: value}`` (e.g. ``{"BLOCKNUM": "32"}``).

    Only :func:`mori_jit.ops.ep.cfg.make_ep_cfg` calls this; it maps names onto EpCfg fields.
    """
    return {k[len(_EP_PREFIX):]: v for k, v in os.environ.items() if k.startswith(_EP_PREFIX) and v != ""}
