// EP combine kernel body (see ep_intranode.hpp for the protocol).
#pragma once
#include "ep/ep_common.hpp"

namespace mori::ep {

// Tokens per combine range: the unit of a sender's task and of one range-ready flag. It depends on
// nothing else, so ranks that picked different combine geometries (by their own token counts)
// agree on every rank's ranges. Small, so that the last ranges to arrive are summed quickly.
constexpr int kRangeTok = 2;
MORI_DEVICE int NumRanges(int n) { return (n + kRangeTok - 1) / kRangeTok; }

// How this rank's blocks split the work (a local choice: peers only see flags). With at most one
// send task per block, every block sends its task and then sums (phased). With more, sends and
// sums overlap: blocks [0, senders) send and the rest sum (pipelined).
struct CombRoles {
  int senders, firstSum, sumStride;
  bool sends, sums;
};
MORI_DEVICE CombRoles CombRolesFor(int tasks) {
  const int grid = int(gridDim.x), b = int(blockIdx.x);
  if (grid == 1 || tasks <= grid) return {grid, b, grid, true, true};
  const int senders = grid / 2;
  return {senders, b - senders, grid - senders, b < senders, b >= senders};
}

// Sender: push the rows this rank's experts produced back to their tokens' home ranks, range by
// range in token order (every rank walks the ranges in the same order, so the home rank's summers
// can start on the first ranges while the last ones are still in flight). A task is one range of
// one peer's tokens; its block raises that range's flag on the peer when its stores are done.
template <EpCfg kCfg>
MORI_DEVICE void SendRanges(const EpArgs& args, uint64_t target, bool withWeights, int maxRanges, int senders) {
  constexpr int kW = kCfg.waveSize, kK = kCfg.numExpertPerToken, kWs = kCfg.worldSize, kM = kCfg.maxTokPerRank;
  constexpr int kVecs = EpTokenBytes(kCfg) / 16, kUnroll = kCfg.vecUnroll, kDests = kWs > 1 ? kWs - 1 : 1;
  constexpr int kChunkVecs = ep::kChunkVecs<kCfg>, kChunks = ep::kChunks<kCfg>;
  if (kWs == 1) return;  // nothing to send: a rank's own rows are summed straight from its input
  const int rank = args.rank, lane = plat::lane_id(), wave = plat::wave_id();
  const uint64_t* numTok = XdbFlags(args, rank, kXdbNumTok);
  const uint64_t* srcToRecv = At<uint64_t>(args, rank, args.off_src_to_recv);
  const uint32_t dispTag = uint32_t(SyncWords(args)[kDispEpoch]);
  const vec16_t* in = static_cast<const vec16_t*>(args.inpTok);
  // Lane i < kRangeTok: this rank's row of token t0 + i of task q's peer; -1 if that token was not
  // routed here this epoch (or lies beyond a short input, which the host is told about) or the
  // task is empty. Loaded one task ahead, so the latency overlaps the current task's copies.
  auto taskSlot = [&](int q) {
    const int b = q / kDests, d = (rank + 1 + q % kDests) % kWs, t = b * kRangeTok + lane;
    if (lane >= kRangeTok || q >= maxRanges * kDests || t >= kM) return -1;
    const uint64_t e = srcToRecv[d * kM + t];  // issued without waiting for numTok: both are loads
    return t < int(numTok[d]) && uint32_t(e >> 32) == dispTag && int(uint32_t(e)) < args.inpRows ? int(uint32_t(e)) : -1;
  };
  int nextSlot = taskSlot(blockIdx.x);
  // Before the first store: comb_recv on a peer is free once its previous combine is done.
  if (threadIdx.x < kWs && threadIdx.x != rank)
    WaitAtLeast(args, XdbFlags(args, rank, kXdbCombine) + threadIdx.x, target - 1, kWaitCombineDone, threadIdx.x);
  __syncthreads();  // the acquire above, then the barrier, order every thread's stores below
  if constexpr (plat::kFenceEveryWave) plat::fence_system();
  for (int q = blockIdx.x; q < maxRanges * kDests; q += senders) {
    const int b = q / kDests, d = (rank + 1 + q % kDests) % kWs, nd = int(numTok[d]);
    const int slot = nextSlot;
    nextSlot = taskSlot(q + senders);
    if (b >= NumRanges(nd)) continue;  // block-uniform
    const int t0 = b * kRangeTok, cnt = min(kRangeTok, nd - t0);
    vec16_t* dst = At<vec16_t>(args, d, args.off_comb_recv) + size_t(rank * kM + t0) * kVecs;
    float* dstW = At<float>(args, d, args.off_comb_recv_wts) + size_t(rank * kM + t0) * kK;
    for (int item = wave; item < cnt * kChunks; item += kCfg.warpPerBlock) {
      const int i = item / kChunks, chunk = item % kChunks, s = plat::shfl(slot, i);
      if (s < 0) continue;
      const int v0 = chunk * kChunkVecs + lane;
      vec16_t buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * kW < kVecs) buf[u] = plat::load_stream(in + size_t(s) * kVecs + v0 + u * kW);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * kW < kVecs) dst[size_t(i) * kVecs + v0 + u * kW] = buf[u];
      if (withWeights && chunk == 0 && lane < kK) dstW[i * kK + lane] = args.inpWeights[size_t(s) * kK + lane];
    }
    if constexpr (plat::kFenceEveryWave) plat::fence_system();
    __syncthreads();  // the release below is cumulative over the block's stores
    if (threadIdx.x == 0) plat::store_release_system(At<uint64_t>(args, d, args.off_comb_flags) + rank * kM + b, target);
  }
}

// Summer: ranges first, first + stride, ... of this rank's tokens. Each waits for every peer's flag
// of the range, then sums each token's rows in fp32: its own row straight from the input, a peer's
// from comb_recv (where that peer pushed it). One work item is one chunk of one token's row.
template <EpCfg kCfg, typename T>
MORI_DEVICE void SumRanges(const EpArgs& args, uint64_t target, bool sumWeights, int first, int stride) {
  constexpr int kW = kCfg.waveSize, kK = kCfg.numExpertPerToken, kWs = kCfg.worldSize, kM = kCfg.maxTokPerRank;
  constexpr int kVecs = EpTokenBytes(kCfg) / 16, kRecv = EpMaxRecv(kCfg), kUnroll = kCfg.vecUnroll;
  constexpr int kPerVec = 16 / sizeof(T), kChunkVecs = ep::kChunkVecs<kCfg>, kChunks = ep::kChunks<kCfg>;
  const int rank = args.rank, lane = plat::lane_id(), wave = plat::wave_id(), n = args.numTokens;
  const int* tokOff = At<int>(args, rank, args.off_tok_off);
  const uint64_t* flags = At<uint64_t>(args, rank, args.off_comb_flags);
  const vec16_t* in = static_cast<const vec16_t*>(args.inpTok);
  const vec16_t* recv = At<vec16_t>(args, rank, args.off_comb_recv);
  const float* recvW = At<float>(args, rank, args.off_comb_recv_wts);
  for (int b = first; b < NumRanges(n); b += stride) {
    const int t0 = b * kRangeTok, numItems = min(kRangeTok, n - t0) * kChunks;
    // the wave's first forward-map entry (written by dispatch, a previous kernel), loaded before the wait
    int nextFlat = wave < numItems && lane < kK ? tokOff[(t0 + wave / kChunks) * kK + lane] : -1;
    // One poller per peer and block (a poller per wave measured slower: the polls load the memory
    // system the senders use).
    if (threadIdx.x < kWs && threadIdx.x != rank)
      WaitAtLeast(args, flags + threadIdx.x * kM + b, target, kWaitCombineRange, threadIdx.x);
    __syncthreads();  // the acquire loads above, then the barrier, order every thread's loads below
    if constexpr (plat::kFenceEveryWave) plat::fence_system();
    if (b == first && first == 0 && threadIdx.x == 0) StampAt(args, kStCombFirstRange);
    for (int item = wave; item < numItems; item += kCfg.warpPerBlock) {
      const int t = t0 + item / kChunks, chunk = item % kChunks, flat = nextFlat;
      const int next = item + kCfg.warpPerBlock;
      nextFlat = next < numItems && lane < kK ? tokOff[(t0 + next / kChunks) * kK + lane] : -1;
      const uint64_t srcs = plat::ballot(flat >= 0);
      const vec16_t* srcRow[kWs];
      const float* srcW[kWs];  // this lane's weight (lane < k) of each source
      int numSrc = 0;
#pragma unroll
      for (int i = 0; i < kWs; ++i) srcRow[i] = nullptr, srcW[i] = nullptr;
      for (uint64_t m = srcs; m; m &= m - 1) {
        const int f = plat::shfl(flat, plat::lowest_bit(m)), pe = f / kRecv, slot = f % kRecv;
        if (pe == rank && slot >= args.inpRows) continue;  // short input (reported): never read past it
        srcRow[numSrc] = pe == rank ? in + size_t(slot) * kVecs : recv + size_t(pe * kM + t) * kVecs;
        srcW[numSrc++] = (pe == rank ? args.inpWeights + size_t(slot) * kK : recvW + size_t(pe * kM + t) * kK) + lane;
      }
      // A token's weights (first chunk, lane < k): every source's load issued with the rows' loads
      // below, not after them, so this item costs one memory latency, not two.
      const bool withW = sumWeights && chunk == 0 && lane < kK;
      float wv[kWs];
#pragma unroll
      for (int s = 0; s < kWs; ++s) wv[s] = withW && s < numSrc ? plat::load_peer_f32(srcW[s]) : 0.f;
      vec16_t* out = reinterpret_cast<vec16_t*>(static_cast<char*>(args.outTok) + size_t(t) * EpTokenBytes(kCfg));
      const int v0 = chunk * kChunkVecs + lane;
      float acc[kUnroll][kPerVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) acc[u][e] = 0.f;
      // two sources' loads in flight at once (a token has one source per rank it went to)
      for (int s = 0; s < numSrc; s += 2) {
        const int pair = s + 1 < numSrc ? 2 : 1;
        vec16_t buf[2][kUnroll];
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (p < pair && v0 + u * kW < kVecs) buf[p][u] = plat::load_peer(srcRow[s + p] + v0 + u * kW);
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const T* el = reinterpret_cast<const T*>(&buf[p][u]);
#pragma unroll
            for (int e = 0; e < kPerVec; ++e)
              if (p < pair) acc[u][e] += to_f32(el[e]);
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
      if (withW) {
        float w = 0.f;
#pragma unroll
        for (int s = 0; s < kWs; ++s) w += wv[s];
        args.outWeights[t * kK + lane] = w;
      }
    }
  }
}

template <EpCfg kCfg, typename T>
MORI_DEVICE void EpCombineBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(EpSummable(kCfg), "combine sums: the dtype must be Bf16 or Fp32");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  static_assert(sizeof(T) == EpElemBytes(kCfg), "element type does not match the Cfg dtype");
  static_assert(kRangeTok <= kCfg.waveSize, "a range's slots are held one per lane");
  constexpr int kWs = kCfg.worldSize;
  const int rank = args.rank;
  uint64_t* sync = SyncWords(args);
  const uint64_t target = sync[kCombEpoch] + 1;
  // Every rank passes weights, or none does: a rank with n = 0 (possibly null y_w) still sends its
  // rows' weights to their home ranks.
  const bool sendWeights = kCfg.useWeights && args.inpWeights != nullptr;
  const bool sumWeights = sendWeights && args.outWeights != nullptr;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    StampAt(args, kStCombStart);
    const int total = *At<int>(args, rank, args.off_total_recv);
    if (total > args.inpRows) {  // the rows beyond the caller's tensor are skipped; tell the host
      volatile uint64_t* err = args.errWord;
      err[1] = (uint64_t(rank) << 16);
      err[2] = (uint64_t(total) << 32) | uint32_t(args.inpRows);
      plat::fence_system();
      err[0] = kErrShortInput;
    }
  }

  const uint64_t* numTok = XdbFlags(args, rank, kXdbNumTok);  // each peer's dispatch n (its ranges)
  int maxRanges = 0;
#pragma unroll
  for (int d = 0; d < kWs; ++d)
    if (d != rank) maxRanges = max(maxRanges, NumRanges(int(numTok[d])));
  const CombRoles roles = CombRolesFor(maxRanges * (kWs - 1));
  if (roles.sends) {
    SendRanges<kCfg>(args, target, sendWeights, maxRanges, roles.senders);
    if (threadIdx.x == 0) plat::atomic_max_device(At<uint64_t>(args, rank, args.off_stamps) + kStCombSent, plat::now_ns());
  }
  if (roles.sums) {
    SumRanges<kCfg, T>(args, target, sumWeights, roles.firstSum, roles.sumStride);
    if (threadIdx.x == 0) plat::atomic_max_device(At<uint64_t>(args, rank, args.off_stamps) + kStCombSummed, plat::now_ns());
  }

  // End: once all of this rank's blocks are done reading its inputs and comb_recv, tell every peer
  // (combine-done). A peer's next dispatch (which writes this rank's arena, where the input or the
  // weights may lie) and next combine (which writes comb_recv) wait for it before their first
  // store here. The last block advances the epoch (every block read it at its start).
  if (!LastBlockArrives<false>(args, kCombBlocks)) return;
  if (threadIdx.x < kWs) plat::store_release_system(XdbFlags(args, threadIdx.x, kXdbCombine) + rank, target);
  if (threadIdx.x == 0) {
    sync[kCombEpoch] = target;
    StampAt(args, kStCombEnd);
  }
}

}  // namespace mori::ep
