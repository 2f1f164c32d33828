// Internode EP, low-latency family (`v2_ll`): every rank writes straight to every destination rank
// through the transport (kernels/transport/*.hpp, included before this header), by plain stores
// where a destination on this node is reachable by them and by the engine's puts otherwise.
//
// A leg is one kernel (one host launch) in two phases:
//   dispatch, send     waits until each peer has read its previous combine input and reset its slot
//                      counter; then one warp per token drops invalid ids and repeated ranks (dedup),
//                      claims one receive slot per destination rank (a remote fetch-add on its
//                      counter), writes the row, weights, ids and reverse map there, records the
//                      token's destinations locally, and each block signals its share of a done unit
//                      to every rank.
//   dispatch, receive  block 0: waits for every source's done unit (this rank's blocks included),
//                      publishes total_recv, resets the counter and signals every rank that its
//                      slots are free again.
//   combine, send      one warp per received row pushes the expert output (and weights) into the
//                      home rank's comb_recv[this rank, token] (cast on the way under the fp8 wire,
//                      ep_net_combine.hpp); each block signals its share.
//   combine, receive   every block waits for every rank's done unit and sums each token's rows from
//                      its distinct destination ranks in fp32, in top-k slot order; a sender whose
//                      short input dropped rows of this rank's tokens has marked comb_short, and is
//                      reported.
// A receive phase waits for this rank's own blocks through the same signals as for its peers, so a
// leg's blocks must be resident together: the grid never exceeds the rank's share of the SMs
// (backends/hip/common/grid.py), as for the intranode kernels. Epochs are the done counts themselves (kept on the
// device: a captured graph stays right on every replay), read at each block's start (NetEpochs).
// The split legs (kCfg.phase) run each phase as its own kernel: the send kernel ends after its
// done signal, waiting for nothing but the dispatch's two waits before its first store (the peers'
// previous combine send and dispatch receive); the receive kernel (the dispatch's: one block) waits
// for its own rank's send through the signal the ended send kernel raised, and reads its epochs
// through LegEpochs.
// Rank masking (docs/design.md §6): a valid id of a masked rank's expert is dropped as an invalid
// one and counted (masked_pairs); no phase claims on, writes to, signals or waits for a masked rank
// (the helpers of ep_net_common.hpp skip it), and the combine sums the live ranks' rows only.
#pragma once
#include "ep/ep_net_combine.hpp"

namespace mori::epnet {

// The dispatch's count of the (token, expert) pairs it dropped for a masked rank: two words by the
// dispatch epoch's parity (this rank's blocks add), then the last dispatch's (block 0 publishes).
MORI_DEVICE unsigned* MaskedPairs(const EpNetArgs& a) { return Local<unsigned>(a, a.off_masked_pairs); }

// DistinctDestRank less the masked ranks; lane 0 adds the warp's pairs of a masked rank's expert
// to `drops`.
template <EpNetCfg kCfg>
MORI_DEVICE int LiveDestRank(const EpNetArgs& a, int t, unsigned* drops) {
  constexpr int kK = kCfg.numExpertPerToken;
  const int lane = plat::lane_id();
  const int e = lane < kK ? a.inpIndices[t * kK + lane] : -1;
  const uint64_t masked = plat::ballot(e >= 0 && e < NetNumExperts(kCfg) && Masked(a, e / kCfg.numExpertPerRank));
  if (lane == 0 && masked) plat::atomic_add_device(drops, unsigned(plat::popcount(masked)));
  const int pe = DistinctDestRank<kCfg>(a, t);
  return pe >= 0 && Masked(a, pe) ? -1 : pe;
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void LlDispatchSend(const EpNetArgs& a, const NetEpochs& e) {
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kTok = NetTokenBytes(kCfg);
  const int rank = a.rank, lane = plat::lane_id();
  WaitEveryRank<kCfg>(a, kSigCombDone, e.comb * kDoneUnit, kNetWaitPeerCombine);
  WaitEveryRank<kCfg>(a, kSigSlotsFree, e.disp, kNetWaitPeerSlots);

  int* tok_dest = Local<int>(a, a.off_tok_dest);
  int* recv_cnt = Local<int>(a, a.off_recv_cnt);
  char* disp_out = Local<char>(a, a.off_disp_out);
  float* out_wts = Local<float>(a, a.off_out_wts);
  int* out_idx = Local<int>(a, a.off_out_idx);
  int* recv_to_src = Local<int>(a, a.off_recv_to_src);
  char* stage = Local<char>(a, a.off_disp_stage);
  int* stage_meta = Local<int>(a, a.off_disp_stage_meta);
  const char* inp = static_cast<const char*>(a.inpTok);
  const bool weights = a.inpWeights != nullptr;
  unsigned* drops = MaskedPairs(a) + ((e.disp + 1) & 1);  // (this dispatch's epoch)
  for (int t = GridWarp<kCfg>(); t < a.numTokens; t += GridWarps<kCfg>()) {
    const int pe = LiveDestRank<kCfg>(a, t, drops);
    if (lane < kK) tok_dest[t * kK + lane] = pe;
    // one claim per destination rank, all in flight at once
    const int slot = pe >= 0 ? transport::atomic_fetch_add(recv_cnt, 1, pe) : -1;
    const bool put = pe >= 0 && Direct<kCfg>(a, disp_out, pe) == nullptr;
    if (plat::wave_any(put)) {  // a put's source is symmetric: stage the token once
      WarpCopy(stage + size_t(t) * kTok, inp + size_t(t) * kTok, kTok);
      if (lane < kK) {
        stage_meta[t * 2 * kK + lane] = weights ? __float_as_int(a.inpWeights[t * kK + lane]) : 0;
        stage_meta[t * 2 * kK + kK + lane] = a.inpIndices[t * kK + lane];
      }
      __syncwarp();
    }
    for (uint64_t m = plat::ballot(pe >= 0); m; m &= m - 1) {
      const int j = plat::lowest_bit(m);
      const int dpe = plat::shfl(pe, j), s = plat::shfl(slot, j);
      char* row = disp_out + size_t(s) * kTok;
      if (char* p = Direct<kCfg>(a, row, dpe)) {
        WarpCopy(p, inp + size_t(t) * kTok, kTok);
        if (lane < kK) {
          if (weights) Direct<kCfg>(a, out_wts, dpe)[s * kK + lane] = a.inpWeights[t * kK + lane];
          Direct<kCfg>(a, out_idx, dpe)[s * kK + lane] = a.inpIndices[t * kK + lane];
        }
        if (lane == 0) Direct<kCfg>(a, recv_to_src, dpe)[s] = rank * kM + t;
      } else {
        transport::put_warp(row, stage + size_t(t) * kTok, kTok, dpe);
        if (weights) transport::put_warp(out_wts + s * kK, stage_meta + t * 2 * kK, kK * 4, dpe);
        transport::put_warp(out_idx + s * kK, stage_meta + t * 2 * kK + kK, kK * 4, dpe);
        if (lane == 0) transport::put_int(recv_to_src + s, rank * kM + t, dpe);
      }
    }
  }
  SignalEveryRank<kCfg>(a, kSigDispDone, BlockShare());
}

// (block 0, after its send phase)
template <EpNetCfg kCfg, typename T>
MORI_DEVICE void LlDispatchRecv(const EpNetArgs& a, const NetEpochs& e) {
  WaitEveryRank<kCfg>(a, kSigDispDone, (e.disp + 1) * kDoneUnit, kNetWaitDispatchDone);
  PublishTotalRecv(a);
  if (threadIdx.x == 0) {  // (this rank's blocks are done: their adds are in)
    unsigned* drops = MaskedPairs(a);
    const int parity = int((e.disp + 1) & 1);
    drops[2] = unsigned(plat::load_volatile(reinterpret_cast<const int*>(drops + parity)));
    drops[parity] = 0;
  }
  SignalEveryRank<kCfg>(a, kSigSlotsFree, 1);
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetLlDispatch(const EpNetArgs& a) {
  const NetEpochs e = LegEpochs<kCfg>(a, kSigDispDone);
  if constexpr (kCfg.phase != EpPhase::Recv) LlDispatchSend<kCfg, T>(a, e);
  if constexpr (kCfg.phase != EpPhase::Send) {
    if (blockIdx.x == 0) LlDispatchRecv<kCfg, T>(a, e);
  }
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void LlCombineSend(const EpNetArgs& a, const NetEpochs& e) {
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kRow = NetWireBytes(kCfg);
  const int rows = CombineInputRows<kCfg>(a, e.comb + 1);
  const int* recv_to_src = Local<int>(a, a.off_recv_to_src);
  char* comb_recv = Local<char>(a, a.off_comb_recv);
  float* comb_recv_wts = Local<float>(a, a.off_comb_recv_wts);
  for (int i = GridWarp<kCfg>(); i < rows; i += GridWarps<kCfg>()) {
    const int src = recv_to_src[i];
    if (Masked(a, src / kM)) continue;  // (a row of a rank masked since the dispatch: no home to sum it)
    const size_t at = size_t(a.rank) * kM + src % kM;  // comb_recv[this rank, token] on the home rank
    PushCombineRow<kCfg>(a, i, comb_recv + at * kRow, comb_recv_wts + at * kK, src / kM);
  }
  SignalEveryRank<kCfg>(a, kSigCombDone, BlockShare());
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void LlCombineRecv(const EpNetArgs& a, const NetEpochs& e) {
  WaitEveryRank<kCfg>(a, kSigCombDone, (e.comb + 1) * kDoneUnit, kNetWaitCombineDone);
  ReportShortPeers(a, kCfg.worldSize, int(e.comb + 1));
  for (int t = GridWarp<kCfg>(); t < a.numTokens; t += GridWarps<kCfg>()) {
    int dest[kCfg.numExpertPerToken];
    const int nd = TokenDestRanks<kCfg>(a, t, dest);
    SumCombRows<kCfg, T>(a, t, dest, nd);
  }
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetLlCombine(const EpNetArgs& a) {
  const NetEpochs e = LegEpochs<kCfg>(a, kSigCombDone);
  if constexpr (kCfg.phase != EpPhase::Recv) LlCombineSend<kCfg, T>(a, e);
  if constexpr (kCfg.phase != EpPhase::Send) LlCombineRecv<kCfg, T>(a, e);
}

}  // namespace mori::epnet
