"""``example_axpy``: y = a·x + y over bf16 or fp32 — the documented way to add a kernel.

Everything a kernel needs is in this one file: the Cfg dataclass (the one list of fields), the
derived arithmetic shared with device code, the args declaration, the generated header, and the
Spec (entry name, geometry, template variables). The device body is ``kernels/example/axpy.hpp``
and the translation unit is ``templates/example_axpy.hip.j2``. Nothing outside this file changes
when it is added: the registry discovers ``*_spec.py`` modules.
"""
from __future__ import annotations

import dataclasses
import types

from mori_jit.jit.args import ArgsSchema, f32, i64, ptr
from mori_jit.jit.codegen import GeneratedHeader, register_header
from mori_jit.jit.expr import C, Derived, where
from mori_jit.jit.fields import CEnum, ConfigError
from mori_jit.jit.registry import register
from mori_jit.jit.spec import Geometry, Spec


class AxpyDType(CEnum):
    """Element type of x and y."""

    Bf16 = 0
    Fp32 = 1

    @classmethod
    def _coerce_other(cls, value):
        name = str(value).replace("torch.", "")
        return {"bfloat16": cls.Bf16, "float32": cls.Fp32}.get(name)


@dataclasses.dataclass(frozen=True)
class AxpyCfg:
    """One axpy specialization. ``vecElems`` elements per thread per step; ``blockNum`` blocks."""

    dtype: AxpyDType = AxpyDType.Bf16
    vecElems: int = 8
    blockSize: int = 256
    blockNum: int = 264

    def __post_init__(self):
        if not AxpyIsValid(self):
            raise ConfigError(f"invalid {self}: vecElems*elemBytes must be 4, 8 or 16 bytes, "
                              f"blockSize a multiple of 32 in [32, 1024], blockNum >= 1")


AxpyElemBytes = Derived("AxpyElemBytes", "AxpyCfg", where(C.dtype.eq(AxpyDType.Bf16), 2, 4),
                        doc="bytes per element")
AxpyVecBytes = Derived("AxpyVecBytes", "AxpyCfg", C.vecElems * AxpyElemBytes, doc="bytes per vector access")
AxpyBlockThreads = Derived("AxpyBlockThreads", "AxpyCfg", C.blockSize, doc="threads per block")
AxpyIsValid = Derived(
    "AxpyIsValid", "AxpyCfg",
    (AxpyVecBytes.eq(4) | AxpyVecBytes.eq(8) | AxpyVecBytes.eq(16)) & (C.blockSize >= 32)
    & (C.blockSize <= 1024) & (C.blockSize % 32).eq(0) & (C.blockNum >= 1),
    ctype="bool", doc="the kernel can be built for this config")

AXPY_ARGS = ArgsSchema("AxpyArgs", [
    ptr("x", "const void", "input x[n]"),
    ptr("y", "void", "in/out y[n]"),
    f32("a", doc="scale"),
    i64("n", doc="number of elements"),
])

register_header(GeneratedHeader(
    "example/axpy_generated.hpp", "mori::example", enums=[AxpyDType], cfgs=[AxpyCfg],
    derived=[AxpyElemBytes, AxpyVecBytes, AxpyBlockThreads, AxpyIsValid], args=[AXPY_ARGS]))


class AxpySpec(Spec):
    """The example kernel, ``y = a * x + y``: the smallest complete spec (see the module doc)."""

    name = "example_axpy"
    cfg_type = AxpyCfg
    args = AXPY_ARGS
    template = "example_axpy.hip.j2"
    deps = ("kernels/platform", "kernels/common", "kernels/example")

    def entry_name(self, cfg: AxpyCfg) -> str:
        return f"mori_example_axpy_{cfg.dtype.name.lower()}_v{cfg.vecElems}_{cfg.blockNum}x{cfg.blockSize}"

    def geometry(self, cfg: AxpyCfg) -> Geometry:
        return Geometry((cfg.blockNum, 1, 1), (AxpyBlockThreads(cfg), 1, 1))

    def template_vars(self, cfg: AxpyCfg, toolchain) -> dict:
        return {"elem_t": {AxpyDType.Bf16: "mori::bf16_t", AxpyDType.Fp32: "float"}[cfg.dtype]}

    def precompile_cfgs(self, toolchain) -> list[AxpyCfg]:
        """One config per dtype, with the widest (16-byte) vector that dtype allows."""
        out = []
        for dt in AxpyDType:
            elem = AxpyElemBytes(types.SimpleNamespace(dtype=dt))  # the shared arithmetic, not a copy
            out.append(self.make_cfg(toolchain, {"dtype": dt, "vecElems": 16 // elem}))
        return out


AXPY = register(AxpySpec())
