// EP combine kernel body (see ep_intranode.hpp for the protocol).
#pragma once
#include "ep/ep_common.hpp"

namespace mori::ep {

// The most weights (floats) block 0 stages alone before publishing (see EpCombineBody).
constexpr int kFastPublishMaxWeights = 8192;

// Block-wide copy of n floats: 16-byte vectors when both pointers allow, kBatch loads in flight per
// thread (a plain loop would wait out one load latency per element).
MORI_DEVICE void CopyBlock(float* dst, const float* src, int n) {
  constexpr int kBatch = 8;
  int vecDone = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int nv = n / 4;
    const vec16_t* s = reinterpret_cast<const vec16_t*>(src);
    vec16_t* d = reinterpret_cast<vec16_t*>(dst);
    for (int i0 = threadIdx.x; i0 < nv; i0 += blockDim.x * kBatch) {
      vec16_t v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (i0 + u * int(blockDim.x) < nv) v[u] = plat::load_stream(s + i0 + u * blockDim.x);
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (i0 + u * int(blockDim.x) < nv) d[i0 + u * blockDim.x] = v[u];
    }
    vecDone = nv * 4;
  }
  for (int i = vecDone + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

template <EpCfg kCfg, typename T>
MORI_DEVICE void EpCombineBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(EpSummable(kCfg), "combine sums: the dtype must be Bf16 or Fp32");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  static_assert(sizeof(T) == EpElemBytes(kCfg), "element type does not match the Cfg dtype");
  constexpr int kW = kCfg.waveSize, kK = kCfg.numExpertPerToken, kWs = kCfg.worldSize;
  constexpr int kVecs = EpTokenBytes(kCfg) / 16, kRecv = EpMaxRecv(kCfg), kUnroll = kCfg.vecUnroll;
  constexpr int kPerVec = 16 / sizeof(T);
  const int rank = args.rank, lane = plat::lane_id(), n = args.numTokens;
  uint64_t* sync = SyncWords(args);
  const uint64_t epoch = sync[kCombEpoch];
  const int total = *At<int>(args, rank, args.off_total_recv);
  // Staging serves the peers, summing serves this rank: a rank with n = 0 (empty, possibly null
  // y_w) must still stage the weights its peers will pull. Every rank passes weights, or none does.
  const bool stageWeights = kCfg.useWeights && args.inpWeights != nullptr;
  const bool sumWeights = stageWeights && args.outWeights != nullptr;
  if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStCombStart);

  // The first pull item's forward-map entry (written by dispatch, a previous kernel): loaded before
  // the barrier so its latency overlaps the wait (the pull loop then loads one item ahead).
  const int* tokOff = At<int>(args, rank, args.off_tok_off);
  constexpr int kChunkVecs = ep::kChunkVecs<kCfg>, kChunks = ep::kChunks<kCfg>;
  // Both loops below give wave w of the grid items w, w + numWaves, ...
  const int firstItem = blockIdx.x * kCfg.warpPerBlock + plat::wave_id();
  const int numWaves = kCfg.blockNum * kCfg.warpPerBlock;
  const int firstFlat = firstItem < n * kChunks && lane < kK ? tokOff[(firstItem / kChunks) * kK + lane] : -1;

  // 1. Stage the expert output (and weights) into this rank's symmetric staging region.
  vec16_t* stage = At<vec16_t>(args, rank, args.off_comb_stage);
  float* stageW = At<float>(args, rank, args.off_comb_stage_wts);
  const int tid = blockIdx.x * blockDim.x + threadIdx.x, nthreads = gridDim.x * blockDim.x;
  const bool stageToks = args.inpTok != stage;
  // This rank's own rows are summed straight from the input, unless the input lies in the arena,
  // where a peer's next dispatch may write as soon as this rank has published (see the barrier).
  const bool ownFromInput = stageToks && !args.inpInArena;
  int rows = total;
  if (stageToks && total > args.inpRows) {  // never read past the caller's tensor
    rows = args.inpRows;
    if (tid == 0) {
      volatile uint64_t* err = args.errWord;
      err[1] = (uint64_t(rank) << 16);
      err[2] = (uint64_t(total) << 32) | uint32_t(args.inpRows);
      plat::fence_system();
      err[0] = kErrShortInput;
    }
  }
  const bool copyWeights = stageWeights && args.inpWeights != stageW;
  const uint64_t target = epoch + 1;
  auto publish = [&] {  // this rank's staging is complete: tell every peer
    if (threadIdx.x < kWs) plat::store_release_system(XdbFlags(args, threadIdx.x, kXdbCombine) + rank, target);
  };
  // Zero-copy with few weights to stage: block 0 stages them and tells the peers at once, with no
  // grid-wide arrival count (one SM copies 32 KB in well under the ~1.5 us that count costs).
  const bool fastPublish = !stageToks && (!copyWeights || rows * kK <= kFastPublishMaxWeights);
  if (!fastPublish) {
    if (copyWeights)
      for (int i = tid; i < rows * kK; i += nthreads) stageW[i] = args.inpWeights[i];
    if (stageToks) {  // the rows peers will pull (and this rank's own unless ownFromInput)
      const vec16_t* in = static_cast<const vec16_t*>(args.inpTok);
      const int* recvSrc = At<int>(args, rank, args.off_recv_to_src);
      for (int item = firstItem; item < rows * kChunks; item += numWaves) {
        const int r = item / kChunks, v0 = (item % kChunks) * kChunkVecs + lane;
        if (ownFromInput && recvSrc[r] / kCfg.maxTokPerRank == rank) continue;
        vec16_t buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (v0 + u * kW < kVecs) buf[u] = plat::load_stream(in + size_t(r) * kVecs + v0 + u * kW);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (v0 + u * kW < kVecs) stage[size_t(r) * kVecs + v0 + u * kW] = buf[u];
      }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStCombStaged);
    if (LastBlockArrives(args, kStageBlocks)) publish();
  } else if (blockIdx.x == 0) {
    if (copyWeights) CopyBlock(stageW, args.inpWeights, rows * kK);
    if (threadIdx.x == 0) StampAt(args, kStCombStaged);
    if constexpr (plat::kFenceEveryWave) plat::fence_system();
    __syncthreads();  // the release stores below are cumulative over the block's weight stores
    publish();
  }

  // 2. Cross-device barrier: every block waits for every peer's staging.
  if (threadIdx.x < kWs)
    WaitAtLeast(args, XdbFlags(args, rank, kXdbCombine) + threadIdx.x, target, kWaitCombineReady, threadIdx.x);
  __syncthreads();  // the acquire loads above, then the barrier, order every thread's peer loads
  if constexpr (plat::kFenceEveryWave) plat::fence_system();
  if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStCombPeersReady);
  // Every thread of this block has read the epoch; the last block to count itself advances it.
  // Issued now, its result is first needed at the kernel's end, so the round trip overlaps the pull.
  unsigned readersBefore = 0;
  if (threadIdx.x == 0) readersBefore = plat::atomic_add_release_device(reinterpret_cast<unsigned*>(sync + kCombReaders), 1u);

  // 3. Pull and sum. A work item is one chunk of one token (kW * kUnroll vectors: one load per
  // unroll slot per lane), so each item costs a single peer round trip and a small batch spreads
  // over many waves instead of walking one row serially. Lane < k holds one forward-map entry.
  int nextFlat = firstFlat;
  for (int item = firstItem; item < n * kChunks; item += numWaves) {
    const int t = item / kChunks, chunk = item % kChunks, flat = nextFlat;
    // the next item's entry, loaded now: its latency overlaps this item's peer round trip
    const int next = item + numWaves;
    nextFlat = next < n * kChunks && lane < kK ? tokOff[(next / kChunks) * kK + lane] : -1;
    const uint64_t srcs = plat::ballot(flat >= 0);
    const vec16_t* srcRow[kWs];
    int numSrc = 0;
#pragma unroll
    for (int i = 0; i < kWs; ++i) srcRow[i] = nullptr;
    for (uint64_t m = srcs; m; m &= m - 1) {
      const int f = plat::shfl(flat, plat::lowest_bit(m));
      const int pe = f / kRecv, slot = f % kRecv;
      const bool fromInput = ownFromInput && pe == rank;
      if (fromInput && slot >= args.inpRows) continue;  // short input (reported above): never read past it
      srcRow[numSrc] = fromInput ? static_cast<const vec16_t*>(args.inpTok) + size_t(slot) * kVecs
                                 : At<vec16_t>(args, pe, args.off_comb_stage) + size_t(slot) * kVecs;
      ++numSrc;
    }
    vec16_t* out = reinterpret_cast<vec16_t*>(static_cast<char*>(args.outTok) + size_t(t) * EpTokenBytes(kCfg));
    const int v0 = chunk * kChunkVecs + lane;
    {
      float acc[kUnroll][kPerVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) acc[u][e] = 0.f;
#pragma unroll
      for (int s = 0; s < kWs; ++s) {
        if (s >= numSrc) break;
        vec16_t buf[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (v0 + u * kW < kVecs) buf[u] = plat::load_peer(srcRow[s] + v0 + u * kW);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const T* el = reinterpret_cast<const T*>(&buf[u]);
#pragma unroll
          for (int e = 0; e < kPerVec; ++e) acc[u][e] += to_f32(el[e]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + u * kW >= kVecs) break;
        vec16_t o;
        T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) oe[e] = from_f32<T>(acc[u][e]);
        out[v0 + u * kW] = o;
      }
    }
    if (sumWeights && chunk == 0) {
      float w = 0.f;
      for (uint64_t m = srcs; m; m &= m - 1) {
        const int f = plat::shfl(flat, plat::lowest_bit(m));  // every rank's weights are all staged
        if (lane < kK)
          w += plat::load_peer_f32(At<float>(args, f / kRecv, args.off_comb_stage_wts) + size_t(f % kRecv) * kK + lane);
      }
      if (lane < kK) args.outWeights[t * kK + lane] = w;
    }
  }

  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) StampAt(args, kStCombPulled);
    if (readersBefore == gridDim.x - 1) {
      sync[kCombReaders] = 0;
      sync[kCombEpoch] = target;
    }
    plat::atomic_max_device(At<uint64_t>(args, rank, args.off_stamps) + kStCombEnd, plat::now_ns());
  }
}

}  // namespace mori::ep
