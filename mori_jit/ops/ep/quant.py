"""The quantizations of the EP op's two wires.

* **Dispatch** (``EpDispatchCombineConfig.dispatch_quant_type``): the op casts the payload on the
  way (mori-jit's own; mori has no such field). Its one value is below.
* **Combine** (``EpDispatchCombineConfig.quant_type``): mori's field, with mori's values and meaning
  (:data:`COMBINE_QUANT_TYPES`: how the combine wire carries the expert outputs). A backend serves
  the values it lists and refuses the others by name at construction (:func:`combine_quant_gap`).

The dispatch cast:

``"fp8_e4m3_block128"`` (DeepSeek-V3 style, DeepGEMM's ``per_token_cast_to_fp8``): each row of a
bf16 input is cut into blocks of 128 elements, and each block ``b`` becomes e4m3 values and one
scale, exactly (every backend must match these numerics bit for bit):

* ``amax = max(max(|x_b|) in float32, 1e-4)`` (the floor keeps an all-zero block finite);
* ``sf = amax * fl32(1 / 448)`` in float32 (448: the largest e4m3fn value); with 1-byte scales
  (``scale_type_size=1``, UE8M0) ``sf = 2 ** ceil(log2(sf))`` instead, a power of two;
* ``q = float8_e4m3fn(x_b in float32 * (1 / sf))`` (round to nearest even, as torch casts);
* the receiver dequantizes with ``q * sf``.

Why ``amax * fl32(1 / 448)`` rather than ``amax / 448``: DeepGEMM writes ``amax / 448.0``, and torch
on CUDA divides a tensor by a Python scalar as a multiplication by the scalar's float32 reciprocal,
while torch on the CPU divides (they differ in the last bit for about half of all values). The
product is what the formula gives on the GPUs it runs on, so it is the definition, on every device.

Scales are ``[n, hidden / 128]``: float32 (``scale_type_size=4``) or UE8M0 bytes
(``scale_type_size=1``; the byte is the biased exponent ``e + 127`` of ``2 ** e``, torch's
``float8_e8m0fnu`` where torch has it, else ``uint8``). The wire carries the fp8 rows and the scales;
combine stays in the combine dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["QuantSpec", "DISPATCH_QUANT_TYPES", "COMBINE_QUANT_TYPES", "quant_spec", "quantize", "dequantize",
           "scale_values", "ue8m0_dtype", "quant_config_errors", "combine_quant_gap", "float32_reciprocal"]

#: What ``dispatch_quant_type`` means when it is None or ``"none"``: no in-op cast.
NO_QUANT = (None, "none")
#: mori's values of ``quant_type``, the combine wire's quantization (its v1 and v2 ops): none, fp8
#: by a plain cast, fp8 with one-byte scales per 32 values, fp4 e2m1 with one-byte scales per 32
#: values, fp4 e2m1 with float32 scales per 128 values.
COMBINE_QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise", "fp4_blockwise_fp32")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """One in-op quantization: the input dtype it takes, the dtype it sends, its block and its bound."""

    input_dtype: torch.dtype
    wire_dtype: torch.dtype
    block: int
    max_value: float
    scale_sizes: tuple[int, ...]  # accepted scale_type_size values (4: float32, 1: UE8M0)


#: The dispatch casts by name (``dispatch_quant_type``).
DISPATCH_QUANT_TYPES = {"fp8_e4m3_block128": QuantSpec(torch.bfloat16, torch.float8_e4m3fn, 128, 448.0, (4, 1))}

#: The floor of a block's amax (DeepGEMM's), so an all-zero block gets a finite scale.
AMAX_FLOOR = 1e-4


def float32_reciprocal(value: float) -> float:
    """``1 / value`` rounded once to float32 (as a Python float): what torch on CUDA multiplies by
    when a tensor is divided by the scalar ``value``."""
    one = torch.ones((), dtype=torch.float32)
    return float(one / torch.tensor(value, dtype=torch.float32))


def quant_spec(dispatch_quant_type: Optional[str]) -> Optional[QuantSpec]:
    """The spec of the dispatch cast ``dispatch_quant_type`` (None for none); KeyError for an unknown name."""
    return None if dispatch_quant_type in NO_QUANT else DISPATCH_QUANT_TYPES[dispatch_quant_type]


def ue8m0_dtype() -> torch.dtype:
    """The dtype of UE8M0 scales: ``float8_e8m0fnu`` (decodes with ``.float()``), else ``uint8``."""
    return getattr(torch, "float8_e8m0fnu", torch.uint8)


def _ceil_pow2_exponent(sf: torch.Tensor) -> torch.Tensor:
    """int32 ``ceil(log2(sf))`` of positive normal float32 values, exactly, from their bits."""
    bits = sf.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def quantize(x: torch.Tensor, spec: QuantSpec, scale_type_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [n, hidden]`` (``spec.input_dtype``) by blocks of ``spec.block`` columns.

    Returns ``(q [n, hidden] spec.wire_dtype, scales [n, hidden / block])``: float32 scales for
    ``scale_type_size=4``, UE8M0 bytes (:func:`ue8m0_dtype`) for 1. No host sync.
    """
    n, hidden = x.shape
    blocks = x.reshape(n, hidden // spec.block, spec.block).float()
    amax = blocks.abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    sf = amax * float32_reciprocal(spec.max_value)  # (see the module's doc)
    if scale_type_size == 1:
        biased = _ceil_pow2_exponent(sf) + 127
        sf = (biased << 23).view(torch.float32)  # 2 ** (biased - 127), built from its bits
        scales = biased.to(torch.uint8).view(ue8m0_dtype())
    else:
        scales = sf
    q = (blocks * (1.0 / sf).unsqueeze(2)).to(spec.wire_dtype).reshape(n, hidden)
    return q, scales


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """float32 values of block scales: float32 as they are, UE8M0 bytes (1-byte dtypes) as ``2 ** (byte - 127)``."""
    if scales.element_size() != 1:
        return scales.float()
    return (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q [..., hidden]`` times its block scales ``[..., hidden / block]`` (float32 or UE8M0), as ``dtype``."""
    sf = scale_values(scales)
    shape = q.shape
    blocks = q.float().reshape(*shape[:-1], shape[-1] // block, block) * sf.unsqueeze(-1)
    return blocks.reshape(shape).to(dtype)


def quant_config_errors(cfg) -> list[str]:
    """What is wrong with ``cfg``'s two quantization fields and the scale fields of the dispatch cast
    (empty = consistent)."""
    errors = []
    if cfg.quant_type not in COMBINE_QUANT_TYPES:
        hint = (f" ({cfg.quant_type!r} is the dispatch cast: set dispatch_quant_type={cfg.quant_type!r})"
                if cfg.quant_type in DISPATCH_QUANT_TYPES else "")
        errors.append(f"quant_type={cfg.quant_type!r}: the combine wire's quantization, mori's values: "
                      f"{', '.join(map(repr, COMBINE_QUANT_TYPES))}{hint}")
    if cfg.dispatch_quant_type in NO_QUANT:
        return errors
    if cfg.dispatch_quant_type not in DISPATCH_QUANT_TYPES:
        return errors + [f"dispatch_quant_type={cfg.dispatch_quant_type!r}: allowed None, 'none', "
                         f"{', '.join(map(repr, DISPATCH_QUANT_TYPES))}"]
    spec, q = DISPATCH_QUANT_TYPES[cfg.dispatch_quant_type], f"dispatch_quant_type={cfg.dispatch_quant_type!r}"
    if cfg.dispatch_data_type != spec.wire_dtype:
        errors.append(f"{q} sends {spec.wire_dtype}: set dispatch_data_type={spec.wire_dtype} (what dispatch "
                      f"returns; the input is {spec.input_dtype}), got {cfg.dispatch_data_type}")
    if cfg.hidden_dim % spec.block:
        errors.append(f"{q} needs hidden_dim a multiple of {spec.block}, got {cfg.hidden_dim}")
    elif cfg.scale_dim != cfg.hidden_dim // spec.block:
        errors.append(f"{q} makes one scale per {spec.block} elements: set scale_dim={cfg.hidden_dim // spec.block} "
                      f"(hidden_dim / {spec.block}), got {cfg.scale_dim}")
    if cfg.scale_type_size not in spec.scale_sizes:
        errors.append(f"{q}: scale_type_size={cfg.scale_type_size}, allowed 4 (float32 scales) or 1 (UE8M0)")
    return errors


def combine_quant_gap(cfg, served: tuple[str, ...]) -> Optional[str]:
    """A backend's refusal of ``cfg.quant_type`` when it is not among the combine quantizations the
    backend ``served`` (None when it is): what :meth:`_unsupported` lists."""
    if cfg.quant_type in served:
        return None
    return (f"quant_type={cfg.quant_type!r} (mori's combine-wire quantization; this backend's combine moves "
            f"{cfg.combine_dtype} rows as they are, served: {', '.join(map(repr, served))})")
