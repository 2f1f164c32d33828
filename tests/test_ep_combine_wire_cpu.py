"""The combine wire's cast and decode as the kernels do them (``kernels/ep/ep_combine_wire.hpp``, with
the block rule of ``ep_quant.hpp``), built for the host with g++ and compared with ``quant.py`` bit
for bit: every e4m3 byte, every scale word and every decoded float32, on bf16 and float32 rows,
both casts, float32 and UE8M0 scales, over saturating, tiny, zero, NaN and infinite values. The
device build runs the same functions (the GPU suite compares the hip combine with the torch
backend's)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from jit_helpers import host_harness
from mori_jit.ops.ep.quant import combine_wire_decode, combine_wire_encode

_HARNESS = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#define MORI_DEVICE inline
static inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fmul_rn(float a, float b) { return a * b; }
namespace mori::plat {
struct vec16_t { uint32_t x, y, z, w; };
inline int lane_id() { return 0; }
inline int shfl(int v, int) { return v; }
}  // namespace mori::plat
#include "ep/ep_combine_wire.hpp"
using namespace mori::ep;
using mori::plat::vec16_t;

// One row of `hidden` elements (elem bytes 2 or 4) -> wire bytes, scale words (one per 128), and the
// decoded float32 values, as a sender's lanes cast it and a summer decodes it. quant 1: direct, 2: block.
template <int kElem>
static void Row(const void* x, int hidden, int quant, int scale_bytes, uint8_t* q, uint32_t* scales, float* dec) {
  constexpr int kPer = 16 / kElem, kWords = kPer / 4, kLanes = 128 / kPer;
  const int vecs = hidden / kPer;
  for (int b0 = 0; b0 < vecs; b0 += (quant == 2 ? kLanes : 1)) {
    const int n = quant == 2 ? kLanes : 1;
    float amax = 0.f;  // (LanesMax's butterfly: a max is exact in any order)
    for (int v = b0; v < b0 + n; ++v) {
      vec16_t in;
      std::memcpy(&in, static_cast<const char*>(x) + 16 * v, 16);
      amax = std::fmax(amax, AbsMaxVec<kElem>(in));
    }
    uint32_t word = 0;
    float inv = 1.f;
    if (quant == 2) inv = 1.0f / (scale_bytes == 1 ? BlockScale<1>(amax, word) : BlockScale<4>(amax, word));
    for (int v = b0; v < b0 + n; ++v) {
      vec16_t in;
      std::memcpy(&in, static_cast<const char*>(x) + 16 * v, 16);
      WireVec<kWords> c;
      CastWords<kElem>(in, inv, c.w);
      c.scale = word;
      std::memcpy(q + v * kPer, c.w, kPer);
      float acc[kPer] = {};
      const float sf = scale_bytes == 1 ? ScaleOfWord<1>(word) : ScaleOfWord<4>(word);
      if (quant == 2) AddDecoded<true>(c, sf, acc);
      else AddDecoded<false>(c, sf, acc);
      std::memcpy(dec + v * kPer, acc, sizeof(acc));
    }
    if (quant == 2) scales[b0 / kLanes] = word;
  }
}

extern "C" void wire_row(const void* x, int elem, int hidden, int quant, int scale_bytes, uint8_t* q,
                         uint32_t* scales, float* dec) {
  if (elem == 2) Row<2>(x, hidden, quant, scale_bytes, q, scales, dec);
  else Row<4>(x, hidden, quant, scale_bytes, q, scales, dec);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return host_harness(tmp_path_factory.mktemp("wire_host"), _HARNESS)


def _kernel_row(lib, x: torch.Tensor, quant: str, scale_bytes: int):
    hidden = x.shape[0]
    q = torch.zeros(hidden, dtype=torch.uint8)
    scales = torch.zeros(max(1, hidden // 128), dtype=torch.int32)
    dec = torch.zeros(hidden, dtype=torch.float32)
    xc = x.contiguous()
    lib.wire_row(ctypes.c_void_p(xc.data_ptr()), xc.element_size(), hidden, 1 if quant == "fp8_direct_cast" else 2,
                 scale_bytes, ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(scales.data_ptr()),
                 ctypes.c_void_p(dec.data_ptr()))
    return q, scales, dec


def _rows(dtype):
    gen = torch.Generator().manual_seed(17)
    rows = [torch.randn(512, generator=gen) * s for s in (1e-5, 1e-2, 1.0, 100.0, 3000.0)]
    special = torch.randn(512, generator=gen)
    special[:8] = torch.tensor([0.0, -0.0, 448.0, -464.0, 1e6, 2.0 ** -9, 1.0625, 1.1875])
    rows.append(special)
    edge = torch.zeros(512)
    edge[128:256] = torch.linspace(-448, 448, 128)
    rows.append(edge)  # an all-zero block: the amax floor
    nan = torch.randn(512, generator=gen)
    nan[3], nan[5], nan[7] = float("nan"), float("inf"), -float("inf")
    rows.append(nan)  # (the direct cast only: a block with a NaN or infinite amax is outside the contract)
    return [r.to(dtype) for r in rows]


@pytest.mark.parametrize("quant, scale_bytes", [("fp8_direct_cast", 4), ("fp8_blockwise", 4), ("fp8_blockwise", 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_wire_is_quant_py_bit_for_bit(lib, quant, scale_bytes, dtype):
    rows = _rows(dtype)
    if quant == "fp8_blockwise":
        rows = rows[:-1]
    for i, x in enumerate(rows):
        q, scales, dec = _kernel_row(lib, x, quant, scale_bytes)
        fields = combine_wire_encode(x.unsqueeze(0), quant, scale_bytes)
        assert torch.equal(q, fields[0][0]), f"row {i}: bytes {(q != fields[0][0]).nonzero()[:5].tolist()}"
        assert not bool((q == 0xFF).any()), f"row {i}: a 0xff byte on the wire"
        if quant == "fp8_blockwise":
            want = fields[1][0].view(torch.int32) if scale_bytes == 4 else fields[1][0].to(torch.int32)
            assert torch.equal(scales, want), f"row {i}: scale words"
        # (added to a +0 sum, as the summer does: a -0 value adds up to +0)
        want_dec = torch.zeros(x.shape[0]) + combine_wire_decode(fields, quant, scale_bytes, dtype, x.shape[0])[0]
        same = (dec.view(torch.int32) == want_dec.view(torch.int32)) | (dec.isnan() & want_dec.isnan())
        assert bool(same.all()), f"row {i}: decoded values {(~same).nonzero()[:5].tolist()}"
