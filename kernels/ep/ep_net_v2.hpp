// Internode EP, hierarchical family (`v2`): a token crosses the network once per destination node,
// to the rank of that node with the source's local index (its forwarder), which writes it to every
// destination rank of its node; combine runs the same path back, summing inside the node first.
// Transport: kernels/transport/*.hpp, included before this header.
//
// A leg is one kernel (one host launch) in three phases. N nodes of G ranks; a rank's local index is
// rank % G; relay index j = source node * M + relay slot.
//   dispatch, send    waits until each of its forwarders has forwarded its previous relay rows; one
//                     warp per token drops invalid ids and repeated ranks (dedup), and for each
//                     destination node claims a relay slot (a local counter per node) and writes the
//                     row and its metadata (weights, ids, source, the node's destination ranks as a
//                     mask, the epoch) into the forwarder's relay[j]; signals every rank (done).
//   dispatch, forward waits for the sources of its local index on every node (this rank included), and until each rank of
//                     its node has read its previous combine input and reset its slot counter; one
//                     warp per relay row of this epoch claims a receive slot on each destination rank
//                     of the row's mask and writes row, weights, ids, the reverse map and the relay
//                     index there; signals its node (done) and its sources (relay free).
//   dispatch, receive block 0: waits for every forwarder of its node, publishes total_recv, resets
//                     its counters and signals every rank that its slots are free.
//   combine, send     one warp per received row writes the expert output (and weights) into the
//                     slot of this rank in comb_relay[j] on the forwarder of the row (cast on the
//                     way under the fp8 wire); signals every rank (its input is read).
//   combine, forward  waits for its node; one warp per relay row of this epoch sums the node's rows
//                     in fp32 and writes the sum into comb_recv[this node, token] on the source
//                     (a put across nodes); under the fp8 wire it passes the node's rows on as they
//                     are instead, into comb_recv[their rank, token] (ep_net_combine.hpp says why);
//                     signals its sources.
//   combine, receive  waits for its forwarders on every node and sums each token's partial sums from
//                     its distinct destination nodes in fp32 (fp8 wire: its rows from its distinct
//                     destination ranks, in top-k slot order, as v2_ll's receive).
// Epochs are the done counts, on the device, and a leg's blocks are resident together (see
// ep_net_ll.hpp). The split legs (kCfg.phase): the send kernel is the send phase; the receive
// kernel forwards and then receives, on the whole grid, so a rank's rows cross their second hop
// when the ranks of its node (dispatch) or its forwarders (combine) run their receive kernels. The rows both families use
// (dispatch done, slots free, combine done) are signalled to every rank by both, so each rank's own
// count is every rank's count and an `auto` op may switch family between calls (every rank of one
// call on the same side of the threshold); the rows of v2 alone count v2's calls.
#pragma once
#include "ep/ep_net_combine.hpp"

namespace mori::epnet {

// Words of a relay row's metadata: weights (k, as bits), ids (k), source (rank * M + token), the
// destination ranks of the forwarder's node (bit = local index), the dispatch epoch (from 1).
template <EpNetCfg kCfg>
struct RelayMeta {
  static constexpr int kK = kCfg.numExpertPerToken;
  static constexpr int kSrc = 2 * kK, kMask = 2 * kK + 1, kTag = 2 * kK + 2, kWords = 2 * kK + 3;
};

template <EpNetCfg kCfg>
constexpr int kNodes = kCfg.worldSize / kCfg.gpuPerNode;

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void V2DispatchSend(const EpNetArgs& a, const NetEpochs& e) {
  static_assert(kCfg.gpuPerNode <= 32, "a node's ranks are a 32-bit mask");
  using Meta = RelayMeta<kCfg>;
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kG = kCfg.gpuPerNode;
  constexpr int kTok = NetTokenBytes(kCfg);
  const int rank = a.rank, lane = plat::lane_id(), node = rank / kG;
  // this rank is its own forwarder: its own relay-free count is the forwards every forwarder owes it
  WaitRanks<kCfg>(a, kSigRelayFree, e.relayFree, kNetWaitRelayFree, SameLocalIndex<kCfg>(rank));

  int* tok_dest = Local<int>(a, a.off_tok_dest);
  int* out_cnt = Local<int>(a, a.off_relay_out_cnt);
  char* relay = Local<char>(a, a.off_relay);
  int* relay_meta = Local<int>(a, a.off_relay_meta);
  char* stage = Local<char>(a, a.off_disp_stage);
  int* stage_meta = Local<int>(a, a.off_relay_stage_meta);
  const char* inp = static_cast<const char*>(a.inpTok);
  const bool weights = a.inpWeights != nullptr;
  for (int t = GridWarp<kCfg>(); t < a.numTokens; t += GridWarps<kCfg>()) {
    const int pe = DistinctDestRank<kCfg>(a, t);
    uint32_t mask = 0;  // this lane's node's destination ranks (bits: local index)
    bool lead = pe >= 0;  // the first lane of its node
    for (int j = 0; j < kK; ++j) {
      const int pj = plat::shfl(pe, j);
      if (pj >= 0 && pe >= 0 && pj / kG == pe / kG) {
        mask |= 1u << (pj % kG);
        if (j < lane) lead = false;
      }
    }
    if (lane < kK) tok_dest[t * kK + lane] = pe;
    const int dnode = lead ? pe / kG : -1;
    const int slot = lead ? int(plat::atomic_add_device(reinterpret_cast<unsigned*>(out_cnt + dnode), 1u)) : -1;
    if (plat::wave_any(lead && dnode != node)) WarpCopy(stage + size_t(t) * kTok, inp + size_t(t) * kTok, kTok);
    for (uint64_t m = plat::ballot(lead); m; m &= m - 1) {
      const int j = plat::lowest_bit(m);
      const int nd = plat::shfl(dnode, j), s = plat::shfl(slot, j);
      const uint32_t dmask = uint32_t(plat::shfl(int(mask), j));
      const int fwd = nd * kG + rank % kG;
      const size_t at = size_t(node) * kM + s;  // the relay index on the forwarder
      int* meta = stage_meta + (size_t(t) * kNodes<kCfg> + nd) * Meta::kWords;  // (its own copy per node)
      int* dst_meta = relay_meta + at * Meta::kWords;
      if (int* p = Direct<kCfg>(a, dst_meta, fwd)) meta = p;  // this node: written in place
      if (lane < kK) {
        meta[lane] = weights ? __float_as_int(a.inpWeights[t * kK + lane]) : 0;
        meta[kK + lane] = a.inpIndices[t * kK + lane];
      }
      if (lane == 0) {
        meta[Meta::kSrc] = rank * kM + t;
        meta[Meta::kMask] = int(dmask);
        meta[Meta::kTag] = int(e.disp + 1);
      }
      __syncwarp();
      if (char* p = Direct<kCfg>(a, relay + at * kTok, fwd)) {
        WarpCopy(p, inp + size_t(t) * kTok, kTok);
      } else {
        transport::put_warp(relay + at * kTok, stage + size_t(t) * kTok, kTok, fwd);
        transport::put_warp(dst_meta, meta, Meta::kWords * 4, fwd);
      }
    }
  }
  SignalEveryRank<kCfg>(a, kSigDispDone, BlockShare());
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void V2DispatchForward(const EpNetArgs& a, const NetEpochs& e) {
  using Meta = RelayMeta<kCfg>;
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kG = kCfg.gpuPerNode;
  constexpr int kTok = NetTokenBytes(kCfg);
  const int rank = a.rank, lane = plat::lane_id();
  const uint64_t epoch = e.disp + 1;  // this dispatch's
  WaitRanks<kCfg>(a, kSigDispDone, epoch * kDoneUnit, kNetWaitDispatchDone, SameLocalIndex<kCfg>(rank));
  WaitRanks<kCfg>(a, kSigCombDone, e.comb * kDoneUnit, kNetWaitPeerCombine, NodeOf<kCfg>(rank));
  WaitRanks<kCfg>(a, kSigSlotsFree, e.disp, kNetWaitPeerSlots, NodeOf<kCfg>(rank));

  const char* relay = Local<char>(a, a.off_relay);
  const int* relay_meta = Local<int>(a, a.off_relay_meta);
  int* recv_cnt = Local<int>(a, a.off_recv_cnt);
  char* disp_out = Local<char>(a, a.off_disp_out);
  float* out_wts = Local<float>(a, a.off_out_wts);
  int* out_idx = Local<int>(a, a.off_out_idx);
  int* recv_to_src = Local<int>(a, a.off_recv_to_src);
  int* recv_relay = Local<int>(a, a.off_recv_relay);
  const int first = rank / kG * kG;
  for (int j = GridWarp<kCfg>(); j < kNodes<kCfg> * kM; j += GridWarps<kCfg>()) {
    const int* meta = relay_meta + size_t(j) * Meta::kWords;
    if (uint64_t(plat::load_volatile(meta + Meta::kTag)) != epoch) continue;  // (uniform: one row per warp)
    const uint32_t mask = uint32_t(meta[Meta::kMask]);
    const int src = meta[Meta::kSrc];
    const int d = first + lane;
    const int slot = (lane < kG && (mask >> lane & 1u)) ? transport::atomic_fetch_add(recv_cnt, 1, d) : -1;
    for (uint32_t m = mask; m; m &= m - 1) {
      const int b = plat::lowest_bit(m);
      const int dpe = first + b, s = plat::shfl(slot, b);
      char* row = disp_out + size_t(s) * kTok;
      if (char* p = Direct<kCfg>(a, row, dpe)) {
        WarpCopy(p, relay + size_t(j) * kTok, kTok);
        if (lane < kK) {
          Direct<kCfg>(a, out_wts, dpe)[s * kK + lane] = __int_as_float(meta[lane]);
          Direct<kCfg>(a, out_idx, dpe)[s * kK + lane] = meta[kK + lane];
        }
        if (lane == 0) {
          Direct<kCfg>(a, recv_to_src, dpe)[s] = src;
          Direct<kCfg>(a, recv_relay, dpe)[s] = j;
        }
      } else {  // (a node whose ranks do not reach each other by stores: the relay is symmetric)
        transport::put_warp(row, relay + size_t(j) * kTok, kTok, dpe);
        transport::put_warp(out_wts + s * kK, meta, kK * 4, dpe);
        transport::put_warp(out_idx + s * kK, meta + kK, kK * 4, dpe);
        if (lane == 0) {
          transport::put_int(recv_to_src + s, src, dpe);
          transport::put_int(recv_relay + s, j, dpe);
        }
      }
    }
  }
  CompleteBlock<kCfg>();
  if (threadIdx.x == 0) {
    SignalRanks<kCfg>(a, kSigFwdDone, BlockShare(), NodeOf<kCfg>(rank));
    SignalRanks<kCfg>(a, kSigRelayFree, BlockShare(), SameLocalIndex<kCfg>(rank));
  }
}

// (block 0, after its forward phase: this rank's send claims are done, its forward waited for them)
template <EpNetCfg kCfg, typename T>
MORI_DEVICE void V2DispatchRecv(const EpNetArgs& a, const NetEpochs& e) {
  WaitRanks<kCfg>(a, kSigFwdDone, (e.fwd + 1) * kDoneUnit, kNetWaitForwardDone, NodeOf<kCfg>(a.rank));
  PublishTotalRecv(a);
  int* out_cnt = Local<int>(a, a.off_relay_out_cnt);
  for (int n = threadIdx.x; n < kNodes<kCfg>; n += blockDim.x) out_cnt[n] = 0;
  SignalEveryRank<kCfg>(a, kSigSlotsFree, 1);
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetV2Dispatch(const EpNetArgs& a) {
  const NetEpochs e = LegEpochs<kCfg>(a, kSigDispDone);
  if constexpr (kCfg.phase != EpPhase::Recv) V2DispatchSend<kCfg, T>(a, e);
  if constexpr (kCfg.phase != EpPhase::Send) {
    V2DispatchForward<kCfg, T>(a, e);
    if (blockIdx.x == 0) V2DispatchRecv<kCfg, T>(a, e);
  }
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void V2CombineSend(const EpNetArgs& a, const NetEpochs& e) {
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kG = kCfg.gpuPerNode;
  constexpr int kRow = NetWireBytes(kCfg);
  const int rank = a.rank;
  const int rows = CombineInputRows<kCfg>(a, e.comb + 1);  // (a short input's marks go straight to the home ranks)
  const int* recv_to_src = Local<int>(a, a.off_recv_to_src);
  const int* recv_relay = Local<int>(a, a.off_recv_relay);
  char* comb_relay = Local<char>(a, a.off_comb_relay);
  float* comb_relay_wts = Local<float>(a, a.off_comb_relay_wts);
  for (int i = GridWarp<kCfg>(); i < rows; i += GridWarps<kCfg>()) {
    const int fwd = rank / kG * kG + recv_to_src[i] / kM % kG;  // this node's rank of the source's local index
    const size_t at = size_t(recv_relay[i]) * kG + rank % kG;
    PushCombineRow<kCfg>(a, i, comb_relay + at * kRow, comb_relay_wts + at * kK, fwd);
  }
  SignalEveryRank<kCfg>(a, kSigCombDone, BlockShare());
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void V2CombineForward(const EpNetArgs& a, const NetEpochs& e) {
  using Meta = RelayMeta<kCfg>;
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kG = kCfg.gpuPerNode;
  constexpr int kTok = NetTokenBytes(kCfg);
  const int rank = a.rank, lane = plat::lane_id(), node = rank / kG;
  WaitRanks<kCfg>(a, kSigCombDone, (e.comb + 1) * kDoneUnit, kNetWaitCombineDone, NodeOf<kCfg>(rank));
  const uint64_t epoch = e.disp;  // the latest dispatch's
  const int* relay_meta = Local<int>(a, a.off_relay_meta);
  const char* comb_relay = Local<char>(a, a.off_comb_relay);
  const float* comb_relay_wts = Local<float>(a, a.off_comb_relay_wts);
  char* comb_recv = Local<char>(a, a.off_comb_recv);
  float* comb_recv_wts = Local<float>(a, a.off_comb_recv_wts);
  char* stage = Local<char>(a, a.off_comb_stage);
  float* stage_wts = Local<float>(a, a.off_comb_stage_wts);
  const bool weights = a.inpWeights != nullptr;
  for (int j = GridWarp<kCfg>(); j < kNodes<kCfg> * kM; j += GridWarps<kCfg>()) {
    const int* meta = relay_meta + size_t(j) * Meta::kWords;
    if (uint64_t(plat::load_volatile(meta + Meta::kTag)) != epoch) continue;
    const uint32_t mask = uint32_t(meta[Meta::kMask]);
    const int src = meta[Meta::kSrc], home = src / kM;
    if constexpr (NetWire<kCfg>::kQuant) {
      ForwardWireRows<kCfg>(a, j, mask, src, weights);
      continue;
    }
    const size_t at = size_t(node) * kM + src % kM;  // the partial sum's place on the source
    char* dst = comb_recv + at * kTok;
    char* p = Direct<kCfg>(a, dst, home);
    char* out = p ? p : stage + size_t(j) * kTok;
    for (int v = lane; v < kTok / 16; v += plat::kWaveSize) {
      VecSum<T> acc;
      for (uint32_t m = mask; m; m &= m - 1)
        acc.add(plat::load_peer(reinterpret_cast<const vec16_t*>(comb_relay + (size_t(j) * kG + plat::lowest_bit(m)) * kTok) + v));
      reinterpret_cast<vec16_t*>(out)[v] = acc.pack();
    }
    if (weights && lane < kK) {
      float s = 0.f;
      for (uint32_t m = mask; m; m &= m - 1)
        s += plat::load_peer_f32(comb_relay_wts + (size_t(j) * kG + plat::lowest_bit(m)) * kK + lane);
      if (float* pw = Direct<kCfg>(a, comb_recv_wts + at * kK, home)) pw[lane] = s;
      else stage_wts[size_t(j) * kK + lane] = s;
    }
    if (p == nullptr) {
      __syncwarp();
      transport::put_warp(dst, stage + size_t(j) * kTok, kTok, home);
      if (weights) transport::put_warp(comb_recv_wts + at * kK, stage_wts + size_t(j) * kK, kK * 4, home);
    }
  }
  SignalAfterBlock<kCfg>(a, kSigCombFwdDone, BlockShare(), SameLocalIndex<kCfg>(rank));
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void V2CombineRecv(const EpNetArgs& a, const NetEpochs& e) {
  constexpr int kK = kCfg.numExpertPerToken, kG = kCfg.gpuPerNode;
  WaitRanks<kCfg>(a, kSigCombFwdDone, (e.combFwd + 1) * kDoneUnit, kNetWaitCombineForwardDone,
                  SameLocalIndex<kCfg>(a.rank));
  ReportShortPeers(a, kCfg.worldSize, int(e.comb + 1));
  const int lane = plat::lane_id();
  const int* tok_dest = Local<int>(a, a.off_tok_dest);
  for (int t = GridWarp<kCfg>(); t < a.numTokens; t += GridWarps<kCfg>()) {
    if constexpr (NetWire<kCfg>::kQuant) {  // (the forwarders passed every rank's row on)
      int dest[kK];
      const int nd = TokenDestRanks<kCfg>(a, t, dest);
      SumCombRows<kCfg, T>(a, t, dest, nd);
      continue;
    }
    const int pe = lane < kK ? tok_dest[t * kK + lane] : -1;
    int nodes[kK];  // the token's distinct destination nodes, the same in every lane
    int nn = 0;
    for (int j = 0; j < kK; ++j) {
      const int pj = plat::shfl(pe, j);
      bool fresh = pj >= 0;
      for (int q = 0; q < nn; ++q) fresh = fresh && nodes[q] != pj / kG;
      if (fresh) nodes[nn++] = pj / kG;
    }
    SumCombRows<kCfg, T>(a, t, nodes, nn);
  }
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetV2Combine(const EpNetArgs& a) {
  const NetEpochs e = LegEpochs<kCfg>(a, kSigCombDone);
  if constexpr (kCfg.phase != EpPhase::Recv) V2CombineSend<kCfg, T>(a, e);
  if constexpr (kCfg.phase != EpPhase::Send) {
    V2CombineForward<kCfg, T>(a, e);
    V2CombineRecv<kCfg, T>(a, e);
  }
}

}  // namespace mori::epnet
