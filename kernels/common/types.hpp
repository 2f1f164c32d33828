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

}  // namespace mori
