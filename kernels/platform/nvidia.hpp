// Platform layer for NVIDIA (nvcc, CUDA). Only what differs between vendors lives here; kernel
// bodies use mori::plat:: and never a vendor intrinsic directly. Chosen by the renderer on the host
// (the choice is in the source text, hence in the cache key).
#pragma once
#include <cstdint>

#define MORI_DEVICE __device__ __forceinline__

namespace mori::plat {

constexpr int kWaveSize = 32;
using vec16_t = uint4;  // 16-byte vector: one global load/store instruction

MORI_DEVICE int lane_id() { return threadIdx.x & (kWaveSize - 1); }
MORI_DEVICE int wave_id() { return threadIdx.x / kWaveSize; }
MORI_DEVICE uint64_t ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
MORI_DEVICE bool wave_any(bool p) { return __any_sync(0xffffffffu, p); }
MORI_DEVICE int shfl(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }

// Index of the lowest set bit of a non-zero mask.
MORI_DEVICE int lowest_bit(uint64_t m) { return __ffsll(static_cast<long long>(m)) - 1; }

MORI_DEVICE int popcount(uint64_t m) { return __popcll(m); }

// bf16 bits of (lo, hi) in one word, lo in the low half, in one instruction (sm_80+): round to
// nearest even, a NaN becomes the canonical NaN 0x7fff.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define MORI_HAS_BF16_CVT 1
MORI_DEVICE uint32_t bf16x2_from_f32(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // (the first source: the high half)
  return r;
}
#endif

// e4m3fn bytes of (a, b, c, d), a in the low byte, in two instructions where the arch has them
// (sm_89+): round to nearest even, finite values past 448 saturate to 448, NaN stays NaN. The two
// 16-bit halves never leave the asm block: with one 16-bit ("=h") output per pair, nvcc 13.0 put
// NaN bytes into some elements of the combine wire's cast on sm_90a once the summer held two or
// more vectors per lane (tests/test_gpu_ep_fp8_model_shape.py). Callers fall back to a software
// conversion without MORI_HAS_FP8_CVT.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MORI_HAS_FP8_CVT 1
MORI_DEVICE uint32_t e4m3x4_from_f32(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"  // (the second operand goes to the low byte)
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}"
      : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}
// The float32 values of the four e4m3fn bytes of w (byte 0 first), exactly: each pair through the
// packed conversion to f16 (every e4m3fn value is an f16 value), then to float32; a NaN byte
// (0x7f, 0xff) becomes a NaN.
MORI_DEVICE void f32x4_from_e4m3x4(uint32_t w, float (&f)[4]) {
  asm("{\n\t.reg .b16 q0, q1, h0, h1, h2, h3;\n\t.reg .b32 p0, p1;\n\t"
      "mov.b32 {q0, q1}, %4;\n\t"
      "cvt.rn.f16x2.e4m3x2 p0, q0;\n\t"
      "cvt.rn.f16x2.e4m3x2 p1, q1;\n\t"
      "mov.b32 {h0, h1}, p0;\n\t"
      "mov.b32 {h2, h3}, p1;\n\t"
      "cvt.f32.f16 %0, h0;\n\tcvt.f32.f16 %1, h1;\n\tcvt.f32.f16 %2, h2;\n\tcvt.f32.f16 %3, h3;\n\t}"
      : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3]) : "r"(w));
}
#endif

// acq_rel, not __threadfence_system()'s fence.sc: every use here is a release/acquire pairing,
// and the SC fence is the slower one on Hopper.
// Whether each wave must fence its own peer stores before a block barrier publishes them (and
// fence again after the barrier that follows an acquire). Not on NVIDIA: bar.sync orders the
// block's accesses and a fence by one thread is cumulative over them (the cooperative-groups
// grid-sync pattern).
constexpr bool kFenceEveryWave = false;
MORI_DEVICE void fence_system() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
MORI_DEVICE void fence_device() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

MORI_DEVICE int atomic_add_system(int* p, int v) { return atomicAdd_system(p, v); }
MORI_DEVICE unsigned atomic_add_device(unsigned* p, unsigned v) { return atomicAdd(p, v); }
MORI_DEVICE int atomic_add_shared(int* p, int v) { return atomicAdd_block(p, v); }
// Fire and forget (`red`: no value comes back, so the thread never waits for it). atomicMax on
// a generic pointer compiles to an ATOM whose shared-window predicate the thread waits for: two
// such phase stamps held each combine block's first wave ~1.2 us before its last output stores.
MORI_DEVICE void max_relaxed_device(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

MORI_DEVICE uint64_t load_acquire_system(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MORI_DEVICE void store_release_system(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Relaxed: ordered only by a fence before it.
MORI_DEVICE void add_relaxed_system(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MORI_DEVICE int load_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// Nanoseconds of a global clock, for bounded spin-waits.
MORI_DEVICE uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Non-temporal 16-byte global accesses for streaming payloads.
MORI_DEVICE vec16_t load_stream(const vec16_t* p) { return __ldcs(p); }
MORI_DEVICE void store_stream(vec16_t* p, vec16_t v) { __stcs(p, v); }
// Loads of data a peer wrote during this kernel, after an acquire that observed the peer's release:
// the non-coherent path with no L1 allocation (DeepEP's ld_nc_global), so no stale line can be hit
// (nothing before the acquire read these addresses) and the load is not forced to system-scope
// strength the way ld.volatile is.
MORI_DEVICE vec16_t load_peer(const vec16_t* p) {
  vec16_t v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
MORI_DEVICE float load_peer_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
// Words a peer polls with no flag (the combine's rows): a 16-byte vector stored or loaded as four
// 32-bit relaxed system-scope accesses. PTX performs a vector access as its elements' scalar
// accesses, and morally strong accesses of one aligned word are single-copy atomic, so a reader
// sees each word either before or after the writer's store, never a mix.
MORI_DEVICE void store_words_relaxed(vec16_t* p, vec16_t v) {
  asm volatile("st.relaxed.sys.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w) : "memory");
}
MORI_DEVICE vec16_t load_words_relaxed(const vec16_t* p) {
  vec16_t v;
  asm volatile("ld.relaxed.sys.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
// One 32-bit word of a peer's row (the fp8 combine wire's): as load_peer, one word.
MORI_DEVICE uint32_t load_peer_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// One word a peer polls with no flag (the fp8 combine wire's words), as store/load_words_relaxed.
MORI_DEVICE void store_word_relaxed(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
MORI_DEVICE uint32_t load_word_relaxed(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MORI_DEVICE void store_relaxed_system(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MORI_DEVICE uint64_t load_relaxed_system(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// A hint: bring the line holding p into this GPU's L2 (no register, nothing to wait for), so that
// a load issued later hits L2 instead of HBM.
MORI_DEVICE void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Bulk copies (the TMA unit, sm_90 and later): one thread moves whole rows global -> shared ->
// global, to a peer's memory too, while the block's waves do other work. (The host pass of nvcc
// sees them too; it compiles no device code.)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
constexpr bool kHasBulkCopy = true;
MORI_DEVICE uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// A one-arrival mbarrier, used only by the thread that initialised it (bulk_load arrives on it).
MORI_DEVICE void bulk_barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Load `bytes` from global src into shared smem; bar's current phase completes once they landed.
MORI_DEVICE void bulk_load(void* smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
// Wait until bar's phase of parity `phase` has completed (its bulk load landed).
MORI_DEVICE void bulk_wait_load(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(phase) : "memory");
}
// Store `bytes` from shared smem to global dst (a peer's memory too), in the open bulk group.
MORI_DEVICE void bulk_store(void* dst, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(smem)),
               "r"(bytes) : "memory");
}
// Close the bulk group of the stores issued since the last one.
MORI_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Every committed group but the `Pending` newest has read its shared source (which may be reloaded).
template <int Pending>
MORI_DEVICE void bulk_wait_smem_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(Pending) : "memory"); }
// Every committed group has been performed and, through the proxy fence, is ordered before this
// thread's later accesses (a system fence and a count that follow then publish the rows).
MORI_DEVICE void bulk_wait_stores() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// This thread's earlier accesses (and what a block barrier ordered before them) precede its later
// bulk copies, which the async proxy performs.
MORI_DEVICE void bulk_after_generic() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
#endif

}  // namespace mori::plat

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#include "platform/no_bulk_copy.hpp"
#endif
