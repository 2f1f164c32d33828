// EP expert-major layout kernel body (EpCfg expertCapacity > 0): launched after each dispatch (and
// each replay) on the same stream, so every received row is in this rank's arena. Local only: it
// reads the receive buffers and writes the layout regions, no peer memory, no wait.
//
// Dispatch: a wave per received row; each lane of a top-k slot naming a local expert e claims entry
// (e, c) with a device-scope atomic on e's cursor (zeroed by the dispatch's block 0), records the maps
// (receive row, source, slot) and the slot's weight, and the wave copies the row (and its scales) into
// every entry it claimed. Entries from the count on are padding (-1 maps, weight 0). More pairs than
// kCfg.expertCapacity are counted (expert_counts keeps the true count), never written, and reported
// in the error words (kErrCapacity). A replay keeps the maps: a wave per valid entry gathers the new
// row, scales and weight along them, so the entries stay where the dispatch put them. The claim
// also records each (row, slot)'s entry (exp_entry), the way back for the expert-major combine.
#pragma once
#include "ep/ep_common.hpp"

namespace mori::ep {

MORI_DEVICE constexpr uint64_t CapacityDetail(uint64_t expert, uint64_t rank) { return (expert << 32) | (rank << 16); }

template <EpCfg kCfg>
MORI_DEVICE int64_t ReceivedId(const EpArgs& a, int r, int j) {
  if constexpr (kCfg.ids64)
    return At<int64_t>(a, a.rank, a.off_out_idx)[r * kCfg.numExpertPerToken + j];
  else
    return At<int>(a, a.rank, a.off_out_idx)[r * kCfg.numExpertPerToken + j];
}

// Row r of the receive buffer (and its scales) into entry i of the layout, by the wave.
template <EpCfg kCfg>
MORI_DEVICE void CopyEntry(const EpArgs& a, int r, int i) {
  constexpr int kVecs = EpTokenBytes(kCfg) / 16, kW = kCfg.waveSize;
  constexpr int kScaleBytes = kCfg.scaleDim * kCfg.scaleTypeSize;
  const vec16_t* src = At<vec16_t>(a, a.rank, a.off_disp_out) + size_t(r) * kVecs;
  vec16_t* dst = At<vec16_t>(a, a.rank, a.off_exp_x) + size_t(i) * kVecs;
  for (int v = plat::lane_id(); v < kVecs; v += kW) dst[v] = src[v];
  if constexpr (kScaleBytes > 0) {
    const uint8_t* s = At<uint8_t>(a, a.rank, a.off_out_scales) + size_t(r) * kScaleBytes;
    uint8_t* d = At<uint8_t>(a, a.rank, a.off_exp_scales) + size_t(i) * kScaleBytes;
    for (int b = plat::lane_id(); b < kScaleBytes; b += kW) d[b] = s[b];
  }
}

template <EpCfg kCfg, typename T>
MORI_DEVICE void EpLayoutBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  if constexpr (kCfg.expertCapacity > 0) {  // (an op without the layout never launches it)
    constexpr int kE = kCfg.numExpertPerRank, kC = kCfg.expertCapacity, kK = kCfg.numExpertPerToken;
    constexpr int kEntries = kE * kC;
    const int rank = args.rank, lane = plat::lane_id();
    const int waves = gridDim.x * kCfg.warpPerBlock, wave = blockIdx.x * kCfg.warpPerBlock + plat::wave_id();
    const int* counts = At<int>(args, rank, args.off_expert_counts);
    int* recvRow = At<int>(args, rank, args.off_exp_maps);
    int* srcMap = recvRow + kEntries;
    int* slotMap = recvRow + 2 * kEntries;
    float* wts = At<float>(args, rank, args.off_exp_wts);
    const float* recvWts = static_cast<const float*>(args.inpWeights);  // out_wts, or null without weights
    const bool replay = kCfg.routingReplay && args.replay;

    if (replay) {
      for (int i = wave; i < kEntries; i += waves) {
        const int e = i / kC, c = i % kC;
        if (c >= counts[e]) {  // (wave-uniform) padding keeps its maps; its weight stays 0
          if (lane == 0) wts[i] = 0.f;
          continue;
        }
        const int r = recvRow[i];
        CopyEntry<kCfg>(args, r, i);
        if (lane == 0 && recvWts != nullptr) wts[i] = recvWts[r * kK + slotMap[i]];
      }
      return;
    }
    // padding: the entries from each expert's count on (disjoint from the claims below)
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kEntries; i += gridDim.x * blockDim.x) {
      if (i % kC >= counts[i / kC]) {
        recvRow[i] = srcMap[i] = slotMap[i] = -1;
        wts[i] = 0.f;
      }
    }
    if (blockIdx.x == 0)
      for (int e = threadIdx.x; e < kE; e += blockDim.x)
        if (counts[e] > kC) RecordError(args, kErrCapacity, CapacityDetail(e, rank), (uint64_t(counts[e]) << 32) | kC);
    const int total = *At<int>(args, rank, args.off_total_recv);
    unsigned* cursor = At<unsigned>(args, rank, args.off_exp_cursor);
    const int* recvSrc = At<int>(args, rank, args.off_recv_to_src);
    int* entryOf = At<int>(args, rank, args.off_exp_entry);
    for (int r = wave; r < total; r += waves) {
      int i = -1;
      if (lane < kK) {
        const int64_t e = ReceivedId<kCfg>(args, r, lane) - int64_t(rank) * kE;
        if (e >= 0 && e < kE) {
          const unsigned c = plat::atomic_add_device(cursor + e, 1u);
          if (c < unsigned(kC)) {
            i = int(e) * kC + int(c);
            recvRow[i] = r;
            srcMap[i] = recvSrc[r];
            slotMap[i] = lane;
            if (recvWts != nullptr) wts[i] = recvWts[r * kK + lane];
          }
        }
        entryOf[r * kK + lane] = i;  // (the expert-major combine's way back)
      }
      for (uint64_t m = plat::ballot(i >= 0); m; m &= m - 1) CopyEntry<kCfg>(args, r, plat::shfl(i, plat::lowest_bit(m)));
    }
  }
}

// The expert-major combine's local half (the `expert_sum` kernel, on the combine's EpCfg): each
// received row's entries of the expert output (inpTok [E, C, H] of T, weighted on the expert side)
// summed in float32 in top-k slot order, through exp_entry, into outTok [>= total, H] float32,
// which the float32 combine then sends home. Padding entries are never read.
template <EpCfg kCfg, typename T>
MORI_DEVICE void EpExpertSumBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  static_assert(sizeof(T) == EpElemBytes(kCfg), "element type does not match the Cfg dtype");
  constexpr int kK = kCfg.numExpertPerToken, kW = kCfg.waveSize, kPer = 16 / sizeof(T);
  constexpr int kVecs = EpTokenBytes(kCfg) / 16;
  const int rank = args.rank, lane = plat::lane_id();
  const int waves = gridDim.x * kCfg.warpPerBlock, wave = blockIdx.x * kCfg.warpPerBlock + plat::wave_id();
  const int total = *At<int>(args, rank, args.off_total_recv);
  const int* entryOf = At<int>(args, rank, args.off_exp_entry);
  const vec16_t* in = static_cast<const vec16_t*>(args.inpTok);
  float* rows = static_cast<float*>(args.outTok);
  for (int r = wave; r < total; r += waves) {
    for (int v = lane; v < kVecs; v += kW) {
      float acc[kPer] = {};
      for (int j = 0; j < kK; ++j) {  // (a wave-uniform broadcast load per slot)
        const int i = entryOf[r * kK + j];
        if (i < 0) continue;
        const vec16_t x = in[size_t(i) * kVecs + v];
        T el[kPer];
        __builtin_memcpy(el, &x, 16);
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc[e] += to_f32(el[e]);
      }
      __builtin_memcpy(rows + size_t(r) * kCfg.hiddenDim + size_t(v) * kPer, acc, sizeof(acc));
    }
  }
}

}  // namespace mori::ep
