// The dispatch round's routing (see ep_intranode.hpp for the protocol): the tokens a block owns,
// the round's shared routing, the slot claim (or a replay's route), the expert tally, and what
// travels with each row (ids, weights, reverse maps, scales). The body is in ep_dispatch.hpp.
#pragma once
#include "ep/ep_common.hpp"
#include "ep/ep_quant.hpp"

namespace mori::ep {

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

// Expert id i of the input. An int64 id outside [0, numExperts) reads as -1 (compared before
// narrowing, so no large id aliases a valid one); int32 ids are read as they are.
template <EpCfg kCfg>
MORI_DEVICE int LoadExpertId(const EpArgs& args, int i) {
  if constexpr (kCfg.ids64) {
    const int64_t v = reinterpret_cast<const int64_t*>(args.inpIndices)[i];
    return v >= 0 && v < EpNumExperts(kCfg) ? int(v) : -1;
  } else {
    return args.inpIndices[i];
  }
}

// expertCounts: this block's valid slots per expert (all ranks' experts), in shared memory; zeroed at
// the kernel's start, added to by the claim, flushed to the destinations' counters by FlushExpertTally.
template <EpCfg kCfg>
MORI_DEVICE int* ExpertTally() {
  __shared__ int tally[EpNumExperts(kCfg)];
  return tally;
}

// The block's tally added to each expert's rank's parity counter (expert_adds), one system-scope
// atomic per expert the block's slots named. Before the block's done count (its fence orders them).
template <EpCfg kCfg>
MORI_DEVICE void FlushExpertTally(const EpArgs& args, int parity) {
  constexpr int kE = kCfg.numExpertPerRank;
  __syncthreads();
  int* tally = ExpertTally<kCfg>();
  for (int e = threadIdx.x; e < EpNumExperts(kCfg); e += blockDim.x)
    if (tally[e] > 0) plat::atomic_add_system(At<int>(args, e / kE, args.off_expert_adds) + parity * kE + e % kE, tally[e]);
}

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
    bool dropped = false;  // a valid id of a masked rank's expert: dropped as an invalid one, and counted
    if (active) {
      expert = LoadExpertId<kCfg>(args, t * kK + j);
      if (withWeights) weight = args.inpWeights[t * kK + j];
      if (expert >= 0 && expert < EpNumExperts(kCfg)) pe = expert / kCfg.numExpertPerRank;
      if (pe >= 0 && Masked(args, pe)) pe = -1, dropped = true;
    }
    const uint64_t drops = plat::ballot(dropped);
    if (lane == 0 && drops) plat::atomic_add_device(MaskedPairs(args) + parity, unsigned(plat::popcount(drops)));
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
      if constexpr (kCfg.expertCounts)
        if (pe >= 0) plat::atomic_add_shared(ExpertTally<kCfg>() + expert, 1);  // every valid slot, duplicates too
    }
  }
  __syncthreads();  // the round's routing is visible to all the block's waves
}

// A replay's phase 1 (routingReplay, args.replay): the round's routing is the latest dispatch's
// forward map, and the weights the new ones; nothing is claimed, no id is read.
template <EpCfg kCfg>
MORI_DEVICE void LoadRoute(const EpArgs& args, int r0, int num, DispatchRound<kCfg>& round) {
  constexpr int kK = kCfg.numExpertPerToken;
  const bool withWeights = kCfg.useWeights && args.inpWeights != nullptr;
  const int* tokOff = At<int>(args, args.rank, args.off_tok_off);
  for (int i = threadIdx.x; i < num * kK; i += blockDim.x) {
    const int t = OwnedToken<kCfg>(r0 + i / kK), j = i % kK;
    round.flat[i] = tokOff[t * kK + j];
    if (withWeights) round.weight[i] = args.inpWeights[t * kK + j];
  }
  __syncthreads();  // the round's routing is visible to all the block's waves
}

// Calls fn(pe, slot) for each destination the claim gave the round's token li, with the whole wave.
template <EpCfg kCfg, typename Fn>
MORI_DEVICE void ForEachDest(const DispatchRound<kCfg>& round, int li, Fn&& fn) {
  constexpr int kK = kCfg.numExpertPerToken, kRecv = EpMaxRecv(kCfg);
  const int lane = plat::lane_id();
  const int flat = lane < kK ? round.flat[li * kK + lane] : -1;
  for (uint64_t m = plat::ballot(flat >= 0); m; m &= m - 1) {
    const int f = plat::shfl(flat, plat::lowest_bit(m));
    fn(f / kRecv, f % kRecv);
  }
}

// What travels with a row to (pe, slot), by the wave: the token's ids and weights (lanes < kK) and
// both reverse-map entries (lane 0): where the row came from, and where token t landed this epoch
// (combine's sender on pe walks this rank's tokens in order).
template <EpCfg kCfg>
MORI_DEVICE void StoreTokenMeta(const EpArgs& args, const DispatchRound<kCfg>& round, int li, int t, int pe, int slot,
                                uint64_t target, bool withWeights) {
  constexpr int kK = kCfg.numExpertPerToken;
  const int lane = plat::lane_id();
  if (lane >= kK) return;
  if (!(kCfg.routingReplay && args.replay)) {  // (a replay: the ids are there from the dispatch it replays)
    if constexpr (kCfg.ids64)  // the source's own id, out-of-range values included
      At<int64_t>(args, pe, args.off_out_idx)[slot * kK + lane] = reinterpret_cast<const int64_t*>(args.inpIndices)[t * kK + lane];
    else
      At<int>(args, pe, args.off_out_idx)[slot * kK + lane] = round.expert[li * kK + lane];
  }
  if (withWeights) At<float>(args, pe, args.off_out_wts)[slot * kK + lane] = round.weight[li * kK + lane];
  if (lane == 0) {
    At<int>(args, pe, args.off_recv_to_src)[slot] = args.rank * kCfg.maxTokPerRank + t;
    At<uint64_t>(args, pe, args.off_src_to_recv)[args.rank * kCfg.maxTokPerRank + t] = (target << 32) | uint32_t(slot);
  }
}

// The scale words of kCfg.scaleTypeSize bytes (the scales are moved, never read as numbers).
template <int kBytes> struct ScaleWordOf;
template <> struct ScaleWordOf<1> { using type = uint8_t; };
template <> struct ScaleWordOf<2> { using type = uint16_t; };
template <> struct ScaleWordOf<4> { using type = uint32_t; };
template <> struct ScaleWordOf<8> { using type = uint64_t; };

// Token t's per-token scales to (pe, slot), by the wave (nothing without scales).
template <EpCfg kCfg>
MORI_DEVICE void StoreTokenScales(const EpArgs& args, int t, int pe, int slot) {
  if constexpr (kCfg.scaleDim > 0 && !kCfg.quantFp8Block128) {  // (quantized: the copy stores its own)
    using S = typename ScaleWordOf<kCfg.scaleTypeSize>::type;
    const S* src = static_cast<const S*>(args.inpScales) + size_t(t) * kCfg.scaleDim;
    S* dst = At<S>(args, pe, args.off_out_scales) + size_t(slot) * kCfg.scaleDim;
    for (int i = plat::lane_id(); i < kCfg.scaleDim; i += kCfg.waveSize) dst[i] = src[i];
  }
}

}  // namespace mori::ep
