"""The in-op fp8 block quantization (``quant.py``) against the plain torch formula written out
independently (``golden_moe.golden_quantize``), bit for bit, and against hand-computed values."""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.golden_moe import golden_quantize
from mori_jit.ops.ep.quant import DISPATCH_QUANT_TYPES, dequantize, quantize, scale_values

SPEC = DISPATCH_QUANT_TYPES["fp8_e4m3_block128"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def hard_rows(gen, rows: int = 8) -> torch.Tensor:
    """float32 ``[rows, 512]`` (rows >= 7) whose blocks are ordinary, all zero, tiny, huge, a single
    spike, and exact powers of two; the caller casts them to bf16."""
    x = torch.randn(rows, 512, generator=gen) * 3
    x[1, :128] = 0
    x[2, 128:256] *= 1e-9
    x[3, 256:384] *= 1e30
    x[4, 384:] = 0
    x[4, 400] = -7.0
    x[5, :128] = 448.0 * 2  # amax / 448 = 2: a power of two already, UE8M0 must not round it up
    x[6] = torch.randint(-4, 5, (512,), generator=gen).float() * 2.0 ** -10
    return x


@pytest.mark.parametrize("scale_type_size", [4, 1])
def test_quantize_matches_the_plain_torch_formula_bit_for_bit(scale_type_size):
    gen = torch.Generator().manual_seed(5)
    for x in (hard_rows(gen).to(torch.bfloat16), (torch.randn(64, 1024, generator=gen) * 10).to(torch.bfloat16),
              torch.zeros(0, 256, dtype=torch.bfloat16)):
        q, s = quantize(x, SPEC, scale_type_size)
        gq, gs = golden_quantize(x, scale_type_size)
        assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
        assert s.shape == (x.shape[0], x.shape[1] // 128) and s.element_size() == scale_type_size
        assert s.dtype == gs.dtype
        assert torch.equal(_bytes(q), _bytes(gq)) and torch.equal(_bytes(s), _bytes(gs))


def test_hand_computed_blocks():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, -224.0, 1.0  # block 0: amax 448, scale 1, values exact
    x[0, 128] = 448.0 * 3  # block 1: amax 1344, scale ~3 (float32), 4 (UE8M0)
    q, s = quantize(x, SPEC, 4)
    inv448 = torch.tensor(1.0) / torch.tensor(448.0)  # 1344 * fl32(1/448) is 3 + 1 ulp (see below)
    assert s[0, 0].item() == 1.0 and s[0, 1].item() == (torch.tensor(1344.0) * inv448).item() != 3.0
    assert q[0, :3].float().tolist() == [448.0, -224.0, 1.0] and q[0, 128].float().item() == 448.0
    q1, s1 = quantize(x, SPEC, 1)
    assert s1.view(torch.uint8).tolist() == [[127, 129]]  # 2**0, 2**2
    assert scale_values(s1).tolist() == [[1.0, 4.0]]
    assert q1[0, 128].float().item() == 320.0  # 1344 / 4 = 336, halfway between 320 and 352: ties to even
    z, zs = quantize(torch.zeros(2, 128, dtype=torch.bfloat16), SPEC, 4)
    assert torch.equal(zs, torch.full((2, 1), 1e-4) * inv448) and not bool(z.float().any())  # finite, zeros


def test_the_scale_is_amax_times_the_float32_reciprocal_of_448_on_every_device():
    """torch on CUDA computes ``amax / 448.0`` as ``amax * fl32(1/448)`` (a CPU scalar divisor), the
    CPU divides: amax 3 is one where they differ in the last bit. The definition is the product
    (what DeepGEMM's formula gives on a GPU), so the scales do not depend on the device."""
    inv448 = torch.tensor(1.0) / torch.tensor(448.0)
    three = torch.tensor([3.0])
    assert not torch.equal(three / 448.0, three * inv448)  # (the case this test is about)
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 3.0, -1.5
    q, s = quantize(x, SPEC, 4)
    assert s.view(torch.int32).item() == (three * inv448).view(torch.int32).item()
    gq, gs = golden_quantize(x, 4)
    assert torch.equal(_bytes(s), _bytes(gs)) and torch.equal(_bytes(q), _bytes(gq))


@pytest.mark.parametrize("scale_type_size", [4, 1])
def test_dequantize_is_within_fp8_precision(scale_type_size):
    x = (torch.randn(16, 384, generator=torch.Generator().manual_seed(3)) * 5).to(torch.bfloat16)
    q, s = quantize(x, SPEC, scale_type_size)
    back = dequantize(q, s, 128, torch.float32)
    amax = x.float().reshape(16, 3, 128).abs().amax(2, keepdim=True).expand(16, 3, 128).reshape(16, 384)
    # e4m3 keeps 3 mantissa bits (relative step 2**-3 at most, half of it after rounding); a UE8M0
    # scale up to twice the exact one halves the resolution of small values once more
    assert bool(((back - x.float()).abs() <= amax * 2.0 ** -4 * (2 if scale_type_size == 1 else 1) + 1e-6).all())
