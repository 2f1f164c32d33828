// y = a*x + y, grid-stride, one vector of kCfg.vecElems elements per thread per step; a scalar
// tail handles n not divisible by the vector width. Math in fp32.
#pragma once
#include "common/types.hpp"
#include "example/axpy_generated.hpp"

namespace mori::example {

template <int kBytes> struct VecOf;
template <> struct VecOf<4> { using type = uint32_t; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<16> { using type = uint4; };

template <AxpyCfg kCfg, typename T>
MORI_DEVICE void AxpyBody(const AxpyArgs& args) {
  static_assert(AxpyIsValid(kCfg), "invalid AxpyCfg");
  static_assert(sizeof(T) == AxpyElemBytes(kCfg), "element type does not match the Cfg dtype");
  constexpr int kVec = kCfg.vecElems;
  using V = typename VecOf<AxpyVecBytes(kCfg)>::type;
  const T* x = static_cast<const T*>(args.x);
  T* y = static_cast<T*>(args.y);
  const float a = args.a;
  const int64_t n = args.n;
  const int64_t nvec = n / kVec;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += stride) {
    V vx = reinterpret_cast<const V*>(x)[i];
    V vy = reinterpret_cast<V*>(y)[i];
    const T* ex = reinterpret_cast<const T*>(&vx);
    T* ey = reinterpret_cast<T*>(&vy);
#pragma unroll
    for (int j = 0; j < kVec; ++j) ey[j] = from_f32<T>(a * to_f32(ex[j]) + to_f32(ey[j]));
    reinterpret_cast<V*>(y)[i] = vy;
  }
  for (int64_t i = nvec * kVec + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = from_f32<T>(a * to_f32(x[i]) + to_f32(y[i]));
}

}  // namespace mori::example
