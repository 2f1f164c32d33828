// EP dispatch kernel body (see ep_intranode.hpp for the protocol): the bulk-copy rows and the
// body; the round's routing is in ep_dispatch_route.hpp.
#pragma once
#include "ep/ep_dispatch_route.hpp"

namespace mori::ep {

// Rows through the bulk-copy unit (thread 0 of a block that owns at least kCfg.bulkMinTokens
// tokens): each owned row is loaded once into one of kStages shared stages and stored from there
// to each of its destinations, the loads running kStages - 1 rows ahead of the stores, while the
// block's waves store the metadata. A round's first rows are loaded before its claim (they need no
// slot), overlapping its round trip. Row i since the kernel's start uses stage i % kStages, whose
// barrier completes phase i / kStages. A block with fewer tokens copies through its waves: one
// thread's serial loads and stores measured slower there (docs/performance.md, "Bulk-copy dispatch").
template <EpCfg kCfg>
struct BulkRows {
  static constexpr int kStages = EpBulkStages(kCfg), kBytes = EpTokenBytes(kCfg), kK = kCfg.numExpertPerToken;
  int loads = 0, stores = 0;

  MORI_DEVICE static uint64_t* Loaded(int s) {
    __shared__ uint64_t loaded[kStages];
    return loaded + s;
  }
  MORI_DEVICE static char* Stage(int s) {
    extern __shared__ __align__(128) char stages[];  // EpBulkSmemBytes, the launch's dynamic shared memory
    return stages + s * kBytes;
  }
  MORI_DEVICE void Init() {
    for (int s = 0; s < kStages; ++s) plat::bulk_barrier_init(Loaded(s));
  }
  MORI_DEVICE void Load(const EpArgs& args, int t) {
    const int s = loads++ % kStages;
    plat::bulk_load(Stage(s), static_cast<const char*>(args.inpTok) + size_t(t) * kBytes, kBytes, Loaded(s));
  }
  // Before the claim of the round of owned tokens r0 .. r0 + num (the stages are free).
  MORI_DEVICE void Prefetch(const EpArgs& args, int r0, int num) {
    for (int i = 0; i < kStages && i < num; ++i) Load(args, OwnedToken<kCfg>(r0 + i));
  }
  // After the claim: each row to its destinations (a bulk group per row), then its stage refilled
  // once its stores have read it. Returns with every stage free again.
  MORI_DEVICE void Push(const EpArgs& args, int r0, int num, const DispatchRound<kCfg>& round) {
    constexpr int kRecv = EpMaxRecv(kCfg);
    plat::bulk_after_generic();  // the block's combine-done wait precedes the async proxy's stores
    for (int i = 0; i < num; ++i, ++stores) {
      const int s = stores % kStages;
      plat::bulk_wait_load(Loaded(s), uint32_t(stores / kStages & 1));
      for (int j = 0; j < kK; ++j) {
        const int f = round.flat[i * kK + j];
        if (f >= 0) plat::bulk_store(At<char>(args, f / kRecv, args.off_disp_out) + size_t(f % kRecv) * kBytes, Stage(s), kBytes);
      }
      plat::bulk_commit();
      if (i >= 1 && i - 1 + kStages < num) {  // row i - 1's stage, once read, takes row i - 1 + kStages
        plat::bulk_wait_smem_read<1>();
        Load(args, OwnedToken<kCfg>(r0 + i - 1 + kStages));
      }
    }
    plat::bulk_wait_smem_read<0>();
  }
};

template <EpCfg kCfg, typename T>
MORI_DEVICE void EpDispatchBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  static_assert(sizeof(T) == EpElemBytes(kCfg), "element type does not match the Cfg dtype");
  static_assert(kCfg.worldSize <= kMaxPeers, "worldSize exceeds the peer array");
  static_assert(kCfg.bulkMinTokens == 0 || plat::kHasBulkCopy, "bulkMinTokens needs a bulk-copy unit (NVIDIA sm_90 and later)");
  constexpr int kW = kCfg.waveSize, kWs = kCfg.worldSize;
  constexpr int kVecs = EpTokenBytes(kCfg) / 16, kUnroll = kCfg.vecUnroll;
  [[maybe_unused]] const int rank = args.rank, lane = plat::lane_id(), n = args.numTokens;
  uint64_t* sync = SyncWords(args);
  const uint64_t epoch = sync[kDispEpoch];
  const int parity = int(epoch & 1);
  const uint64_t target = epoch + 1;
  if constexpr (kCfg.phase != EpPhase::Recv) {  // the send half: every block
    if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStDispStart);

    constexpr int kChunkVecs = ep::kChunkVecs<kCfg>, kChunks = ep::kChunks<kCfg>;
    const int owned = BlockTokens<kCfg>(n), wave = plat::wave_id();
    const bool bulkBlock = kCfg.bulkMinTokens > 0 && owned >= kCfg.bulkMinTokens;  // block-uniform
    auto loadChunk = [&](int t, int chunk, vec16_t (&buf)[kUnroll]) {
      const int v0 = chunk * kChunkVecs + lane;
      const vec16_t* src = reinterpret_cast<const vec16_t*>(static_cast<const char*>(args.inpTok) +
                                                            size_t(t) * EpTokenBytes(kCfg));
  #pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * kW < kVecs) buf[u] = plat::load_stream(src + v0 + u * kW);
    };
    // quantFp8Block128: a chunk of a bf16 input row (twice the output's bytes) becomes its fp8
    // vectors and, per block, the scale word (kept by the block's lanes; every lane calls it).
    [[maybe_unused]] auto loadQuantChunk = [&](int t, int chunk, vec16_t (&buf)[kUnroll], uint32_t (&scale)[kUnroll]) {
      const int v0 = chunk * kChunkVecs + lane;
      const vec16_t* src = reinterpret_cast<const vec16_t*>(static_cast<const char*>(args.inpTok) +
                                                            size_t(t) * EpTokenBytes(kCfg) * 2);
  #pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        vec16_t lo{}, hi{};
        if (v0 + u * kW < kVecs) {
          lo = plat::load_stream(src + 2 * (v0 + u * kW));
          hi = plat::load_stream(src + 2 * (v0 + u * kW) + 1);
        }
        const float sf = BlockScale<kCfg.scaleTypeSize>(BlockMax(AbsMax16(lo, hi)), scale[u]);
        buf[u] = QuantizeVec(lo, hi, 1.0f / sf);
      }
    };
    // Before the first store into a peer's arena: the peer has finished its last combine, which may
    // still read rows there. Threads of the last wave wait (normally one load) while the first ones
    // claim; the claim's closing barrier orders the wait before every copy.
    if (threadIdx.x >= blockDim.x - kWs && !Masked(args, threadIdx.x - (blockDim.x - kWs))) {
      const int pe = threadIdx.x - (blockDim.x - kWs);
      WaitAtLeast(args, XdbFlags(args, rank, kXdbCombine) + pe, CombEpoch(args) * kDoneUnit, kWaitCombineDone, pe);
    }
    if constexpr (kCfg.expertCounts)  // (the claim's first barrier orders this before any add)
      for (int e = threadIdx.x; e < EpNumExperts(kCfg); e += blockDim.x) ExpertTally<kCfg>()[e] = 0;
    __shared__ DispatchRound<kCfg> round;
    const bool withWeights = kCfg.useWeights && args.inpWeights != nullptr;
    // (`if constexpr` around its calls: a wave-only binary never instantiates a zero-stage BulkRows)
    [[maybe_unused]] BulkRows<kCfg> bulk;
    if constexpr (kCfg.bulkMinTokens > 0)
      if (bulkBlock && threadIdx.x == 0) bulk.Init();
    for (int r0 = 0; r0 < owned; r0 += DispatchRound<kCfg>::kTok) {
      // Work items of the round: the chunks of its tokens, over the block's waves.
      const int num = owned - r0 < DispatchRound<kCfg>::kTok ? owned - r0 : DispatchRound<kCfg>::kTok, numItems = num * kChunks;
      vec16_t buf[kUnroll];
      [[maybe_unused]] uint32_t scale[kUnroll];  // (quantFp8Block128: each vector's block scale word)
      if (bulkBlock) {
        if constexpr (kCfg.bulkMinTokens > 0)
          if (threadIdx.x == 0) bulk.Prefetch(args, r0, num);
      } else if (wave < numItems) {  // overlaps the claim
        if constexpr (kCfg.quantFp8Block128)
          loadQuantChunk(OwnedToken<kCfg>(r0 + wave / kChunks), wave % kChunks, buf, scale);
        else
          loadChunk(OwnedToken<kCfg>(r0 + wave / kChunks), wave % kChunks, buf);
      }

      if (kCfg.routingReplay && args.replay)
        LoadRoute<kCfg>(args, r0, num, round);
      else
        ClaimSlots<kCfg>(args, parity, r0, num, round);
      if (r0 == 0 && blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStDispClaimed);

      if (bulkBlock) {
        if constexpr (kCfg.bulkMinTokens > 0)
          if (threadIdx.x == 0) bulk.Push(args, r0, num, round);
        constexpr int kMetaWaves = kCfg.warpPerBlock > 1 ? kCfg.warpPerBlock - 1 : 1;  // wave 0 holds thread 0
        for (int li = wave - (kCfg.warpPerBlock - kMetaWaves); li >= 0 && li < num; li += kMetaWaves) {
          const int t = OwnedToken<kCfg>(r0 + li);
          ForEachDest<kCfg>(round, li, [&](int pe, int slot) {
            StoreTokenMeta<kCfg>(args, round, li, t, pe, slot, target, withWeights);
            StoreTokenScales<kCfg>(args, t, pe, slot);
          });
        }
        continue;
      }
      for (int item = wave; item < numItems; item += kCfg.warpPerBlock) {
        const int li = item / kChunks, t = OwnedToken<kCfg>(r0 + li), chunk = item % kChunks;
        const int v0 = chunk * kChunkVecs + lane;
        if (item != wave) {
          if constexpr (kCfg.quantFp8Block128)
            loadQuantChunk(t, chunk, buf, scale);
          else
            loadChunk(t, chunk, buf);
        }
        ForEachDest<kCfg>(round, li, [&](int pe, int slot) {
          vec16_t* dst = At<vec16_t>(args, pe, args.off_disp_out) + size_t(slot) * kVecs;
  #pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            if (v0 + u * kW < kVecs) dst[v0 + u * kW] = buf[u];
          if constexpr (kCfg.quantFp8Block128) {  // a block's first lane stores its scale
            using S = typename ScaleWordOf<kCfg.scaleTypeSize>::type;
            S* dstScale = At<S>(args, pe, args.off_out_scales) + size_t(slot) * kCfg.scaleDim;
  #pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (v0 + u * kW < kVecs && (v0 + u * kW) % kQuantLanes == 0) dstScale[(v0 + u * kW) / kQuantLanes] = S(scale[u]);
          }
          if (chunk == 0) {  // with the first chunk
            StoreTokenMeta<kCfg>(args, round, li, t, pe, slot, target, withWeights);
            StoreTokenScales<kCfg>(args, t, pe, slot);
          }
        });
      }
    }

    if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStDispLoopDone);
    if (bulkBlock && threadIdx.x == 0) plat::bulk_wait_stores();  // before the fence that publishes the rows
    if constexpr (kCfg.expertCounts) FlushExpertTally<kCfg>(args, parity);
    // Every block tells every rank (this one too) that its rows are there: once the block's stores
    // are visible system-wide, one relaxed add per rank (block 0 first publishes this rank's token
    // count), its share of kDoneUnit (BlockShare). No block waits for another before its news leaves.
    if (threadIdx.x == 0 && blockIdx.x == 0)  // (n bounds each peer's combine sends to this rank)
      for (int pe = 0; pe < kWs; ++pe)
        if (!Masked(args, pe)) XdbFlags(args, pe, kXdbNumTok)[rank] = uint64_t(n);
    FenceBlockSystem();
    if (threadIdx.x == 0) {
      const uint64_t share = BlockShare();
      for (int pe = 0; pe < kWs; ++pe)
        if (!Masked(args, pe)) plat::add_relaxed_system(XdbFlags(args, pe, kXdbDispatch) + rank, share);
      StampMax(args, kStDispCounted, plat::now_ns());
    }
  }
  if constexpr (kCfg.phase == EpPhase::Send) return;  // (the send kernel ends without waiting)
  // The receive half, block 0 (the whole leg's, or the receive kernel's): wait until every
  // rank's blocks are done (this rank's too: then every block here has read the epoch and made
  // its claims; a receive kernel's own rank's are done by stream order), then publish the count
  // and advance the epoch. One wait covers the local blocks and the peers at once.
  if (blockIdx.x != 0) return;
  if (threadIdx.x < kWs && !Masked(args, threadIdx.x))
    WaitAtLeast(args, XdbFlags(args, rank, kXdbDispatch) + threadIdx.x, target * kDoneUnit, kWaitDispatchDone,
                threadIdx.x);
  __syncthreads();
  // (a replay claimed nothing: the dispatch's counts and total_recv stand)
  const bool replay = kCfg.routingReplay && args.replay;
  if constexpr (kCfg.expertCounts) {  // every rank's adds for this epoch are in: publish, reset (as recv_num)
    constexpr int kE = kCfg.numExpertPerRank;
    int* adds = At<int>(args, rank, args.off_expert_adds) + parity * kE;
    int* counts = At<int>(args, rank, args.off_expert_counts);
    for (int e = threadIdx.x; e < kE && !replay; e += blockDim.x) {
      counts[e] = plat::load_volatile(adds + e);
      adds[e] = 0;
      if constexpr (kCfg.expertCapacity > 0) At<unsigned>(args, rank, args.off_exp_cursor)[e] = 0;  // (the layout's)
    }
  }
  if (threadIdx.x == 0) {
    StampAt(args, kStDispPeersDone);
    int* recvNum = At<int>(args, rank, args.off_recv_num);
    if (!replay) *At<int>(args, rank, args.off_total_recv) = plat::load_volatile(recvNum + parity);
    unsigned* drops = MaskedPairs(args);  // (this rank's blocks are done: their adds are in)
    if (!replay) drops[2] = unsigned(plat::load_volatile(reinterpret_cast<const int*>(drops + parity)));
    drops[parity] = 0;
    // A peer next claims on this counter two epochs on: only after it has counted this rank's
    // next dispatch done, which follows this reset.
    recvNum[parity] = 0;
    sync[kDispEpoch] = target;
    StampAt(args, kStDispEnd);
  }
}

}  // namespace mori::ep
