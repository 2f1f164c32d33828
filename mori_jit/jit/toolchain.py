"""Toolchains: which compiler builds for which arch, with which flags, and its exact signature.

``gfx*`` → ``hipcc --genco --offload-arch=<arch> -std=c++20`` with ``HIP_PLATFORM=amd`` (code
object); ``sm_*`` → ``nvcc --cubin -gencode=arch=compute_XX,code=sm_XX -std=c++20`` (cubin). A
kernel with device libraries is compiled with ``-rdc=true`` and device-linked by
``nvcc -dlink --cubin`` into one cubin (:meth:`Toolchain.link_command`; NVIDIA only). The
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
from .archs import ARCH_PATTERN, DEFAULT_ARCH, KNOWN_ARCHS, known_archs_text

__all__ = ["Toolchain", "ToolchainError", "make_toolchain", "get_toolchain", "set_arch_override",
           "detect_arch", "has_bulk_copy", "vendor_of", "check_arch", "wave_size_for_arch", "ARCH_PATTERN",
           "find_compiler", "search_compiler", "compiler_default_arch", "COMPILER_NAME", "COMPILER_VAR",
           "INSTALL_HINT", "DEFAULT_ARCH"]


class ToolchainError(RuntimeError):
    """No usable compiler or arch; the message says what was tried."""


_ARCH_RE = re.compile(ARCH_PATTERN)


def vendor_of(arch: str) -> str:
    """``amd`` for ``gfx*``, ``nvidia`` for ``sm_*``; anything else is an error naming the forms.

    The form only (a cache directory of any such arch is read); :func:`check_arch` is what an arch
    to build for must pass."""
    if not isinstance(arch, str) or not _ARCH_RE.fullmatch(arch):
        raise ToolchainError(f"arch {arch!r} is not supported; expected gfx<id> (e.g. gfx90a, gfx942) "
                             f"or sm_<cc>[a] (e.g. sm_90a), one of: {known_archs_text()}")
    return "amd" if arch.startswith("gfx") else "nvidia"


def check_arch(arch: str) -> str:
    """The vendor of ``arch`` if it is one mori-jit builds for (:data:`~mori_jit.jit.archs.KNOWN_ARCHS`);
    else :class:`ToolchainError` listing those."""
    vendor = vendor_of(arch)
    if arch not in KNOWN_ARCHS[vendor]:
        raise ToolchainError(f"arch {arch!r} is not supported; known archs: {known_archs_text()}")
    return vendor


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

    def command(self, src: Path, out: Path, include_dirs: list[Path], *, relocatable: bool = False) -> list[str]:
        """The full compile command for ``src`` → ``out``; ``relocatable``: relocatable device code,
        to be device-linked (:meth:`link_command`)."""
        inc = [f"-I{d}" for d in include_dirs]
        if self.vendor == "amd":
            if relocatable:
                self._no_device_link()
            return [self.compiler, "--genco", f"--offload-arch={self.arch}", "-std=c++20", *self.flags,
                    *inc, "-o", str(out), str(src)]
        rdc = ["-rdc=true"] if relocatable else []
        return [self.compiler, "--cubin", *rdc, "-x", "cu", f"-gencode=arch=compute_{self.arch[3:]},code={self.arch}",
                "-std=c++20", *self.flags, *inc, "-o", str(out), str(src)]

    def link_command(self, inputs: list[Path], out: Path) -> list[str]:
        """The device-link command: relocatable objects and archives ``inputs`` → one cubin ``out``.

        ``nvcc -dlink --cubin`` rather than calling ``nvlink`` itself: it runs the nvlink of the
        same toolkit as the compile (so the compiler signature in the key covers the linker too),
        needs no second tool to find or configure, and adds the toolkit's device runtime library.
        """
        if self.vendor == "amd":
            self._no_device_link()
        return [self.compiler, "-dlink", "--cubin", f"-gencode=arch=compute_{self.arch[3:]},code={self.arch}",
                *map(str, inputs), "-o", str(out)]

    def _no_device_link(self) -> None:
        raise ToolchainError(f"device linking (a spec's device_libraries) is built for NVIDIA arches only, "
                             f"not {self.arch}")

    def env(self) -> dict[str, str]:
        """Environment for the compiler subprocess (``HIP_PLATFORM=amd`` so hipcc never picks nvcc)."""
        env = dict(os.environ)
        if self.vendor == "amd":
            env["HIP_PLATFORM"] = "amd"
        return env


# nvcc: plain constexpr (no __host__ __device__) shared arithmetic needs --expt-relaxed-constexpr.
_DEFAULT_FLAGS = {"amd": ("-O3",), "nvidia": ("-O3", "-lineinfo", "--expt-relaxed-constexpr")}


#: The compiler each vendor's arches are built with.
COMPILER_NAME = {"amd": "hipcc", "nvidia": "nvcc"}
#: The variable that names each vendor's compiler explicitly.
COMPILER_VAR = {"amd": "MORI_JIT_HIPCC", "nvidia": "MORI_JIT_NVCC"}
#: Where each vendor's installer puts its compiler (looked at after the variables, before PATH).
STANDARD_PLACE = {"amd": "/opt/rocm/bin/hipcc", "nvidia": "/usr/local/cuda/bin/nvcc"}
#: How to get each vendor's compiler when none is found.
INSTALL_HINT = {"amd": "install ROCm's hipcc (Debian/Ubuntu: apt-get install hipcc) or set MORI_JIT_HIPCC",
                "nvidia": "install the CUDA toolkit (https://developer.nvidia.com/cuda-downloads) "
                          "or set MORI_JIT_NVCC or CUDA_HOME"}


def _explicit_compiler(vendor: str) -> str | None:
    """``MORI_JIT_HIPCC`` / ``MORI_JIT_NVCC`` (a bare name looked up on PATH), or None."""
    explicit = knobs.compiler.hipcc if vendor == "amd" else knobs.compiler.nvcc
    if explicit and os.sep not in explicit:
        return shutil.which(explicit) or explicit
    return explicit


def _candidates(vendor: str) -> list[str]:
    """The places searched after the explicit variable, in order and without repeats."""
    if vendor == "amd":
        root = os.path.join(knobs.compiler.rocm_path, "bin", "hipcc")
    else:
        home = (knobs.compiler.cuda_home or knobs.compiler.cuda_path)
        root = os.path.join(home, "bin", "nvcc") if home else None
    tried = [root, STANDARD_PLACE[vendor], shutil.which(COMPILER_NAME[vendor])]
    return list(dict.fromkeys(t for t in tried if t))


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_compiler(vendor: str) -> str:
    """The absolute path of ``vendor``'s compiler (``hipcc`` or ``nvcc``).

    ``MORI_JIT_HIPCC``/``MORI_JIT_NVCC`` wins and must be executable; else the first executable of
    ``$ROCM_PATH/bin``, ``/opt/rocm/bin``, ``PATH`` (hipcc) or ``$CUDA_HOME/bin``,
    ``/usr/local/cuda/bin``, ``PATH`` (nvcc). None found raises :class:`ToolchainError` naming the
    places tried and how to get one.
    """
    explicit = _explicit_compiler(vendor)
    if explicit:
        if not _is_executable(explicit):
            # An explicit choice that does not work is an error, not a silent fallback to another compiler.
            raise ToolchainError(f"{COMPILER_VAR[vendor]}={explicit} is not an executable file")
        return os.path.abspath(explicit)
    return search_compiler(vendor)


def search_compiler(vendor: str) -> str:
    """:func:`find_compiler` without the explicit variable: the first executable of the places searched."""
    tried = _candidates(vendor)
    for c in tried:
        if _is_executable(c):
            return os.path.abspath(c)
    raise ToolchainError(f"no {COMPILER_NAME[vendor]} found (tried {', '.join(tried)} and PATH); "
                         f"{INSTALL_HINT[vendor]}")


def compiler_default_arch() -> tuple[str, str]:
    """``(arch, compiler)`` for a machine whose only hint is an installed compiler: nvcc → sm_90a,
    else hipcc → gfx90a (:data:`DEFAULT_ARCH`). Neither found raises :class:`ToolchainError` saying
    how to get one."""
    misses = []
    for vendor in ("nvidia", "amd"):
        try:
            return DEFAULT_ARCH[vendor], find_compiler(vendor)
        except ToolchainError as e:
            misses.append(str(e))
    raise ToolchainError("; ".join(misses))


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


def make_toolchain(arch: str, need_compiler: bool = True) -> Toolchain:
    """Resolve the compiler, its signature, flags and NIC for ``arch`` (no process-wide state).

    Without ``need_compiler`` a missing compiler gives a toolchain with an empty compiler path
    and signature (enough to render a source, never to key or build one); an arch that
    :func:`check_arch` refuses still raises.
    """
    vendor = check_arch(arch)
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
    check_arch(arch)
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
