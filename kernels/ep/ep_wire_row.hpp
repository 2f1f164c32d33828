// A combine row on the fp8 wire (the op's quant_type; numerics in ep_combine_wire.hpp), for either
// kernel config (the intranode EpCfg: CombWire in ep_combine_words.hpp; the internode EpNetCfg:
// NetWire in ep_net_combine.hpp), so both cast, lay out and decode a row the same way: 16-byte
// vector v of a row (its 16 / kElem elements) travels as kWords words at v * kVecBytes, and
// (kBlock) its block's scale word at kHidden + (v / kLanes) * 4 bytes; a row's bytes on the wire are
// the config's *WireBytes (the scale words padded to whole 16-byte vectors). The kLanes vectors of a
// block sit on kLanes aligned lanes of one wave on both sides (a row is whole blocks, and a wave's
// vectors of a row are consecutive from a multiple of the wave size).
#pragma once
#include "ep/ep_combine_wire.hpp"

namespace mori::ep {

template <bool kQuant_, bool kBlock_, int kElem_, int kHidden, int kScaleBytes>
struct WireRow {
  static constexpr bool kQuant = kQuant_, kBlock = kBlock_;
  static constexpr int kElem = kElem_, kWords = 16 / kElem / 4, kVecBytes = 4 * kWords;
  static constexpr int kLanes = 128 * kElem / 16;
  using Vec = WireVec<kWords>;

  // The cast of vector x (live: the lane has one). Every lane of the wave calls it: kBlock's
  // block max is a shuffle.
  MORI_DEVICE static Vec Cast(const plat::vec16_t& x, bool live) {
    Vec c;
    c.scale = 0;
    float inv = 1.f;
    if constexpr (kBlock) {
      const float amax = LanesMax<kLanes>(live ? AbsMaxVec<kElem>(x) : 0.f);
      inv = 1.0f / BlockScale<kScaleBytes>(amax, c.scale);
    }
    CastWords<kElem>(x, inv, c.w);
    return c;
  }
  MORI_DEVICE static uint32_t* Words(const void* row, int v) {
    return reinterpret_cast<uint32_t*>(const_cast<char*>(static_cast<const char*>(row)) + size_t(v) * kVecBytes);
  }
  MORI_DEVICE static uint32_t* Scale(const void* row, int v) {
    return reinterpret_cast<uint32_t*>(const_cast<char*>(static_cast<const char*>(row)) + kHidden + (v / kLanes) * 4);
  }
  // Whether vector v's lane stores its block's scale word (one per block).
  MORI_DEVICE static bool ScaleLane(int v) { return kBlock && v % kLanes == 0; }
  // A vector into a row: plain stores (a release or a completion follows before any signal), or
  // (kLow, the intranode low-latency combine) each word relaxed and system-scope, its own arrival signal.
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
  // Vector v of a peer's pushed row: after the acquire that saw it arrive, or (kLow) polled.
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
  // acc[e] += the decoded value of element e (ep_combine_wire.hpp: AddDecoded).
  MORI_DEVICE static void Add(const Vec& c, float (&acc)[4 * kWords]) {
    AddDecoded<kBlock>(c, ScaleOfWord<kScaleBytes>(c.scale), acc);
  }
};

}  // namespace mori::ep
