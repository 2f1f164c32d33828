// EP combine: the range and word conventions that both sides of a pushed row share (the sender in
// ep_combine_sender.hpp, the summer in ep_combine_summer.hpp; see ep_intranode.hpp for the protocol).
#pragma once
#include <type_traits>

#include "ep/ep_combine_wire.hpp"
#include "ep/ep_common.hpp"

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

// The fp8 wire of a combine row (kCfg.combineQuant; numerics in ep_combine_wire.hpp): 16-byte
// vector v of a row (its elements) travels as kWords words at v * kVecBytes, and (Fp8Block) its
// block's scale word at hiddenDim + (v / kLanes) * 4 bytes, within an EpWireBytes row. The kLanes
// vectors of a block sit on kLanes aligned lanes of one wave on both sides (a row is whole blocks,
// and a wave's vectors of a row are consecutive from a multiple of the wave size).
template <EpCfg kCfg>
struct CombWire {
  static constexpr bool kQuant = kCfg.combineQuant != EpCombineQuant::Plain;
  static constexpr bool kBlock = kCfg.combineQuant == EpCombineQuant::Fp8Block;
  static constexpr int kElem = EpElemBytes(kCfg), kWords = 16 / kElem / 4, kVecBytes = 4 * kWords;
  static constexpr int kLanes = 128 * kElem / 16, kRowBytes = EpWireBytes(kCfg);
  using Vec = WireVec<kWords>;
  static_assert(!kBlock || kLanes <= kCfg.waveSize, "a scale block's vectors fit in one wave");

  // The cast of vector x (live: the lane has one). Every lane of the wave calls it: Fp8Block's
  // block max is a shuffle.
  MORI_DEVICE static Vec Cast(const vec16_t& x, bool live) {
    Vec c;
    c.scale = 0;
    float inv = 1.f;
    if constexpr (kBlock) {
      const float amax = LanesMax<kLanes>(live ? AbsMaxVec<kElem>(x) : 0.f);
      inv = 1.0f / BlockScale<kCfg.combineScaleBytes>(amax, c.scale);
    }
    CastWords<kElem>(x, inv, c.w);
    return c;
  }
  MORI_DEVICE static uint32_t* Words(const void* row, int v) {
    return reinterpret_cast<uint32_t*>(const_cast<char*>(static_cast<const char*>(row)) + size_t(v) * kVecBytes);
  }
  MORI_DEVICE static uint32_t* Scale(const void* row, int v) {
    return reinterpret_cast<uint32_t*>(const_cast<char*>(static_cast<const char*>(row)) + kCfg.hiddenDim + (v / kLanes) * 4);
  }
  // Whether vector v's lane stores its block's scale word (one per block).
  MORI_DEVICE static bool ScaleLane(int v) { return kBlock && v % kLanes == 0; }
  // A pushed vector: plain stores (the flag protocol's release follows), or (low latency) each word
  // relaxed and system-scope, its own arrival signal.
  template <bool kLow>
  MORI_DEVICE static void Store(void* row, int v, const Vec& c) {
    uint32_t* w = Words(row, v);
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      if constexpr (kLow) plat::store_word_relaxed(w + i, c.w[i]);
      else w[i] = c.w[i];
    }
    if (ScaleLane(v)) {
      if constexpr (kLow) plat::store_word_relaxed(Scale(row, v), c.scale);
      else *Scale(row, v) = c.scale;
    }
  }
  // Vector v of a peer's pushed row: after the range flag's acquire, or (low latency) polled.
  template <bool kLow>
  MORI_DEVICE static Vec Load(const void* row, int v) {
    Vec c;
    const uint32_t* w = Words(row, v);
#pragma unroll
    for (int i = 0; i < kWords; ++i) c.w[i] = kLow ? plat::load_word_relaxed(w + i) : plat::load_peer_u32(w + i);
    c.scale = !kBlock ? 0u : kLow ? plat::load_word_relaxed(Scale(row, v)) : plat::load_peer_u32(Scale(row, v));
    return c;
  }
  MORI_DEVICE static Vec Fill(uint32_t word) {
    Vec c;
#pragma unroll
    for (int i = 0; i < kWords; ++i) c.w[i] = word;
    c.scale = word;
    return c;
  }
  MORI_DEVICE static bool Has(const Vec& c, uint32_t word) {
    bool any = kBlock && c.scale == word;
#pragma unroll
    for (int i = 0; i < kWords; ++i) any |= c.w[i] == word;
    return any;
  }
  MORI_DEVICE static void Add(const Vec& c, float (&acc)[4 * kWords]) {
    AddDecoded<kBlock>(c, ScaleOfWord<kCfg.combineScaleBytes>(c.scale), acc);
  }
};

}  // namespace mori::ep
