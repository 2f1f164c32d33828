// Peer push rates of the ways to move the EP op's bytes over NVLink, both GPUs pushing at once
// (the combine's pattern), 58.5 MB each way by default:
//   st128  SM threads: 16-byte streaming loads of local rows, 16-byte stores into the peer's buffer
//          (the dispatch's and the combine's senders), at several grids x waves per block;
//   task   (and t_cs, t_wt, t_noal, t_rsys, t_fenc) SM threads pushing whole 28 KB tasks, the
//          combine sender's unit, with each store cache operator, and with the sender's per-task
//          release (t_fenc), on 66 and 132 blocks of 16 waves;
//   tma    one thread per block drives the bulk-copy (TMA) unit: a row is loaded into shared
//          memory (cp.async.bulk + mbarrier) and stored to the peer (cp.async.bulk.global.shared),
//          kStages rows in flight per block, at several grids;
//   ce     the copy engines (cudaMemcpyPeerAsync), for the ceiling.
// Two figures each, medians of 21 after 3 warm-ups: bytes one GPU pushes over the slower GPU's
// event time (launch included), and over the slower GPU's in-kernel span (the first block's start
// to the last block's end, after a system fence: the stores have landed). The destination is
// poisoned before each mode and checked against the source after it (every byte, random data).
// Results: docs/performance.md ("Bulk-copy (TMA) senders", "Store cache operators").
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/probe_push tools/probes/probe_push_modes.cu && /tmp/probe_push [MB]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));       \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

constexpr int kRowBytes = 7168 * 2;  // one bf16 token row
constexpr int kStages = 6;

__device__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// span[0] = the first block's start, span[1] = the last block's end (this GPU's global timer)
__device__ void stamp_start(unsigned long long* span) {
  if (threadIdx.x == 0) atomicMin(span, (unsigned long long)now_ns());
}
__device__ void stamp_end(unsigned long long* span) {
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(span + 1, (unsigned long long)now_ns());
}

__global__ void st128(const uint4* __restrict__ src, uint4* dst, size_t n, unsigned long long* span) {
  stamp_start(span);
  for (size_t v = blockIdx.x * size_t(blockDim.x) + threadIdx.x; v < n; v += size_t(gridDim.x) * blockDim.x)
    dst[v] = __ldcs(src + v);
  __threadfence_system();  // the stores have landed: the span covers the acknowledgements
  stamp_end(span);
}

// Store variants: does the cache operator of an SM's 16-byte peer store change the
// link's rate? Each block pushes whole 28 KB tasks (two rows, contiguous at the destination, the
// combine sender's unit), its threads spread flat over the task's vectors, four in flight each.
// kFenced: plain stores, then the sender's per-task release (a barrier, thread 0's system fence and
// a release store of a flag, here a local word), so the rate with and without that wait can be
// compared.
enum StoreOp { kPlain, kCs, kWt, kNoAlloc, kRelaxedSys, kFenced };
template <StoreOp kOp>
__device__ void store16(uint4* p, uint4 v) {
  if constexpr (kOp == kPlain || kOp == kFenced) *p = v;
  if constexpr (kOp == kCs) __stcs(p, v);
  if constexpr (kOp == kWt) __stwt(p, v);
  if constexpr (kOp == kNoAlloc)
    asm volatile("st.global.L1::no_allocate.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w) : "memory");
  if constexpr (kOp == kRelaxedSys)
    asm volatile("st.relaxed.sys.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w) : "memory");
}
template <StoreOp kOp>
__global__ void tasks(const uint4* __restrict__ src, uint4* dst, size_t n, unsigned long long* span) {
  constexpr int kTaskVecs = 2 * kRowBytes / 16, kPer = 4;
  stamp_start(span);
  const size_t numTasks = n / kTaskVecs;
  for (size_t q = blockIdx.x; q < numTasks; q += gridDim.x) {
    uint4 buf[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int v = u * blockDim.x + threadIdx.x;
      if (v < kTaskVecs) buf[u] = __ldcs(src + q * kTaskVecs + v);
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int v = u * blockDim.x + threadIdx.x;
      if (v < kTaskVecs) store16<kOp>(dst + q * kTaskVecs + v, buf[u]);
    }
    if constexpr (kOp == kFenced) {
      __syncthreads();
      if (threadIdx.x == 0)  // the fence waits for this block's peer stores; span[2] is a spare word
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(span + 2), "l"(uint64_t(q)) : "memory");
    }
  }
  __threadfence_system();
  stamp_end(span);
}

__device__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__global__ void tma(const char* __restrict__ src, char* dst, int rows, unsigned long long* span) {
  extern __shared__ __align__(128) char stage[];
  __shared__ __align__(8) uint64_t bar[kStages];
  stamp_start(span);
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kStages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto load = [&](int i) {  // the block's i-th row into stage i % kStages
    const int r = blockIdx.x + i * gridDim.x, s = i % kStages;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar[s])), "r"(kRowBytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(stage + s * kRowBytes)),
                 "l"(src + size_t(r) * kRowBytes), "r"(kRowBytes), "r"(smem_u32(&bar[s]))
                 : "memory");
  };
  const int mine = rows > int(blockIdx.x) ? (rows - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;
  for (int i = 0; i < kStages && i < mine; ++i) load(i);
  for (int i = 0; i < mine; ++i) {
    const int s = i % kStages, r = blockIdx.x + i * gridDim.x;
    uint32_t ok = 0;
    while (!ok)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ok)
                   : "r"(smem_u32(&bar[s])), "r"((i / kStages) & 1)
                   : "memory");
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + size_t(r) * kRowBytes),
                 "r"(smem_u32(stage + s * kRowBytes)), "r"(kRowBytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // refill the previous stage once its store has read it (one store, this one, may stay pending)
    if (i >= 1 && i - 1 + kStages < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(i - 1 + kStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __threadfence_system();
  atomicMax(span + 1, (unsigned long long)now_ns());
}

struct Gpu {
  char *src, *dst;
  unsigned long long* span;
  cudaStream_t st;
  cudaEvent_t e0, e1;
};

struct Times {
  double event_ms, span_ms;  // medians: the slower GPU's event time, the slower GPU's in-kernel span
};
template <typename Launch>
Times time_both(Gpu* g, Launch launch) {
  std::vector<double> ms, sp;
  for (int rep = 0; rep < 24; ++rep) {
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      CK(cudaDeviceSynchronize());
    }
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      const unsigned long long init[2] = {~0ull, 0ull};
      CK(cudaMemcpyAsync(g[d].span, init, sizeof init, cudaMemcpyHostToDevice, g[d].st));
      CK(cudaStreamSynchronize(g[d].st));
      CK(cudaEventRecord(g[d].e0, g[d].st));
      launch(d);
      CK(cudaGetLastError());
      CK(cudaEventRecord(g[d].e1, g[d].st));
    }
    float worst = 0;
    double worstSpan = 0;
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      CK(cudaEventSynchronize(g[d].e1));
      float t;
      CK(cudaEventElapsedTime(&t, g[d].e0, g[d].e1));
      worst = std::max(worst, t);
      unsigned long long h[2];
      CK(cudaMemcpy(h, g[d].span, sizeof h, cudaMemcpyDeviceToHost));
      worstSpan = std::max(worstSpan, h[1] > h[0] ? (h[1] - h[0]) * 1e-6 : 0.0);
    }
    if (rep >= 3) ms.push_back(worst), sp.push_back(worstSpan);
  }
  std::sort(ms.begin(), ms.end());
  std::sort(sp.begin(), sp.end());
  return {ms[ms.size() / 2], sp[sp.size() / 2]};
}

bool check(Gpu* g, size_t bytes) {
  std::vector<char> a(bytes), b(bytes);
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaMemcpy(a.data(), g[d].src, bytes, cudaMemcpyDeviceToHost));
    CK(cudaSetDevice(1 - d));
    CK(cudaMemcpy(b.data(), g[1 - d].dst, bytes, cudaMemcpyDeviceToHost));
    if (memcmp(a.data(), b.data(), bytes) != 0) return false;
  }
  for (int d = 0; d < 2; ++d) {  // poison again
    CK(cudaSetDevice(d));
    CK(cudaMemset(g[d].dst, 0xA5, bytes));
  }
  return true;
}

int main(int argc, char** argv) {
  const double mb = argc > 1 ? atof(argv[1]) : 58.5;
  const int rows = int(mb * 1e6 / kRowBytes);
  const size_t bytes = size_t(rows) * kRowBytes;
  Gpu g[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&g[d].src, bytes));
    CK(cudaMalloc(&g[d].dst, bytes));
    CK(cudaMalloc(&g[d].span, 3 * sizeof(unsigned long long)));  // [2]: the fenced tasks' flag
    CK(cudaMemset(g[d].dst, 0xA5, bytes));
    std::vector<uint32_t> h(bytes / 4);
    uint32_t x = 12345u + 777u * d;
    for (auto& v : h) x = x * 1664525u + 1013904223u, v = x;
    CK(cudaMemcpy(g[d].src, h.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaStreamCreateWithFlags(&g[d].st, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g[d].e0));
    CK(cudaEventCreate(&g[d].e1));
    CK(cudaFuncSetAttribute(tma, cudaFuncAttributeMaxDynamicSharedMemorySize, kStages * kRowBytes));
  }
  printf("rows %d of %d B = %.1f MB each way, both GPUs pushing\n", rows, kRowBytes, bytes / 1e6);
  auto report = [&](const char* mode, int grid, int warps, Times t, size_t moved = 0) {
    if (!moved) moved = bytes;
    const bool ok = check(g, moved);
    printf("%-6s grid %4d x %2d warps  event %8.1f us %6.1f GB/s   in-kernel %8.1f us %6.1f GB/s  %s\n", mode, grid,
           warps, t.event_ms * 1e3, moved / (t.event_ms * 1e-3) / 1e9, t.span_ms * 1e3,
           t.span_ms > 0 ? moved / (t.span_ms * 1e-3) / 1e9 : 0.0, ok ? "ok" : "WRONG");
    if (!ok) exit(3);
  };
  const int geos[][2] = {{58, 16}, {132, 16}, {132, 8}, {132, 6}, {132, 4}, {132, 2}, {264, 8}};
  for (auto& gw : geos) {
    const Times t = time_both(g, [&](int d) {
      st128<<<gw[0], 32 * gw[1], 0, g[d].st>>>(reinterpret_cast<uint4*>(g[d].src),
                                               reinterpret_cast<uint4*>(g[1 - d].dst), bytes / 16, g[d].span);
    });
    report("st128", gw[0], gw[1], t);
  }
  // whole-task pushes (n rounded down to whole tasks: the check covers what was sent)
  const size_t taskBytes = bytes / (2 * kRowBytes) * (2 * kRowBytes);
  auto task_modes = [&](auto op, const char* name) {
    for (int grid : {66, 132}) {
      const Times t = time_both(g, [&](int d) {
        tasks<decltype(op)::value><<<grid, 512, 0, g[d].st>>>(reinterpret_cast<uint4*>(g[d].src),
                                                                reinterpret_cast<uint4*>(g[1 - d].dst), taskBytes / 16,
                                                                g[d].span);
      });
      report(name, grid, 16, t, taskBytes);
    }
  };
  task_modes(std::integral_constant<StoreOp, kPlain>{}, "task");
  task_modes(std::integral_constant<StoreOp, kCs>{}, "t_cs");
  task_modes(std::integral_constant<StoreOp, kWt>{}, "t_wt");
  task_modes(std::integral_constant<StoreOp, kNoAlloc>{}, "t_noal");
  task_modes(std::integral_constant<StoreOp, kRelaxedSys>{}, "t_rsys");
  task_modes(std::integral_constant<StoreOp, kFenced>{}, "t_fenc");
  task_modes(std::integral_constant<StoreOp, kPlain>{}, "task");
  for (int grid : {8, 16, 32, 66, 132}) {
    const Times t = time_both(g, [&](int d) {
      tma<<<grid, 32, kStages * kRowBytes, g[d].st>>>(g[d].src, g[1 - d].dst, rows, g[d].span);
    });
    report("tma", grid, 1, t);
  }
  const Times t = time_both(g, [&](int d) { CK(cudaMemcpyPeerAsync(g[1 - d].dst, 1 - d, g[d].src, d, bytes, g[d].st)); });
  report("ce", 0, 0, t);
  return 0;
}
