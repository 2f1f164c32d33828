"""Toolchains: which compiler builds for which arch, with which flags, and its exact signature.

``gfx*`` → ``hipcc --genco --offload-arch=<arch> -std=c++20`` with ``HIP_PLATFORM=amd`` (code
object); ``sm_*`` → ``nvcc --cubin -gencode=arch=compute_XX,code=sm_XX -std=c++20`` (cubin). The
compiler signature is the compiler's full ``--version`` output; it, the flags and the NIC enter the
cache key.

The process-wide toolchain (:func:`get_toolchain`) resolves the arch once: from
``MORI_JIT_ARCH``, else :func:`set_arch_override`, else the current device. An override that
conflicts with an already resolved arch is an error — never "render for A, compile for B".
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

from . import knobs

__all__ = ["Toolchain", "ToolchainError", "make_toolchain", "find_compiler", "get_toolchain", "set_arch_override",
           "detect_arch", "has_bulk_copy", "vendor_of", "wave_size_for_arch"]


class ToolchainError(RuntimeError):
    """No usable compiler or arch; the message says what was tried."""


_ARCH_RE = re.compile(r"^(gfx[0-9a-f]{3,5}|sm_[0-9]{2,3}a?)$")


def vendor_of(arch: str) -> str:
    """``amd`` for ``gfx*``, ``nvidia`` for ``sm_*``; anything else is an error naming the forms."""
    if not _ARCH_RE.match(arch or ""):
        raise ToolchainError(f"arch {arch!r} is not supported; expected gfx<id> (e.g. gfx90a, gfx942) "
                             f"or sm_<cc>[a] (e.g. sm_90a)")
    return "amd" if arch.startswith("gfx") else "nvidia"


def wave_size_for_arch(arch: str) -> int:
    """Threads per wavefront/warp: 32 on NVIDIA and RDNA (gfx10+/gfx12), 64 on CDNA (gfx9)."""
    if vendor_of(arch) == "nvidia":
        return 32
    return 64 if arch.startswith("gfx9") else 32


def has_bulk_copy(arch: str) -> bool:
    """Whether ``arch`` has a bulk-copy (TMA) unit that one thread drives: NVIDIA sm_90 and later."""
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    return vendor_of(arch) == "nvidia" and m is not None and int(m.group(1)) >= 90


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """A resolved compiler for one arch. Everything that changes the binary is in :meth:`key_parts`."""

    arch: str
    vendor: str
    compiler: str
    signature: str
    flags: tuple[str, ...]
    nic: str

    @property
    def binary_ext(self) -> str:
        """The code-object file extension: ``hsaco`` (AMD) or ``cubin`` (NVIDIA)."""
        return "hsaco" if self.vendor == "amd" else "cubin"

    @property
    def wave_size(self) -> int:
        """Threads per wave (warp) on this arch."""
        return wave_size_for_arch(self.arch)

    def key_parts(self) -> list[str]:
        """What of the toolchain enters the cache key: compiler signature, NIC, flags."""
        return [self.signature, self.nic, " ".join(self.flags)]

    def command(self, src: Path, out: Path, include_dirs: list[Path]) -> list[str]:
        """The full compile command for ``src`` → ``out``."""
        inc = [f"-I{d}" for d in include_dirs]
        if self.vendor == "amd":
            return [self.compiler, "--genco", f"--offload-arch={self.arch}", "-std=c++20", *self.flags,
                    *inc, "-o", str(out), str(src)]
        cc = self.arch[3:]
        return [self.compiler, "--cubin", "-x", "cu", f"-gencode=arch=compute_{cc},code={self.arch}",
                "-std=c++20", *self.flags, *inc, "-o", str(out), str(src)]

    def env(self) -> dict[str, str]:
        """Environment for the compiler subprocess (``HIP_PLATFORM=amd`` so hipcc never picks nvcc)."""
        env = dict(os.environ)
        if self.vendor == "amd":
            env["HIP_PLATFORM"] = "amd"
        return env


# nvcc: plain constexpr (no __host__ __device__) shared arithmetic needs --expt-relaxed-constexpr.
_DEFAULT_FLAGS = {"amd": ("-O3",), "nvidia": ("-O3", "-lineinfo", "--expt-relaxed-constexpr")}


def find_compiler(vendor: str) -> str:
    """The absolute path of the ``amd`` (hipcc) or ``nvidia`` (nvcc) compiler; ToolchainError names what was tried."""
    if vendor == "amd":
        tried = [knobs.compiler.hipcc, os.path.join(knobs.compiler.rocm_path, "bin", "hipcc"), "/opt/rocm/bin/hipcc",
                 shutil.which("hipcc")]
        var = "MORI_JIT_HIPCC"
    else:
        home = knobs.compiler.cuda_home or knobs.compiler.cuda_path
        tried = [knobs.compiler.nvcc, os.path.join(home, "bin", "nvcc") if home else None,
                 "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")]
        var = "MORI_JIT_NVCC"
    explicit = tried[0]
    if explicit and os.sep not in explicit:  # a bare name: look it up on PATH
        explicit = tried[0] = shutil.which(explicit) or explicit
    if explicit and not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
        # An explicit choice that does not work is an error, not a silent fallback to another compiler.
        raise ToolchainError(f"{var}={explicit} is not an executable file")
    for c in tried:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise ToolchainError(f"no {'hipcc' if vendor == 'amd' else 'nvcc'} found (tried {[t for t in tried if t]}); "
                         f"set {var}")


@functools.lru_cache(maxsize=None)
def _signature(compiler: str, mtime_ns: int, vendor: str) -> str:
    env = dict(os.environ)
    if vendor == "amd":
        env["HIP_PLATFORM"] = "amd"
    try:
        p = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"{compiler} --version failed: {e}") from None
    if p.returncode != 0:
        raise ToolchainError(f"{compiler} --version exited {p.returncode}: {p.stderr.strip()[:500]}")
    # stdout only: Debian's hipcc also prints a rocm_agent_enumerator traceback on stderr when no GPU
    # is visible, which would give a GPU-less build machine different keys for the same compiler.
    return p.stdout if p.stdout.strip() else p.stderr


def make_toolchain(arch: str, *, need_compiler: bool = True) -> Toolchain:
    """Resolve the compiler, its signature, flags and NIC for ``arch`` (no process-wide state).

    With ``need_compiler=False`` a missing compiler gives a toolchain with an empty compiler and
    signature, enough to render (which never runs the compiler); a bad arch is still an error.
    """
    vendor = vendor_of(arch)
    try:
        compiler = find_compiler(vendor)
    except ToolchainError:
        if need_compiler:
            raise
        return Toolchain(arch, vendor, "", "", _DEFAULT_FLAGS[vendor] + knobs.compiler.extra_flags,
                         knobs.compiler.device_nic)
    sig = _signature(compiler, os.stat(compiler).st_mtime_ns, vendor)
    return Toolchain(arch, vendor, compiler, sig, _DEFAULT_FLAGS[vendor] + knobs.compiler.extra_flags,
                     knobs.compiler.device_nic)


def detect_arch() -> str:
    """The current device's arch: gcnArchName on ROCm, ``sm_<major><minor>`` on CUDA (``sm_90a`` for 9.0)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        raise ToolchainError("cannot detect the arch without torch; set MORI_JIT_ARCH") from None
    if not torch.cuda.is_available():
        raise ToolchainError("no GPU visible to detect the arch from; set MORI_JIT_ARCH (e.g. sm_90a, gfx942)")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]
    cc = f"{props.major}{props.minor}"
    return f"sm_{cc}a" if cc in ("90", "100", "101", "120") else f"sm_{cc}"


_lock = threading.Lock()
_override: str | None = None
_resolved: Toolchain | None = None


def set_arch_override(arch: str) -> None:
    """Set the process-wide arch before the toolchain resolves (cross-compiling, precompile).

    Setting the same arch again is a no-op; a different arch after the toolchain resolved, or a
    second different override, raises :class:`ToolchainError`.
    """
    global _override
    vendor_of(arch)
    with _lock:
        current = _resolved.arch if _resolved is not None else _override
        if current is not None and current != arch:
            raise ToolchainError(f"arch override {arch!r} conflicts with the already "
                                 f"{'resolved' if _resolved else 'overridden'} arch {current!r}")
        _override = arch


def get_toolchain() -> Toolchain:
    """The process-wide toolchain (resolved once, thread-safe)."""
    global _resolved
    if _resolved is not None:
        return _resolved
    with _lock:
        if _resolved is None:
            env_arch = knobs.compiler.arch
            if env_arch and _override and env_arch != _override:
                raise ToolchainError(f"MORI_JIT_ARCH={env_arch!r} conflicts with the arch override {_override!r}")
            _resolved = make_toolchain(env_arch or _override or detect_arch())
        return _resolved


def _reset_for_tests() -> None:
    """Forget the process-wide toolchain and override (tests only)."""
    global _override, _resolved
    with _lock:
        _override = _resolved = None
