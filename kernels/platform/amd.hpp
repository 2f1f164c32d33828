// Platform layer for AMD (hipcc, ROCm). Only what differs between vendors lives here; kernel
// bodies use mori::plat:: and never a vendor intrinsic directly. Chosen by the renderer on the host
// (the choice is in the source text, hence in the cache key).
#pragma once
#include <hip/hip_runtime.h>
#include <cstdint>

#define MORI_DEVICE __device__ __forceinline__

namespace mori::plat {

// Kernel bodies static_assert that the Cfg's waveSize (chosen on the host by arch) matches this.
#ifdef __AMDGCN_WAVEFRONT_SIZE
constexpr int kWaveSize = __AMDGCN_WAVEFRONT_SIZE;
#else
constexpr int kWaveSize = 64;
#endif
// 16-byte vector (clang ext vector: .x..w like uint4, and valid for the nontemporal builtins)
typedef unsigned int vec16_t __attribute__((ext_vector_type(4)));

MORI_DEVICE int lane_id() { return __lane_id(); }
MORI_DEVICE int wave_id() { return threadIdx.x / kWaveSize; }
MORI_DEVICE uint64_t ballot(bool p) { return __ballot(p); }
MORI_DEVICE bool wave_any(bool p) { return __any(p); }
MORI_DEVICE int shfl(int v, int src) { return __shfl(v, src); }

// Index of the lowest set bit of a non-zero mask.
MORI_DEVICE int lowest_bit(uint64_t m) { return __ffsll(static_cast<unsigned long long>(m)) - 1; }

MORI_DEVICE int popcount(uint64_t m) { return __popcll(m); }

// Whether each wave must fence its own peer stores before a block barrier publishes them (and
// fence again after the barrier that follows an acquire). On AMD a fence waits only on the
// executing wave's outstanding memory operations, so every wave fences (as mscclpp's grid sync does).
constexpr bool kFenceEveryWave = true;
MORI_DEVICE void fence_system() { __threadfence_system(); }
MORI_DEVICE void fence_device() { __threadfence(); }

MORI_DEVICE int atomic_add_system(int* p, int v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MORI_DEVICE unsigned atomic_add_device(unsigned* p, unsigned v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
MORI_DEVICE int atomic_add_shared(int* p, int v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}
// Fire and forget: the result is unused, so the atomic is issued without return.
MORI_DEVICE void max_relaxed_device(uint64_t* p, uint64_t v) {
  (void)__hip_atomic_fetch_max(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

MORI_DEVICE uint64_t load_acquire_system(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
MORI_DEVICE void store_release_system(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Relaxed: ordered only by a fence before it.
MORI_DEVICE void add_relaxed_system(uint64_t* p, uint64_t v) {
  __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MORI_DEVICE int load_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// Nanoseconds from the constant 100 MHz wall clock (gfx9), for bounded spin-waits.
MORI_DEVICE uint64_t now_ns() { return wall_clock64() * 10ull; }

MORI_DEVICE vec16_t load_stream(const vec16_t* p) { return __builtin_nontemporal_load(p); }
MORI_DEVICE void store_stream(vec16_t* p, vec16_t v) { __builtin_nontemporal_store(v, p); }
// Loads of data a peer wrote during this kernel (after an acquire that observed the peer's
// release): nontemporal (glc/slc) so no stale line is hit.
MORI_DEVICE vec16_t load_peer(const vec16_t* p) { return __builtin_nontemporal_load(p); }
MORI_DEVICE float load_peer_f32(const float* p) { return __builtin_nontemporal_load(p); }
// Words a peer polls with no flag (the combine's rows): a 16-byte vector as four 32-bit relaxed
// system-scope atomics, so a reader sees each word either before or after the writer's store.
MORI_DEVICE void store_words_relaxed(vec16_t* p, vec16_t v) {
  unsigned* w = reinterpret_cast<unsigned*>(p);
  __hip_atomic_store(w + 0, v.x, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(w + 1, v.y, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(w + 2, v.z, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(w + 3, v.w, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MORI_DEVICE vec16_t load_words_relaxed(const vec16_t* p) {
  const unsigned* w = reinterpret_cast<const unsigned*>(p);
  vec16_t v;
  v.x = __hip_atomic_load(w + 0, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  v.y = __hip_atomic_load(w + 1, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  v.z = __hip_atomic_load(w + 2, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  v.w = __hip_atomic_load(w + 3, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  return v;
}
// One 32-bit word of a peer's row (the fp8 combine wire's): as load_peer, one word.
MORI_DEVICE uint32_t load_peer_u32(const uint32_t* p) { return __builtin_nontemporal_load(p); }
// One word a peer polls with no flag (the fp8 combine wire's words), as store/load_words_relaxed.
MORI_DEVICE void store_word_relaxed(uint32_t* p, uint32_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MORI_DEVICE uint32_t load_word_relaxed(const uint32_t* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MORI_DEVICE void store_relaxed_system(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
MORI_DEVICE uint64_t load_relaxed_system(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// A hint to bring p's line into L2 ahead of a load. gfx9 has no global prefetch instruction, and a
// load into a dead register would make the wave wait for it at its next s_waitcnt: nothing.
MORI_DEVICE void prefetch_l2(const void*) {}

}  // namespace mori::plat

#include "platform/no_bulk_copy.hpp"  // no bulk-copy unit
