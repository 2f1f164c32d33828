// Intranode EP dispatch/combine: the portable body (HIP dialect over mori::plat, wave 64 or 32).
//
// Memory model: every rank owns one symmetric arena; a peer's region is peerBase[pe] + off_<region>.
// Region offsets and the rank are runtime args (never Cfg fields), so one binary serves every rank.
//
// Dispatch: block b owns tokens b, b + blockNum, ... (so a small batch still spans the grid), in
// two phases split by a block barrier (per round of owned tokens; one round unless the grid is small).
// 1. Claim: one lane per (token, expert slot) maps ids to destination ranks and drops invalid ids
//    and ranks seen earlier in the token (dedup). One system-scope atomic per (block pass,
//    destination) claims all the block's rows there; the forward map (tok_off) records
//    pe*maxRecv + slot, and shared memory keeps it with the ids and weights for the copy.
// 2. Copy: a work item is one chunk of one owned token's row (waveSize*vecUnroll vectors), spread
//    over the block's waves, so a token is copied by several waves at once. Each vector is loaded
//    once and stored to every destination; a token's first chunk also carries its ids, weights and
//    reverse-map entry. A wave's first chunk is loaded before the claim, overlapping its round trip.
// The last block to finish publishes a done flag (device epoch + 1) on every peer, waits for every
// peer's flag, then publishes total_recv and advances the epoch on the device (graph replays stay
// correct).
//
// Combine (gather/pull): copy the expert output rows that peers will pull into the symmetric staging
// region, a cross-device barrier, then each rank pulls its tokens' rows from the peers' staging
// regions (its own straight from its input, unless that lies in the arena) and sums them in fp32,
// one wave per (token, chunk of the row). When the expert wrote into the staging region
// (zero-copy) and few weights remain to stage, block 0 stages them and tells the peers at once,
// with no grid-wide arrival count. Each block counts itself once it has read the combine epoch (a
// release atomic issued before the pull); the last one advances the epoch when it ends.
//
// Every spin-wait gives up after args.timeoutNs and records which wait, on which rank, for which
// peer, in the host-mapped error words; the host raises on the next call.
#pragma once
#include "common/types.hpp"
#include "ep/ep_generated.hpp"

namespace mori::ep {

using plat::vec16_t;

// Sync-word layout of the local `sync` region (u64 words).
enum SyncWord : int { kDispBlocks = 0, kStageBlocks = 1, kCombReaders = 2, kDispEpoch = 4, kCombEpoch = 5 };
// Which spin-wait timed out (high bits of the error detail word).
enum WaitId : uint64_t { kWaitDispatchDone = 1, kWaitCombineReady = 2 };
constexpr uint64_t kErrShortInput = 0x53484f52ull;  // "SHOR": combine input has fewer rows than received
// Cross-device flag rows of the `xdb` region.
enum XdbRow : int { kXdbDispatch = 0, kXdbCombine = 1 };
constexpr int kMaxPeers = sizeof(EpArgs::peerBase) / sizeof(uint64_t);
constexpr uint64_t kErrTimeout = 0x4d4f5249ull;  // "MORI"
// Combine: the most weights (floats) block 0 stages alone before publishing (see EpCombineBody).
constexpr int kFastPublishMaxWeights = 8192;

// Phase timestamps (the `stamps` region, globaltimer ns; one thread each, negligible cost).
// kStCombEnd is the latest block's exit (an atomic max), the others are one thread's store.
enum Stamp : int {
  kStDispStart = 0, kStDispLoopDone = 1, kStDispAllArrived = 2, kStDispPeersDone = 3, kStDispEnd = 4,
  kStDispClaimed = 5,
  kStCombStart = 8, kStCombStaged = 9, kStCombPeersReady = 10, kStCombPulled = 11, kStCombEnd = 12,
};

template <typename P>
MORI_DEVICE P* At(const EpArgs& a, int pe, uint64_t off) {
  return reinterpret_cast<P*>(a.peerBase[pe] + off);
}

MORI_DEVICE uint64_t* SyncWords(const EpArgs& a) { return At<uint64_t>(a, a.rank, a.off_sync); }
MORI_DEVICE void StampAt(const EpArgs& a, Stamp s) { At<uint64_t>(a, a.rank, a.off_stamps)[s] = plat::now_ns(); }
MORI_DEVICE uint64_t* XdbFlags(const EpArgs& a, int pe, int row) {
  return At<uint64_t>(a, pe, a.off_xdb) + row * kMaxPeers;
}

// Spin until *flag >= target; false (and an error recorded) after args.timeoutNs.
MORI_DEVICE bool WaitAtLeast(const EpArgs& a, const uint64_t* flag, uint64_t target, WaitId wait, int peer) {
  if (plat::load_acquire_system(flag) >= target) return true;
  const uint64_t t0 = plat::now_ns();
  while (plat::load_acquire_system(flag) < target) {
    if (plat::now_ns() - t0 > uint64_t(a.timeoutNs)) {
      volatile uint64_t* err = a.errWord;
      err[1] = (uint64_t(wait) << 48) | (uint64_t(peer) << 32) | (uint64_t(a.rank) << 16);
      err[2] = target;
      plat::fence_system();
      err[0] = kErrTimeout;
      return false;
    }
  }
  return true;
}

// True in exactly one block: the last one to arrive at counter `word` (which it resets).
// Where the platform allows (plat::kFenceEveryWave false), one fence per block, by thread 0 after
// the barrier; otherwise every wave fences its own stores first.
MORI_DEVICE bool LastBlockArrives(const EpArgs& a, int word) {
  __shared__ int last;
  if constexpr (plat::kFenceEveryWave) plat::fence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    plat::fence_system();  // the block's peer stores are visible system-wide before it is counted
    unsigned* ctr = reinterpret_cast<unsigned*>(SyncWords(a) + word);
    last = plat::atomic_add_device(ctr, 1u) == gridDim.x - 1;
    if (last) {
      *ctr = 0;
      // Acquire side, at device scope: every block fenced its peer stores at system scope before
      // counting itself, so its fence synchronizes with this one, and the release stores that
      // follow (system scope) carry those stores to the peers by causality.
      plat::fence_device();
    }
  }
  __syncthreads();
  return last;
}

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

// The work item of both kernels' copy loops: one chunk of a token's row, kW * vecUnroll 16-byte
// vectors (one load per unroll slot per lane), so a row is kChunks items.
template <EpCfg kCfg>
constexpr int kChunkVecs = kCfg.waveSize * kCfg.vecUnroll;
template <EpCfg kCfg>
constexpr int kChunks = (EpTokenBytes(kCfg) / 16 + kChunkVecs<kCfg> - 1) / kChunkVecs<kCfg>;

// The tokens a dispatch block owns: t = blockIdx.x + blockNum * i for i in [0, BlockTokens()).
template <EpCfg kCfg>
MORI_DEVICE int BlockTokens(int n) {
  return blockIdx.x < n ? (n - blockIdx.x + kCfg.blockNum - 1) / kCfg.blockNum : 0;
}
template <EpCfg kCfg>
MORI_DEVICE int OwnedToken(int i) { return blockIdx.x + kCfg.blockNum * i; }

// Dispatch works in rounds of up to kTok owned tokens, whose routing (forward-map entry, expert id,
// weight per slot) lives in shared memory between the claim and the copy. One round covers every
// owned token unless the grid is small (the cap keeps the arrays within 24 KB; a claim pass is at
// most 1024 lanes, 12 KB).
template <EpCfg kCfg>
struct DispatchRound {
  static constexpr int kK = kCfg.numExpertPerToken;
  static constexpr int kPass = kCfg.warpPerBlock * (kCfg.waveSize / kK);  // tokens per claim pass
  static constexpr int kOwnedPasses = ((kCfg.maxTokPerRank + kCfg.blockNum - 1) / kCfg.blockNum + kPass - 1) / kPass;
  static constexpr int kCapPasses = 24576 / (kPass * kK * 12) > 0 ? 24576 / (kPass * kK * 12) : 1;
  static constexpr int kTok = (kOwnedPasses < kCapPasses ? kOwnedPasses : kCapPasses) * kPass;
  int flat[kTok * kK];  // pe * maxRecv + slot, or -1 (invalid id, or a rank already taken by the token)
  int expert[kTok * kK];
  float weight[kTok * kK];
};

// Phase 1 of dispatch: claim a receive slot on every destination of the round's tokens (owned
// indices r0 .. r0 + num) and record pe*maxRecv + slot in the forward map (tok_off, for combine) and
// in the round's shared routing. A pass covers kW / kK tokens per wave; the block sums its waves'
// row counts in shared memory, so each destination's counter takes one system-scope atomic per
// block pass, all destinations at once (one round trip).
template <EpCfg kCfg>
MORI_DEVICE void ClaimSlots(const EpArgs& args, int parity, int r0, int num, DispatchRound<kCfg>& round) {
  constexpr int kW = kCfg.waveSize, kK = kCfg.numExpertPerToken, kWs = kCfg.worldSize;
  constexpr int kTokPerPass = kW / kK, kRecv = EpMaxRecv(kCfg), kWaves = kCfg.warpPerBlock;
  __shared__ int blockCount[kWs], blockBase[kWs];
  const int lane = plat::lane_id();
  const int sub = lane / kK, j = lane % kK, group = sub * kK;  // my token within the pass, my slot, its first lane
  const uint64_t below = (uint64_t(1) << lane) - 1;
  const bool withWeights = kCfg.useWeights && args.inpWeights != nullptr;
  int* tokOff = At<int>(args, args.rank, args.off_tok_off);
  // block-uniform trip count: every thread reaches every __syncthreads
  for (int l0 = 0; l0 < num; l0 += kWaves * kTokPerPass) {
    const int li = l0 + plat::wave_id() * kTokPerPass + sub, t = OwnedToken<kCfg>(r0 + li);
    const bool active = sub < kTokPerPass && li < num;
    int pe = -1, expert = -1;
    float weight = 0.f;
    if (active) {
      expert = args.inpIndices[t * kK + j];
      if (withWeights) weight = args.inpWeights[t * kK + j];
      if (expert >= 0 && expert < EpNumExperts(kCfg)) pe = expert / kCfg.numExpertPerRank;
    }
    bool first = pe >= 0;
#pragma unroll
    for (int l = 0; l < kK; ++l) {
      const int other = plat::shfl(pe, (group + l) % kW);
      if (l < j && other == pe) first = false;
    }
    // Per destination: which lanes claim a row there; lane d holds destination d's row count.
    uint64_t mine = 0;
    int count = 0;
#pragma unroll
    for (int d = 0; d < kWs; ++d) {
      const uint64_t m = plat::ballot(first && pe == d);
      if (pe == d) mine = m;
      if (lane == d) count = plat::popcount(m);
    }
    if (threadIdx.x < kWs) blockCount[threadIdx.x] = 0;
    __syncthreads();
    int offset = 0;  // this wave's rows before the block's other waves', per destination (lane d)
    if (lane < kWs && count > 0) offset = plat::atomic_add_shared(&blockCount[lane], count);
    __syncthreads();
    if (threadIdx.x < kWs && blockCount[threadIdx.x] > 0)
      blockBase[threadIdx.x] = plat::atomic_add_system(At<int>(args, threadIdx.x, args.off_recv_num) + parity,
                                                       blockCount[threadIdx.x]);
    __syncthreads();
    const int base = plat::shfl(lane < kWs && count > 0 ? blockBase[lane] + offset : 0, first ? pe : 0);
    if (active) {
      const int flat = first ? pe * kRecv + base + plat::popcount(mine & below) : -1;
      tokOff[t * kK + j] = flat;
      round.flat[li * kK + j] = flat;
      round.expert[li * kK + j] = expert;
      round.weight[li * kK + j] = weight;
    }
  }
  __syncthreads();  // the round's routing is visible to all the block's waves
}

template <EpCfg kCfg, typename T>
MORI_DEVICE void EpDispatchBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  static_assert(sizeof(T) == EpElemBytes(kCfg), "element type does not match the Cfg dtype");
  static_assert(kCfg.worldSize <= kMaxPeers, "worldSize exceeds the peer array");
  constexpr int kW = kCfg.waveSize, kK = kCfg.numExpertPerToken, kWs = kCfg.worldSize;
  constexpr int kVecs = EpTokenBytes(kCfg) / 16, kRecv = EpMaxRecv(kCfg), kUnroll = kCfg.vecUnroll;
  const int rank = args.rank, lane = plat::lane_id(), n = args.numTokens;
  uint64_t* sync = SyncWords(args);
  const uint64_t epoch = sync[kDispEpoch];
  const int parity = int(epoch & 1);
  if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStDispStart);

  constexpr int kChunkVecs = ep::kChunkVecs<kCfg>, kChunks = ep::kChunks<kCfg>;
  const int owned = BlockTokens<kCfg>(n), wave = plat::wave_id();
  auto loadChunk = [&](int t, int chunk, vec16_t (&buf)[kUnroll]) {
    const int v0 = chunk * kChunkVecs + lane;
    const vec16_t* src = reinterpret_cast<const vec16_t*>(static_cast<const char*>(args.inpTok) +
                                                          size_t(t) * EpTokenBytes(kCfg));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * kW < kVecs) buf[u] = plat::load_stream(src + v0 + u * kW);
  };
  __shared__ DispatchRound<kCfg> round;
  const bool withWeights = kCfg.useWeights && args.inpWeights != nullptr;
  for (int r0 = 0; r0 < owned; r0 += DispatchRound<kCfg>::kTok) {
    // Work items of the round: the chunks of its tokens, over the block's waves.
    const int numItems = (owned - r0 < DispatchRound<kCfg>::kTok ? owned - r0 : DispatchRound<kCfg>::kTok) * kChunks;
    vec16_t buf[kUnroll];
    if (wave < numItems) loadChunk(OwnedToken<kCfg>(r0 + wave / kChunks), wave % kChunks, buf);  // overlaps the claim

    ClaimSlots<kCfg>(args, parity, r0, numItems / kChunks, round);
    if (r0 == 0 && blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStDispClaimed);

    for (int item = wave; item < numItems; item += kCfg.warpPerBlock) {
      const int li = item / kChunks, t = OwnedToken<kCfg>(r0 + li), chunk = item % kChunks;
      const int v0 = chunk * kChunkVecs + lane;
      if (item != wave) loadChunk(t, chunk, buf);
      const int flat = lane < kK ? round.flat[li * kK + lane] : -1;
      for (uint64_t m = plat::ballot(flat >= 0); m; m &= m - 1) {
        const int f = plat::shfl(flat, plat::lowest_bit(m)), pe = f / kRecv, slot = f % kRecv;
        vec16_t* dst = At<vec16_t>(args, pe, args.off_disp_out) + size_t(slot) * kVecs;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (v0 + u * kW < kVecs) dst[v0 + u * kW] = buf[u];
        if (chunk == 0 && lane < kK) {  // the token's metadata travels with its first chunk
          At<int>(args, pe, args.off_out_idx)[slot * kK + lane] = round.expert[li * kK + lane];
          if (withWeights) At<float>(args, pe, args.off_out_wts)[slot * kK + lane] = round.weight[li * kK + lane];
          if (lane == 0) At<int>(args, pe, args.off_recv_to_src)[slot] = rank * kCfg.maxTokPerRank + t;
        }
      }
    }
  }

  if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStDispLoopDone);
  if (!LastBlockArrives(args, kDispBlocks)) return;
  // Last block: tell every peer this rank is done, wait for all of them, publish the count.
  // (The release stores are cumulative over what the barrier in LastBlockArrives ordered.)
  if (threadIdx.x == 0) StampAt(args, kStDispAllArrived);
  const uint64_t target = epoch + 1;
  if (threadIdx.x < kWs) plat::store_release_system(XdbFlags(args, threadIdx.x, kXdbDispatch) + rank, target);
  if (threadIdx.x < kWs) WaitAtLeast(args, XdbFlags(args, rank, kXdbDispatch) + threadIdx.x, target,
                                     kWaitDispatchDone, threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    StampAt(args, kStDispPeersDone);
    int* recvNum = At<int>(args, rank, args.off_recv_num);
    *At<int>(args, rank, args.off_total_recv) = plat::load_volatile(recvNum + parity);
    recvNum[parity] = 0;  // peers' next use of this counter is two epochs away (see header comment)
    sync[kDispEpoch] = target;
    StampAt(args, kStDispEnd);
  }
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
  const int firstItem = blockIdx.x * kCfg.warpPerBlock + plat::wave_id();
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
      for (int item = blockIdx.x * kCfg.warpPerBlock + plat::wave_id(); item < rows * kChunks;
           item += kCfg.blockNum * kCfg.warpPerBlock) {
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
  const int numWaves = kCfg.blockNum * kCfg.warpPerBlock;
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
