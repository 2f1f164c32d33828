// Internode EP, low-latency family (`v2_ll`): every rank writes straight to every destination rank
// through the transport (kernels/transport/*.hpp, included before this header), by plain stores
// where a destination on this node is reachable by them and by the engine's puts otherwise.
//
// A leg is two passes (two kernels, launched in order on one stream):
//   dispatch_send  waits until each peer has read its previous combine input and reset its slot
//                  counter; then one warp per token drops invalid ids and repeated ranks (dedup),
//                  claims one receive slot per destination rank (a remote fetch-add on its
//                  counter), writes the row, weights, ids and reverse map there, records the
//                  token's destinations locally, and each block signals its share of a done unit
//                  to every rank.
//   dispatch_recv  waits for every source's done unit, publishes total_recv, resets the counter
//                  and signals every rank that its slots are free again.
//   combine_send   one warp per received row pushes the expert output (and weights) into the
//                  home rank's comb_recv[this rank, token]; each block signals its share.
//   combine_recv   waits for every rank's done unit and sums each token's rows from its distinct
//                  destination ranks in fp32; a sender whose short input dropped rows of this rank's
//                  tokens has marked comb_short, and is reported.
// Stream order between passes replaces any wait of a block on another block of its own rank, so no
// grid needs to be resident as a whole. Epochs are the done counts themselves (kept on the device:
// a captured graph stays right on every replay); a rank's own count is complete when the pass
// that follows its send pass reads it.
#pragma once
#include "ep/ep_net_common.hpp"

namespace mori::epnet {

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetLlDispatchSend(const EpNetArgs& a) {
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kTok = NetTokenBytes(kCfg);
  const int rank = a.rank, lane = plat::lane_id();
  // this rank's epochs: its own counts (the previous combine is complete; this launch's shares of
  // the dispatch count stay below a unit)
  const uint64_t de = OwnCount<kCfg>(a, kSigDispDone) / kDoneUnit;
  const uint64_t ce = OwnCount<kCfg>(a, kSigCombDone) / kDoneUnit;
  WaitEveryRank<kCfg>(a, kSigCombDone, ce * kDoneUnit, kNetWaitPeerCombine);
  WaitEveryRank<kCfg>(a, kSigSlotsFree, de, kNetWaitPeerSlots);

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
  const int warps = gridDim.x * kCfg.warpPerBlock;
  for (int t = blockIdx.x * kCfg.warpPerBlock + plat::wave_id(); t < a.numTokens; t += warps) {
    const int e = lane < kK ? a.inpIndices[t * kK + lane] : -1;
    int pe = (e >= 0 && e < NetNumExperts(kCfg)) ? e / kCfg.numExpertPerRank : -1;
    for (int j = 0; j < kK; ++j) {  // dedup: a lane whose rank an earlier lane holds sends nothing
      const int pj = plat::shfl(pe, j);
      if (j < lane && pj == pe) pe = -1;
    }
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

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetLlDispatchRecv(const EpNetArgs& a) {
  // this rank's own done count is complete (its send pass has ended): every source reaches it
  const uint64_t target = OwnCount<kCfg>(a, kSigDispDone);
  WaitEveryRank<kCfg>(a, kSigDispDone, target, kNetWaitDispatchDone);
  if (threadIdx.x == 0) {
    int* cnt = Local<int>(a, a.off_recv_cnt);
    *Local<int>(a, a.off_total_recv) = plat::load_volatile(cnt);
    *cnt = 0;  // no claim can land now: every source waits for the signal below first
  }
  SignalEveryRank<kCfg>(a, kSigSlotsFree, 1);
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetLlCombineSend(const EpNetArgs& a) {
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kTok = NetTokenBytes(kCfg);
  const int rank = a.rank, lane = plat::lane_id();
  const int total = *Local<int>(a, a.off_total_recv);
  const int rows = total < a.inpRows ? total : a.inpRows;
  const int warps = gridDim.x * kCfg.warpPerBlock, warp = blockIdx.x * kCfg.warpPerBlock + plat::wave_id();
  if (a.inpRows < total) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      RecordError(a, kErrShortInput, uint64_t(rank) << 16, (uint64_t(total) << 32) | uint32_t(a.inpRows));
    MarkShortRows(a, rows, total, kM, int(OwnCount<kCfg>(a, kSigCombDone) / kDoneUnit + 1), warp, warps);
  }
  const int* recv_to_src = Local<int>(a, a.off_recv_to_src);
  char* comb_recv = Local<char>(a, a.off_comb_recv);
  float* comb_recv_wts = Local<float>(a, a.off_comb_recv_wts);
  char* stage = Local<char>(a, a.off_comb_stage);
  float* stage_wts = Local<float>(a, a.off_comb_stage_wts);
  const char* inp = static_cast<const char*>(a.inpTok);
  const bool weights = a.inpWeights != nullptr;
  for (int i = warp; i < rows; i += warps) {
    const int src = recv_to_src[i], home = src / kM;
    const size_t at = size_t(rank) * kM + src % kM;
    char* row = comb_recv + at * kTok;
    float* wts = comb_recv_wts + at * kK;
    if (char* p = Direct<kCfg>(a, row, home)) {
      WarpCopy(p, inp + size_t(i) * kTok, kTok);
      if (weights && lane < kK) Direct<kCfg>(a, wts, home)[lane] = a.inpWeights[size_t(i) * kK + lane];
    } else {
      WarpCopy(stage + size_t(i) * kTok, inp + size_t(i) * kTok, kTok);
      if (weights && lane < kK) stage_wts[size_t(i) * kK + lane] = a.inpWeights[size_t(i) * kK + lane];
      __syncwarp();
      transport::put_warp(row, stage + size_t(i) * kTok, kTok, home);
      if (weights) transport::put_warp(wts, stage_wts + size_t(i) * kK, kK * 4, home);
    }
  }
  SignalEveryRank<kCfg>(a, kSigCombDone, BlockShare());
}

template <EpNetCfg kCfg, typename T>
MORI_DEVICE void NetLlCombineRecv(const EpNetArgs& a) {
  constexpr int kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank, kTok = NetTokenBytes(kCfg);
  const uint64_t target = OwnCount<kCfg>(a, kSigCombDone);
  WaitEveryRank<kCfg>(a, kSigCombDone, target, kNetWaitCombineDone);
  ReportShortPeers(a, kCfg.worldSize, int(target / kDoneUnit));
  const int lane = plat::lane_id();
  const int* tok_dest = Local<int>(a, a.off_tok_dest);
  const char* comb_recv = Local<char>(a, a.off_comb_recv);
  const float* comb_recv_wts = Local<float>(a, a.off_comb_recv_wts);
  const int warps = gridDim.x * kCfg.warpPerBlock;
  for (int t = blockIdx.x * kCfg.warpPerBlock + plat::wave_id(); t < a.numTokens; t += warps) {
    const int mine = lane < kK ? tok_dest[t * kK + lane] : -1;
    int dest[kK];  // the token's distinct destination ranks, the same in every lane
    int nd = 0;
    for (int j = 0; j < kK; ++j) {
      const int pj = plat::shfl(mine, j);
      if (pj >= 0) dest[nd++] = pj;
    }
    for (int v = lane; v < kTok / 16; v += plat::kWaveSize) {
      VecSum<T> acc;
      for (int d = 0; d < nd; ++d)
        acc.add(plat::load_peer(reinterpret_cast<const vec16_t*>(comb_recv + (size_t(dest[d]) * kM + t) * kTok) + v));
      reinterpret_cast<vec16_t*>(static_cast<char*>(a.outTok) + size_t(t) * kTok)[v] = acc.pack();
    }
    if (a.outWeights != nullptr && lane < kK) {
      float s = 0.f;
      for (int d = 0; d < nd; ++d) s += plat::load_peer_f32(comb_recv_wts + (size_t(dest[d]) * kM + t) * kK + lane);
      a.outWeights[t * kK + lane] = s;
    }
  }
}

}  // namespace mori::epnet
