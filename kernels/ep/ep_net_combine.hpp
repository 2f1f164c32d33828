// The combine rows of both internode families: a row's push into a peer (as it is, or cast to the
// fp8 wire on the way), v2's forward of a node's wire rows, and a token's sum on its home rank.
//
// The fp8 wire (kCfg.combineQuant, the op's quant_type) is the intranode kernels' (ep_wire_row.hpp,
// numerics in ep_combine_wire.hpp): the rank that holds a received row casts it as it pushes it (its
// own rows too), and the home rank decodes each row and adds it to its float32 sums one destination
// rank at a time, in the order of the token's top-k slots (the rank of its first slot first), then
// rounds once: the torch backend's sum (backends/torch/wire.py), bit for bit. v2 keeps that: its
// forwarders pass the node's wire rows on unchanged, one per destination rank, to the home's
// comb_recv[rank, token] (as v2_ll's senders do), where a bf16 v2 forwarder sends the node's partial
// sum. A partial sum on the forwarder would add the node's terms in local-index order and round them
// into one (and re-cast it for the wire), so the result would depend on where the experts live. The
// cost: a token's rows cross the network once per destination rank instead of once per node, at
// hiddenDim bytes (plus the scale words) each instead of the partial sum's 2 * hiddenDim (bf16).
#pragma once
#include "ep/ep_net_common.hpp"
#include "ep/ep_wire_row.hpp"

namespace mori::epnet {

template <EpNetCfg kCfg>
using NetWire = ep::WireRow<kCfg.combineQuant != EpCombineQuant::Plain, kCfg.combineQuant == EpCombineQuant::Fp8Block,
                            NetElemBytes(kCfg), kCfg.hiddenDim, kCfg.combineScaleBytes>;

// Warp: input row `inp` into `dst` as the wire carries it (NetWireBytes): copied, or cast vector by
// vector. The cast loop is uniform over the warp (a block's amax is a shuffle): dead lanes cast zeros.
template <EpNetCfg kCfg>
MORI_DEVICE void WriteWireRow(char* dst, const char* inp) {
  using W = NetWire<kCfg>;
  constexpr int kVecs = NetTokenBytes(kCfg) / 16;
  static_assert(!W::kBlock || W::kLanes <= plat::kWaveSize, "a scale block's vectors fit in one warp");
  if constexpr (!W::kQuant) {
    WarpCopy(dst, inp, NetTokenBytes(kCfg));
  } else {
    for (int v0 = 0; v0 < kVecs; v0 += plat::kWaveSize) {
      const int v = v0 + plat::lane_id();
      const bool live = v < kVecs;
      const typename W::Vec c = W::Cast(live ? reinterpret_cast<const vec16_t*>(inp)[v] : vec16_t{}, live);
      if (live) W::template Store<false>(dst, v, c);
    }
  }
}

// Warp: row i of the combine input (and its weights, when given) into `row` and `wts` on `peer`, as
// the wire carries it, by stores where they reach it, else staged (a put's source is symmetric) and put.
template <EpNetCfg kCfg>
MORI_DEVICE void PushCombineRow(const EpNetArgs& a, int i, char* row, float* wts, int peer) {
  constexpr int kK = kCfg.numExpertPerToken, kTok = NetTokenBytes(kCfg), kRow = NetWireBytes(kCfg);
  const int lane = plat::lane_id();
  const char* inp = static_cast<const char*>(a.inpTok) + size_t(i) * kTok;
  const float* inp_wts = a.inpWeights != nullptr ? a.inpWeights + size_t(i) * kK : nullptr;
  if (char* p = Direct<kCfg>(a, row, peer)) {
    WriteWireRow<kCfg>(p, inp);
    if (inp_wts && lane < kK) Direct<kCfg>(a, wts, peer)[lane] = inp_wts[lane];
    return;
  }
  char* stage = Local<char>(a, a.off_comb_stage) + size_t(i) * kRow;
  float* stage_wts = Local<float>(a, a.off_comb_stage_wts) + size_t(i) * kK;
  WriteWireRow<kCfg>(stage, inp);
  if (inp_wts && lane < kK) stage_wts[lane] = inp_wts[lane];
  __syncwarp();
  transport::put_warp(row, stage, kRow, peer);
  if (inp_wts) transport::put_warp(wts, stage_wts, kK * 4, peer);
}

// v2 with the fp8 wire, warp: relay row j's wire rows from this node's ranks (`mask`: their local
// indices) and their weights, unchanged, into comb_recv[rank, token] on the token's home (`src`:
// home * M + token), where it sums them as v2_ll's home does. The rows are symmetric: put in place.
template <EpNetCfg kCfg>
MORI_DEVICE void ForwardWireRows(const EpNetArgs& a, int j, uint32_t mask, int src, bool weights) {
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kG = kCfg.gpuPerNode;
  constexpr int kRow = NetWireBytes(kCfg);
  const int lane = plat::lane_id(), first = a.rank / kG * kG, home = src / kM;
  const char* comb_relay = Local<char>(a, a.off_comb_relay);
  const float* comb_relay_wts = Local<float>(a, a.off_comb_relay_wts);
  char* comb_recv = Local<char>(a, a.off_comb_recv);
  float* comb_recv_wts = Local<float>(a, a.off_comb_recv_wts);
  for (uint32_t m = mask; m; m &= m - 1) {
    const int b = plat::lowest_bit(m);
    const size_t from = size_t(j) * kG + b, at = size_t(first + b) * kM + src % kM;
    if (char* p = Direct<kCfg>(a, comb_recv + at * kRow, home)) {
      WarpCopy(p, comb_relay + from * kRow, kRow);
      if (weights && lane < kK) Direct<kCfg>(a, comb_recv_wts, home)[at * kK + lane] = comb_relay_wts[from * kK + lane];
    } else {
      transport::put_warp(comb_recv + at * kRow, comb_relay + from * kRow, kRow, home);
      if (weights) transport::put_warp(comb_recv_wts + at * kK, comb_relay_wts + from * kK, kK * 4, home);
    }
  }
}

// Warp, token t: its distinct destination ranks (from tok_dest) into dest, in the order of their
// first top-k slots, the same in every lane; returns how many. A rank masked since the dispatch
// is left out: it sent nothing back (v2 refuses masking, so its mask is all zero).
template <EpNetCfg kCfg>
MORI_DEVICE int TokenDestRanks(const EpNetArgs& a, int t, int (&dest)[kCfg.numExpertPerToken]) {
  constexpr int kK = kCfg.numExpertPerToken;
  const int lane = plat::lane_id();
  const int mine = lane < kK ? Local<int>(a, a.off_tok_dest)[t * kK + lane] : -1;
  int nd = 0;
  for (int j = 0; j < kK; ++j) {
    const int pj = plat::shfl(mine, j);
    if (pj >= 0 && !Masked(a, pj)) dest[nd++] = pj;
  }
  return nd;
}

// Warp, token t: out[t] (and its weights, when asked for) = the fp32 sum, from +0 in the order given,
// of the n rows of comb_recv at [src[q], t] (the token's rows from its distinct destination ranks,
// decoded from the wire when it is cast, or v2's partial sums from its destination nodes), rounded once.
template <EpNetCfg kCfg, typename T>
MORI_DEVICE void SumCombRows(const EpNetArgs& a, int t, const int* src, int n) {
  using W = NetWire<kCfg>;
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kRow = NetWireBytes(kCfg);
  const int lane = plat::lane_id();
  const char* comb_recv = Local<char>(a, a.off_comb_recv);
  const float* comb_recv_wts = Local<float>(a, a.off_comb_recv_wts);
  for (int v = lane; v < NetTokenBytes(kCfg) / 16; v += plat::kWaveSize) {
    VecSum<T> acc;
    for (int q = 0; q < n; ++q) {
      const char* row = comb_recv + (size_t(src[q]) * kM + t) * kRow;
      if constexpr (W::kQuant) W::Add(W::template Load<false>(row, v), acc.v);
      else acc.add(plat::load_peer(reinterpret_cast<const vec16_t*>(row) + v));
    }
    reinterpret_cast<vec16_t*>(static_cast<char*>(a.outTok) + size_t(t) * NetTokenBytes(kCfg))[v] = acc.pack();
  }
  if (a.outWeights != nullptr && lane < kK) {
    float s = 0.f;
    for (int q = 0; q < n; ++q) s += plat::load_peer_f32(comb_recv_wts + (size_t(src[q]) * kM + t) * kK + lane);
    a.outWeights[t * kK + lane] = s;
  }
}

}  // namespace mori::epnet
