// EP combine: where a summing wave's work item reads its rows from (see ep_intranode.hpp for the
// protocol, ep_combine_summer.hpp for the sum).
#pragma once
#include "ep/ep_combine_words.hpp"

namespace mori::ep {

// Where one work item's rows come from: one source per rank its token went to (its own row
// straight from the input, a peer's from comb_recv, where that peer pushed it), and this lane's
// weight (lane < k) of each. `flat` is the token's forward-map entry on lane j < k (-1 elsewhere).
// Low latency (kLow): a peer's weight is a TaggedWeight. Nibble i of `pes` is source i's rank (low
// latency, so that peers' words are awaited, not just loaded; the fp8 wire, so that the own row is
// cast and a peer's decoded). A peer's row is EpWireBytes long (CombWire). With `prefetchV0` >= 0, this lane's vectors
// of the own row (prefetchV0, + waveSize, ...) are hinted into L2 as soon as the row is known: the
// input was complete at the kernel's start, so its HBM latency can pass while the wave waits for
// the peers' flags. (Loading it into registers there instead delayed the poll: docs/performance.md,
// "Own row hinted into L2".)
template <EpCfg kCfg>
struct ItemSources {
  static constexpr bool kLow = kCfg.lowLatency, kPes = kLow || CombWire<kCfg>::kQuant;
  static constexpr int kWs = kCfg.worldSize, kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank;
  static constexpr int kVecs = EpTokenBytes(kCfg) / 16, kRecv = EpMaxRecv(kCfg);
  static constexpr int kW = kCfg.waveSize, kUnroll = kCfg.vecUnroll;
  const vec16_t* row[kWs];
  const void* w[kWs];  // the own row's: a float of the input's weights; a peer's: a CombWeight
  int n = 0;
  uint32_t pes = 0;
  MORI_DEVICE ItemSources(const EpArgs& args, bool sumWeights, int flat, int t, int prefetchV0 = -1) {
    const int rank = args.rank, lane = plat::lane_id();
    const vec16_t* in = static_cast<const vec16_t*>(args.inpTok);
    const char* recv = At<char>(args, rank, args.off_comb_recv);
    const CombWeight<kLow>* recvW = At<CombWeight<kLow>>(args, rank, args.off_comb_recv_wts);
#pragma unroll
    for (int i = 0; i < kWs; ++i) row[i] = nullptr, w[i] = nullptr;
    for (uint64_t m = plat::ballot(flat >= 0); m; m &= m - 1) {
      const int f = plat::shfl(flat, plat::lowest_bit(m)), pe = f / kRecv, slot = f % kRecv;
      if (pe == rank && slot >= args.inpRows) continue;  // short input (reported): never read past it
      const vec16_t* r = pe == rank ? in + size_t(slot) * kVecs
                                    : reinterpret_cast<const vec16_t*>(recv + size_t(pe * kM + t) * EpWireBytes(kCfg));
      if (pe == rank && prefetchV0 >= 0)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (prefetchV0 + u * kW < kVecs) plat::prefetch_l2(r + prefetchV0 + u * kW);
      // (formed only with weights: the input's weights pointer may be null otherwise)
      const void* wp = !sumWeights ? nullptr
                       : pe == rank ? static_cast<const void*>(args.inpWeights + size_t(slot) * kK + lane)
                                    : static_cast<const void*>(recvW + size_t(pe * kM + t) * kK + lane);
#pragma unroll
      for (int i = 0; i < kWs; ++i)  // (static indices: the arrays stay in registers)
        if (i == n) row[i] = r, w[i] = wp;
      if constexpr (kPes) pes |= uint32_t(pe) << (4 * n);
      ++n;
    }
  }
  MORI_DEVICE int Pe(int i) const { return int(pes >> (4 * i)) & 15; }
  MORI_DEVICE bool Peer(int i, int rank) const { return Pe(i) != rank; }
};

}  // namespace mori::ep
