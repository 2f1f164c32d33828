// In-kernel fp8 block quantization of the dispatch payload (EpCfg quantFp8Block128): the numerics of
// mori_jit/ops/ep/quant.py, bit for bit. Per 128-element block of a bf16 row:
//   amax = max(max |x|, 1e-4); sf = amax * fl32(1/448) (UE8M0: 2^ceil(log2 sf), from its bits);
//   q = e4m3fn(x * (1 / sf)), rounded to nearest even as torch converts (Fp8E4m3FromF32).
// A block is 8 16-byte vectors of fp8 output (16 bf16 inputs each), held by 8 consecutive lanes.
// Needs only the platform header (mori::plat), so a host build can check the numerics against torch.
#pragma once
#include <cstdint>

namespace mori::ep {

constexpr int kQuantBlock = 128;
constexpr int kQuantLanes = kQuantBlock / 16;  // lanes (fp8 output vectors) per block
constexpr float kAmaxFloor = 1e-4f;
constexpr float kInv448 = 1.0f / 448.0f;  // rounded once, at compile time: fl32(1/448)

// torch's float -> float8_e4m3fn (c10 fp8e4m3fn_from_fp32_value): round to nearest even; NaN -> 0x7f,
// finite values from 480 up -> 0x7e (448), below 2^-6 through the denormal trick.
MORI_DEVICE uint8_t Fp8E4m3FromF32(float f) {
  constexpr uint32_t kFp8Max = 1087u << 20, kDenormMask = 141u << 23;
  uint32_t bits = __float_as_uint(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t r;
  if (bits >= kFp8Max) {
    r = bits > 0x7F800000u ? 0x7f : 0x7e;
  } else if (bits < (121u << 23)) {
    r = uint8_t(__float_as_uint(__uint_as_float(bits) + __uint_as_float(kDenormMask)) - kDenormMask);
  } else {
    const uint32_t mantOdd = (bits >> 20) & 1u;
    bits += (uint32_t(7 - 127) << 23) + 0x7FFFFu;
    bits += mantOdd;
    r = uint8_t(bits >> 20);
    if (r == 0x7f) r = 0x7e;
  }
  return uint8_t(r | (sign >> 24));
}

// The block scale of amax: its float32 value and the word stored (float32 bits, or the UE8M0 byte).
template <int kScaleBytes>
MORI_DEVICE float BlockScale(float amax, uint32_t& word) {
  const float sf = fmaxf(amax, kAmaxFloor) * kInv448;
  if constexpr (kScaleBytes == 1) {
    const uint32_t bits = __float_as_uint(sf);
    const uint32_t biased = ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u);  // ceil(log2 sf) + 127
    word = biased;
    return __uint_as_float(biased << 23);
  } else {
    word = __float_as_uint(sf);
    return sf;
  }
}

// The max of v over this lane's group of kLanes aligned lanes (a power of two up to the wave);
// every lane of the wave calls it.
template <int kLanes>
MORI_DEVICE float LanesMax(float v) {
  const int lane = plat::lane_id();
#pragma unroll
  for (int m = 1; m < kLanes; m <<= 1) v = fmaxf(v, __int_as_float(plat::shfl(__float_as_int(v), lane ^ m)));
  return v;
}
// The max of v over this lane's block (kQuantLanes aligned lanes); every lane of the wave calls it.
MORI_DEVICE float BlockMax(float v) { return LanesMax<kQuantLanes>(v); }

// The e4m3fn bytes of (a, b, c, d), a in the low byte: by the packed hardware conversion where the
// platform has one (plat::e4m3x4_from_f32), else by Fp8E4m3FromF32. Both round to nearest even and
// saturate finite values and infinities at +-448; a NaN stays a NaN.
MORI_DEVICE uint32_t E4m3Word(float a, float b, float c, float d) {
#ifdef MORI_HAS_FP8_CVT
  return plat::e4m3x4_from_f32(a, b, c, d);
#else
  return uint32_t(Fp8E4m3FromF32(a)) | uint32_t(Fp8E4m3FromF32(b)) << 8 | uint32_t(Fp8E4m3FromF32(c)) << 16 |
         uint32_t(Fp8E4m3FromF32(d)) << 24;
#endif
}

// 16 bf16 values (lo, hi: 8 each) -> 16 e4m3 bytes, times inv. The hardware conversion (where the
// platform has one) and Fp8E4m3FromF32 agree on every value a block cast produces: both round to
// nearest even, and |x * inv| is at most a few float32 ulps above 448 (sf is amax / 448 up to
// rounding, or above it for UE8M0), far below 464, where the two would first differ.
MORI_DEVICE plat::vec16_t QuantizeVec(const plat::vec16_t& lo, const plat::vec16_t& hi, float inv) {
  uint32_t in[8], out[4];
  __builtin_memcpy(in, &lo, 16);
  __builtin_memcpy(in + 4, &hi, 16);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    // word w holds elements 4w .. 4w+3: the low and high halves of input words 2w and 2w + 1
    const uint32_t a = in[2 * w], b = in[2 * w + 1];
    out[w] = E4m3Word(__uint_as_float(a << 16) * inv, __uint_as_float(a & 0xFFFF0000u) * inv,
                      __uint_as_float(b << 16) * inv, __uint_as_float(b & 0xFFFF0000u) * inv);
  }
  plat::vec16_t v;
  __builtin_memcpy(&v, out, 16);
  return v;
}

// The local max |x| of 16 bf16 values.
MORI_DEVICE float AbsMax16(const plat::vec16_t& lo, const plat::vec16_t& hi) {
  uint32_t in[8];
  __builtin_memcpy(in, &lo, 16);
  __builtin_memcpy(in + 4, &hi, 16);
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    m = fmaxf(m, __uint_as_float((in[i] & 0x7FFFu) << 16));
    m = fmaxf(m, __uint_as_float(in[i] & 0x7FFF0000u));
  }
  return m;
}

}  // namespace mori::ep
