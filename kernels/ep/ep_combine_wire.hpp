// EP combine: the fp8 wire (EpCfg combineQuant, the op's quant_type), the numerics of
// mori_jit/ops/ep/quant.py ("The combine wire"), bit for bit. Every 16-byte vector of a row (8 bf16
// or 4 fp32 elements) becomes as many e4m3 bytes (kWords 32-bit words), element e in byte e:
//   Fp8Direct: q = e4m3(x), saturating at +-448 (infinities too), rounded to nearest even;
//   Fp8Block:  the dispatch cast's block rule (ep_quant.hpp: BlockScale), per 128 elements, whose
//              scale travels as one 32-bit word per block (float32 bits, or the UE8M0 byte);
// a NaN becomes 0x7f, so no wire byte is 0xff and no data word is a low-latency signal word
// (CombWord). The home rank decodes each byte to float32 (Fp8Block: times the block's scale, one
// rounding) and adds it to its float32 sums. Cast and decode use the packed hardware conversions
// where the arch has them (sm_89+), Fp8E4m3FromF32 / FromE4m3 elsewhere: the same values. The
// software pair needs only the platform header, so a host build checks it against torch
// (tests/test_ep_combine_wire_cpu.py); the GPU suite checks the hardware pair byte for byte.
#pragma once
#include <cstdint>

#include "ep/ep_quant.hpp"

namespace mori::ep {

// One byte per element: a NaN (either sign) as 0x7f, everything else as Fp8E4m3FromF32 converts it.
MORI_DEVICE uint32_t CanonNanBytes(uint32_t w) {
#pragma unroll
  for (int b = 0; b < 4; ++b)
    if (((w >> (8 * b)) & 0x7Fu) == 0x7Fu) w = (w & ~(0xFFu << (8 * b))) | (0x7Fu << (8 * b));
  return w;
}

// The float32 value of an e4m3fn byte, exactly (0x7f, 0xff: NaN).
MORI_DEVICE float FromE4m3(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24, e = (b >> 3) & 0xFu, m = b & 7u;
  float v;
  if ((b & 0x7Fu) == 0x7Fu) v = __uint_as_float(0x7FC00000u);
  else if (e == 0) v = float(m) * 0.001953125f;  // m * 2^-9
  else v = __uint_as_float(((e + 120u) << 23) | (m << 20));
  return __uint_as_float(__float_as_uint(v) | sign);
}

// Element i of a 16-byte vector of kElem-byte floats (2: bf16, 4: float32), as float32.
template <int kElem>
MORI_DEVICE float ElemOf(const uint32_t (&in)[4], int i) {
  if constexpr (kElem == 4) return __uint_as_float(in[i]);
  else return __uint_as_float(((in[i / 2] >> (16 * (i % 2))) & 0xFFFFu) << 16);
}

// max |x| over a 16-byte vector (0 for none).
template <int kElem>
MORI_DEVICE float AbsMaxVec(const plat::vec16_t& x) {
  uint32_t in[4];
  __builtin_memcpy(in, &x, 16);
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 16 / kElem; ++i) m = fmaxf(m, fabsf(ElemOf<kElem>(in, i)));
  return m;
}

// The wire words of a 16-byte vector times inv (1 for the direct cast: exact), by E4m3Word.
template <int kElem>
MORI_DEVICE void CastWords(const plat::vec16_t& x, float inv, uint32_t (&out)[16 / kElem / 4]) {
  uint32_t in[4];
  __builtin_memcpy(in, &x, 16);
#pragma unroll
  for (int w = 0; w < 16 / kElem / 4; ++w)
    out[w] = CanonNanBytes(E4m3Word(ElemOf<kElem>(in, 4 * w) * inv, ElemOf<kElem>(in, 4 * w + 1) * inv,
                                    ElemOf<kElem>(in, 4 * w + 2) * inv, ElemOf<kElem>(in, 4 * w + 3) * inv));
}

// The float32 value of a scale word: float32 bits, or (kScaleBytes 1) the UE8M0 byte's 2^(byte - 127).
template <int kScaleBytes>
MORI_DEVICE float ScaleOfWord(uint32_t word) { return __uint_as_float(kScaleBytes == 1 ? word << 23 : word); }

// One 16-byte vector of a row on the wire: its e4m3 words and (Fp8Block) its block's scale word.
template <int kWords>
struct WireVec {
  uint32_t w[kWords];
  uint32_t scale;
};

// acc[e] += the decoded value of element e (kBlock: times sf, rounded once: no fused multiply-add).
// Both decodes are exact; they differ only in a NaN's payload, and a NaN sum stays NaN either way.
template <bool kBlock, int kWords>
MORI_DEVICE void AddDecoded(const WireVec<kWords>& c, float sf, float (&acc)[4 * kWords]) {
#if defined(__HIP__)
#pragma clang fp contract(off)  // (hipcc contracts by default; __fmul_rn alone does not stop it there)
#endif
#if defined(MORI_HAS_FP8_CVT)
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    float v[4];
    plat::f32x4_from_e4m3x4(c.w[w], v);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[4 * w + e] += kBlock ? __fmul_rn(v[e], sf) : v[e];
  }
#else
#pragma unroll
  for (int e = 0; e < 4 * kWords; ++e) {
    const float v = FromE4m3((c.w[e / 4] >> (8 * (e % 4))) & 0xFFu);
    acc[e] += kBlock ? __fmul_rn(v, sf) : v;
  }
#endif
}

}  // namespace mori::ep
