// Vendor-neutral element types. bf16 is carried as raw bits so no vendor bf16 header leaks into
// kernel bodies; conversions are the IEEE bit tricks (round to nearest even), identical everywhere.
#pragma once
#include <cstdint>

namespace mori {

struct bf16_t { uint16_t bits; };
struct fp8_t { uint8_t bits; };    // e4m3, moved as bytes, never summed
struct fp4x2_t { uint8_t bits; };  // two e2m1 in one byte, moved as bytes, never summed

MORI_DEVICE float to_f32(float v) { return v; }
MORI_DEVICE float to_f32(bf16_t v) { return __uint_as_float(uint32_t(v.bits) << 16); }

template <typename T> MORI_DEVICE T from_f32(float v);
template <> MORI_DEVICE float from_f32<float>(float v) { return v; }
template <> MORI_DEVICE bf16_t from_f32<bf16_t>(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}

// The bf16 bits of (lo, hi) in one word, lo in the low half, rounded to nearest even: by the
// packed hardware conversion where the platform has one (plat::bf16x2_from_f32, one instruction
// for both, where the bit trick above takes about nine per value: a combine's output is issue
// bound on it), else by from_f32. The two differ only in a NaN's payload.
MORI_DEVICE uint32_t Bf16x2FromF32(float lo, float hi) {
#ifdef MORI_HAS_BF16_CVT
  return plat::bf16x2_from_f32(lo, hi);
#else
  return uint32_t(from_f32<bf16_t>(lo).bits) | uint32_t(from_f32<bf16_t>(hi).bits) << 16;
#endif
}

// Four 32-bit words of 16 / sizeof(T) floats as T (float: the bits; bf16: packed pairs).
template <typename T>
MORI_DEVICE void PackWords(const float* v, uint32_t (&w)[4]) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "a float or bf16 word");
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if constexpr (sizeof(T) == 4) w[i] = __float_as_uint(v[i]);
    else w[i] = Bf16x2FromF32(v[2 * i], v[2 * i + 1]);
}

}  // namespace mori
