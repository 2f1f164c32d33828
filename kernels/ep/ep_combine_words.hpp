// EP combine: the range and word conventions that both sides of a pushed row share (the sender in
// ep_combine_sender.hpp, the summer in ep_combine_summer.hpp; see ep_intranode.hpp for the protocol).
#pragma once
#include <type_traits>

#include "ep/ep_common.hpp"
#include "ep/ep_wire_row.hpp"

namespace mori::ep {

// Tokens per combine range: the unit of a sender's task and, with range flags, of one flag
// (EpRangeTok). With flags it is 2 on every rank, whatever geometry each picked by its own token
// count, so the ranks agree on every rank's ranges; small, so that the last ranges to arrive are
// summed quickly. Low latency has no flags: a rank's ranges are its own business, and it takes 1
// when every peer-token task fits in its grid.
template <EpCfg kCfg>
constexpr int kRangeTok = EpRangeTok(kCfg);
template <EpCfg kCfg>
MORI_DEVICE int NumRanges(int n) { return (n + kRangeTok<kCfg> - 1) / kRangeTok<kCfg>; }

// A range-ready flag's value: 2 * the combine epoch, + 1 when the sender's input was too short to
// hold some of the range's rows (they were not sent). The home rank then sums those tokens without
// them and must say so: the flag carries that news, ordered with the rows, at no extra store.
MORI_DEVICE constexpr uint64_t RangeFlag(uint64_t target, bool shortInput) { return 2 * target + shortInput; }
// TaskSlot's mark for a token routed here whose row lies beyond a short input.
constexpr int kShortSlot = -2;

// Low latency (kCfg.lowLatency, a whole op's choice): every 32-bit word of a pushed row is its own
// arrival signal (CombWord), so no release fence and no range flag, whose 1.3-1.4 us each sit on the
// small-batch chain. At large batches the flags win: a summing wave's own polls, strong loads and
// empty-word stores cost more than the flags they replace. Both sides of every row must agree, so
// it is a Cfg field, never a per-call choice (a kernel that held both protocols and chose by n cost
// the flag path 1.5 us at 4096 tokens: docs/performance.md, "Protocol as a Cfg field").
// A data word that reads like a signal word (a NaN) is sent as kCanonWord, another NaN.
MORI_DEVICE uint32_t CanonWord(uint32_t w) { return w >= kShortWord ? uint32_t(kCanonWord) : w; }
MORI_DEVICE vec16_t CanonVec(vec16_t v) {
  v.x = CanonWord(v.x), v.y = CanonWord(v.y), v.z = CanonWord(v.z), v.w = CanonWord(v.w);
  return v;
}
MORI_DEVICE vec16_t WordVec(uint32_t w) {
  vec16_t v;
  v.x = v.y = v.z = v.w = w;
  return v;
}
MORI_DEVICE bool HasWord(vec16_t v, uint32_t w) { return v.x == w || v.y == w || v.z == w || v.w == w; }
// A low-latency weight carries the combine epoch, so one left from an earlier combine never reads
// as arrived (weights are not set back to empty: a rank that does not sum them would leave them).
MORI_DEVICE uint64_t TaggedWeight(uint64_t target, float w) { return (target << 32) | __float_as_uint(w); }
MORI_DEVICE bool WeightArrived(uint64_t v, uint64_t target) { return uint32_t(v >> 32) == uint32_t(target); }
// A weight as pushed into comb_recv_wts: f32, or (low latency) a TaggedWeight.
template <bool kLow>
using CombWeight = std::conditional_t<kLow, uint64_t, float>;

// The fp8 wire of a combine row (kCfg.combineQuant; layout and numerics in ep_wire_row.hpp), in
// rows of EpWireBytes.
template <EpCfg kCfg>
struct CombWire : WireRow<kCfg.combineQuant != EpCombineQuant::Plain, kCfg.combineQuant == EpCombineQuant::Fp8Block,
                          EpElemBytes(kCfg), kCfg.hiddenDim, kCfg.combineScaleBytes> {
  static constexpr int kRowBytes = EpWireBytes(kCfg);
  static_assert(!CombWire::kBlock || CombWire::kLanes <= kCfg.waveSize, "a scale block's vectors fit in one wave");
};

}  // namespace mori::ep
