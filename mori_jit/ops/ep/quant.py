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
``float8_e8m0fnu`` where torch has it, else ``uint8``). The wire carries the fp8 rows and the scales.

The combine wire (``quant_type``; every backend matches these numerics bit for bit, the hip kernels
in ``kernels/ep/ep_combine_wire.hpp``). Every expert-output row (the combine dtype, bf16 or
float32; the home rank's own rows too, so a sum does not depend on where the experts live) is cast
before it is summed:

* ``"fp8_direct_cast"``: ``q = e4m3fn(clamp(x, -448, 448))`` per element in float32, rounded to
  nearest even (:func:`cast_e4m3`: saturating, infinities become +-448, a NaN becomes 0x7f);
* ``"fp8_blockwise"``: the dispatch cast's rule above, per 128-element block of the row, with its
  scales (``combine_scale_type_size``: 4, float32; 1, UE8M0) travelling with the row
  (:func:`quantize` itself; a NaN byte then becomes 0x7f as in the direct cast);
* the receiver decodes each value to float32 (blockwise: ``q * sf`` rounded once) and sums a
  token's rows in float32, one per destination rank, in the order of the token's top-k slots (the
  rank of its first slot first), starting from +0, then rounds once to the combine dtype. The
  top-k weights (when passed) are summed alongside in the same order and are not quantized.

No byte of the wire is 0xff (-NaN): the low-latency combine's signal words (all-ones words) can
never be data. mori's own kernels use other rules (its v2 blockwise combine scales a block only
when its amax exceeds the fp8 maximum; its gfx125x kernels use 32-element blocks with 1-byte
scales): the names and what travels are mori's, these numerics are mori-jit's.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["QuantSpec", "DISPATCH_QUANT_TYPES", "COMBINE_QUANT_TYPES", "COMBINE_WIRE_QUANTS", "quant_spec", "quantize",
           "dequantize", "scale_values", "ue8m0_dtype", "quant_config_errors", "combine_quant_gap", "float32_reciprocal",
           "cast_e4m3", "combine_wire_encode", "combine_wire_decode"]

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

#: The combine-wire quantizations with a cast (``quant_type``), by name: the wire's e4m3 and, for the
#: blockwise one, the dispatch cast's block rule (its ``scale_sizes`` are ``combine_scale_type_size``'s
#: values). The input is the combine dtype (bf16, or float32 for the expert-major combine's sums).
COMBINE_WIRE_QUANTS = {"fp8_direct_cast": QuantSpec(torch.bfloat16, torch.float8_e4m3fn, 1, 448.0, ()),
                       "fp8_blockwise": DISPATCH_QUANT_TYPES["fp8_e4m3_block128"]}

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


def _canonical_nan(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes with every NaN (0x7f, 0xff) as 0x7f, so that no byte is 0xff."""
    b = q.view(torch.uint8)
    return torch.where(b == 0xFF, torch.full_like(b, 0x7F), b)


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The combine wire's direct cast: e4m3fn bytes (uint8) of ``x`` in float32, saturating at +-448
    (infinities too), rounded to nearest even, a NaN as 0x7f."""
    return _canonical_nan(x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t [r, c]`` as its raw bytes ``[r, c * element_size]`` (an empty tensor too)."""
    if t.numel() == 0:
        return torch.empty((t.shape[0], t.shape[1] * t.element_size()), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def combine_wire_encode(rows: torch.Tensor, quant_type: str, scale_type_size: int) -> list[torch.Tensor]:
    """What the combine wire carries of ``rows [r, H]`` (the combine dtype): its byte fields, each
    ``[r, w]`` uint8 (the rows themselves for ``"none"``; the e4m3 bytes, then the blockwise scales)."""
    if quant_type not in COMBINE_WIRE_QUANTS:
        return [_bytes(rows)]
    if quant_type == "fp8_direct_cast":
        return [cast_e4m3(rows)]
    q, scales = quantize(rows.float(), COMBINE_WIRE_QUANTS[quant_type], scale_type_size)
    return [_canonical_nan(q), _bytes(scales)]


def combine_wire_decode(fields: list[torch.Tensor], quant_type: str, scale_type_size: int, dtype: torch.dtype,
                        hidden: int) -> torch.Tensor:
    """float32 ``[r, H]`` values of what :func:`combine_wire_encode` made (``dtype``: the rows' dtype
    for ``"none"``)."""
    rows = fields[0].shape[0]
    if rows == 0:
        return torch.empty((0, hidden), dtype=torch.float32, device=fields[0].device)
    if quant_type not in COMBINE_WIRE_QUANTS:
        return fields[0].contiguous().view(dtype).reshape(rows, hidden).float()
    q = fields[0].contiguous().view(torch.float8_e4m3fn).float()
    if quant_type == "fp8_direct_cast":
        return q
    raw = fields[1].contiguous()
    scales = raw.view(torch.float32) if scale_type_size == 4 else raw
    sf = scale_values(scales).reshape(q.shape[0], hidden // 128, 1)
    return (q.reshape(q.shape[0], hidden // 128, 128) * sf).reshape(q.shape[0], hidden)


def _combine_quant_errors(cfg) -> list[str]:
    """What is wrong with the fields of the combine wire's cast (``quant_type``)."""
    if cfg.quant_type not in COMBINE_WIRE_QUANTS:
        return []
    q, errors = f"quant_type={cfg.quant_type!r}", []
    if cfg.quant_type == "fp8_blockwise":
        if cfg.hidden_dim % 128:
            errors.append(f"{q} makes one scale per 128 elements: needs hidden_dim a multiple of 128, got "
                          f"{cfg.hidden_dim}")
        if cfg.combine_scale_type_size not in COMBINE_WIRE_QUANTS[cfg.quant_type].scale_sizes:
            errors.append(f"combine_scale_type_size={cfg.combine_scale_type_size!r}: allowed 4 (float32 scales) "
                          f"or 1 (UE8M0)")
    elif cfg.hidden_dim % 16:
        errors.append(f"{q} moves rows of hidden_dim e4m3 bytes in 16-byte vectors: needs hidden_dim a multiple "
                      f"of 16, got {cfg.hidden_dim}")
    return errors


def quant_config_errors(cfg) -> list[str]:
    """What is wrong with ``cfg``'s two quantization fields and the scale fields of the dispatch cast
    (empty = consistent)."""
    errors = []
    if cfg.quant_type not in COMBINE_QUANT_TYPES:
        hint = (f" ({cfg.quant_type!r} is the dispatch cast: set dispatch_quant_type={cfg.quant_type!r})"
                if cfg.quant_type in DISPATCH_QUANT_TYPES else "")
        errors.append(f"quant_type={cfg.quant_type!r}: the combine wire's quantization, mori's values: "
                      f"{', '.join(map(repr, COMBINE_QUANT_TYPES))}{hint}")
    errors += _combine_quant_errors(cfg)
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
    return (f"quant_type={cfg.quant_type!r} (mori's combine-wire quantization; this backend serves "
            f"{', '.join(map(repr, served))})")
