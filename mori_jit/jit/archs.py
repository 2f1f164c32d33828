"""The archs mori-jit builds for, by vendor: what ``--arch``, ``MORI_JIT_ARCH`` and the device may name.

A name of the right form that is not listed here (``sm_91``, ``gfx1234``) names no GPU: it would
render and key, and only the compiler would refuse it. :func:`~mori_jit.jit.toolchain.check_arch`
refuses it up front, listing these.
NVIDIA: every compute capability from Volta on that a CUDA 12 or 13 nvcc builds (with its ``a``
variant where one exists); AMD: the CDNA and RDNA gfx targets of ROCm's clang.
"""
from __future__ import annotations

__all__ = ["ARCH_PATTERN", "KNOWN_ARCHS", "DEFAULT_ARCH", "known_archs_text"]

#: The form of an arch name (matched whole: ``re.fullmatch``, never ``$``, which lets a trailing
#: newline through); a cache directory of any arch of this form is read.
ARCH_PATTERN = r"gfx[0-9a-f]{3,5}|sm_[0-9]{2,3}a?"

KNOWN_ARCHS: dict[str, tuple[str, ...]] = {
    "nvidia": ("sm_70", "sm_72", "sm_75", "sm_80", "sm_86", "sm_87", "sm_88", "sm_89", "sm_90", "sm_90a",
               "sm_100", "sm_100a", "sm_101", "sm_101a", "sm_103", "sm_103a", "sm_110", "sm_110a", "sm_120",
               "sm_120a", "sm_121", "sm_121a"),
    "amd": ("gfx906", "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950", "gfx1030", "gfx1031", "gfx1032",
            "gfx1100", "gfx1101", "gfx1102", "gfx1150", "gfx1151", "gfx1200", "gfx1201", "gfx1250"),
}


def known_archs_text() -> str:
    """The known archs as one line: ``NVIDIA sm_70, ...; AMD gfx906, ...``."""
    return f"NVIDIA {', '.join(KNOWN_ARCHS['nvidia'])}; AMD {', '.join(KNOWN_ARCHS['amd'])}"


#: The arch built for when only a compiler names the vendor (no --arch, MORI_JIT_ARCH or GPU): sm_90a
#: is the arch the EP kernels are tuned on (H100/H200); gfx90a is a CDNA arch every hipcc that
#: builds these kernels knows (Debian's does not know gfx942).
DEFAULT_ARCH = {"nvidia": "sm_90a", "amd": "gfx90a"}
