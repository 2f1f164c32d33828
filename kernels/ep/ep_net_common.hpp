// What the internode kernel families share: arena addressing, signal rows and bounded waits on
// them, error reports, completion before a signal, warp copies, and the steps both families take
// alike (a token's distinct destination ranks, the receive count, the combine's input rows); the
// combine rows' push, forward and sum are in ep_net_combine.hpp.
#pragma once
#include "common/types.hpp"
#include "ep/ep_net_generated.hpp"
#include "ep/ep_report.hpp"

namespace mori::epnet {

using plat::vec16_t;

template <typename P>
MORI_DEVICE P* Local(const EpNetArgs& a, uint64_t off) {
  return reinterpret_cast<P*>(a.base + off);
}

// Rank masking (docs/design.md §6): the op writes rank_mask between calls and every kernel reads it,
// so a captured graph follows a change. No wait, signal or put of these helpers concerns a masked
// rank; v2_ll also drops a masked rank's experts (ep_net_ll.hpp). An op that builds v2 refuses
// masking, so v2 reads an all-zero mask here.
MORI_DEVICE bool Masked(const EpNetArgs& a, int pe) { return Local<const int>(a, a.off_rank_mask)[pe] != 0; }

// Row `row` of the signals region: one u64 word per writing rank.
template <EpNetCfg kCfg>
MORI_DEVICE uint64_t* Signals(const EpNetArgs& a, NetSignal row) {
  return Local<uint64_t>(a, a.off_signals) + uint64_t(row) * kCfg.worldSize;
}

// Record a device error for the host (ep_report.hpp); sync word 0 is the claim.
MORI_DEVICE void RecordError(const EpNetArgs& a, ErrCode code, uint64_t detail, uint64_t extra) {
  ep_report::RecordErrorWords(a, Local<uint64_t>(a, a.off_sync), code, detail, extra);
}

// A sender whose combine input is short (fewer rows than it received) tells the home rank of each
// row it cannot send (a put of the combine epoch into the home's comb_short[sender]); the home's
// receive phase reports every sender that did so in this epoch. Rows [rows, total) are the missing ones.
MORI_DEVICE void MarkShortRows(const EpNetArgs& a, int rows, int total, int maxTokPerRank, int epoch, int warp,
                               int warps) {
  int* marks = Local<int>(a, a.off_comb_short);
  const int* recv_to_src = Local<int>(a, a.off_recv_to_src);
  if (plat::lane_id() != 0) return;
  for (int i = rows + warp; i < total; i += warps) {
    const int home = recv_to_src[i] / maxTokPerRank;
    if (!Masked(a, home)) transport::put_int(marks + a.rank, epoch, home);
  }
}
MORI_DEVICE void ReportShortPeers(const EpNetArgs& a, int worldSize, int epoch) {
  if (blockIdx.x != 0) return;
  const int* marks = Local<int>(a, a.off_comb_short);
  for (int pe = threadIdx.x; pe < worldSize; pe += blockDim.x)
    if (plat::load_volatile(marks + pe) == epoch)
      RecordError(a, kErrPeerShortInput, (uint64_t(pe) << 32) | (uint64_t(a.rank) << 16), 0);
}

// Spin until *flag >= target (a word peers signal); gives up after args.timeoutNs and records which
// wait, for which peer, on which rank.
MORI_DEVICE void WaitAtLeast(const EpNetArgs& a, const uint64_t* flag, uint64_t target, NetWaitId wait, int peer) {
  ep_report::SpinAtLeast(flag, target, a.timeoutNs, [&](uint64_t t) {
    RecordError(a, kErrTimeout, ep_report::TimeoutDetail(wait, peer, a.rank), t);
  });
}

// Ranks first, first + stride, ... (count of them): every rank, a node's ranks, or the ranks of one
// local index on every node.
struct Ranks {
  int first, count, stride;
  MORI_DEVICE int operator[](int i) const { return first + i * stride; }
};
template <EpNetCfg kCfg>
MORI_DEVICE Ranks EveryRank() { return {0, kCfg.worldSize, 1}; }
template <EpNetCfg kCfg>
MORI_DEVICE Ranks NodeOf(int rank) { return {rank / kCfg.gpuPerNode * kCfg.gpuPerNode, kCfg.gpuPerNode, 1}; }
template <EpNetCfg kCfg>
MORI_DEVICE Ranks SameLocalIndex(int rank) {
  return {rank % kCfg.gpuPerNode, kCfg.worldSize / kCfg.gpuPerNode, kCfg.gpuPerNode};
}

// Wait, thread by thread over `ranks`, until each one's word of `row` reaches `target`.
template <EpNetCfg kCfg>
MORI_DEVICE void WaitRanks(const EpNetArgs& a, NetSignal row, uint64_t target, NetWaitId wait, Ranks ranks) {
  const uint64_t* words = Signals<kCfg>(a, row);
  for (int i = threadIdx.x; i < ranks.count; i += blockDim.x)
    if (!Masked(a, ranks[i])) WaitAtLeast(a, words + ranks[i], target, wait, ranks[i]);
  __syncthreads();
}
template <EpNetCfg kCfg>
MORI_DEVICE void WaitEveryRank(const EpNetArgs& a, NetSignal row, uint64_t target, NetWaitId wait) {
  WaitRanks<kCfg>(a, row, target, wait, EveryRank<kCfg>());
}

// This rank's own count in `row` (on itself).
template <EpNetCfg kCfg>
MORI_DEVICE uint64_t OwnCount(const EpNetArgs& a, NetSignal row) {
  return plat::load_acquire_system(Signals<kCfg>(a, row) + a.rank);
}

// The epochs a leg waits against: this rank's own counts of the earlier legs, read by each block
// before it signals anything. Earlier kernels have ended, so their counts are complete; a row this
// launch signals holds, until every block has signalled, its shares of less than one unit, which
// the division drops (relayFree is a count of whole signals, and a whole v2 dispatch adds to it only
// after every block's send phase, so after every block's read; a v2 dispatch receive kernel, whose
// forward adds to it, never uses it).
struct NetEpochs {
  uint64_t disp;  // dispatches so far (both families)
  uint64_t comb;  // combines so far (both families)
  uint64_t relayFree;  // v2: forwards of this rank's relay rows so far (signals, not units)
  uint64_t fwd;  // v2: dispatches forwarded on this rank's node so far
  uint64_t combFwd;  // v2: combines whose partial sums were forwarded to this rank so far
};
template <EpNetCfg kCfg>
MORI_DEVICE NetEpochs ReadEpochs(const EpNetArgs& a) {
  return {OwnCount<kCfg>(a, kSigDispDone) / kDoneUnit, OwnCount<kCfg>(a, kSigCombDone) / kDoneUnit,
          OwnCount<kCfg>(a, kSigRelayFree), OwnCount<kCfg>(a, kSigFwdDone) / kDoneUnit,
          OwnCount<kCfg>(a, kSigCombFwdDone) / kDoneUnit};
}

// The epochs of a leg whose send signals `done` (kSigDispDone or kSigCombDone). A receive kernel of
// the split legs (kCfg.phase Recv) runs after its send kernel, which has ended (stream order) and so
// has added its whole unit to this rank's own count of `done`: its leg's epoch is one less than the
// count says, the one its send read. The send's other rows are untouched until the receive
// signals them, so both halves wait against the epochs of the whole leg.
template <EpNetCfg kCfg>
MORI_DEVICE NetEpochs LegEpochs(const EpNetArgs& a, NetSignal done) {
  NetEpochs e = ReadEpochs<kCfg>(a);
  if constexpr (kCfg.phase == EpPhase::Recv) {
    if (done == kSigDispDone) e.disp -= 1;
    else e.comb -= 1;
  }
  return e;
}

// This block's share of a done unit (ep_report.hpp).
MORI_DEVICE uint64_t BlockShare() { return ep_report::BlockShare(kDoneUnit); }

// After every thread of the block issued its stores and puts: complete them (CompleteBlock), then add
// `value` to this rank's word of `row` on some ranks (SignalRanks). Each warp completes its own puts (a network transport
// may give warps their own queues); thread 0's fence after the barrier is cumulative over the
// block's plain stores to peers.
template <EpNetCfg kCfg>
MORI_DEVICE void CompleteBlock() {
  if (plat::lane_id() == 0) transport::quiet();
  __syncthreads();
  if (threadIdx.x != 0) return;
  plat::fence_system();
  transport::quiet();
}
// (thread 0, after CompleteBlock)
template <EpNetCfg kCfg>
MORI_DEVICE void SignalRanks(const EpNetArgs& a, NetSignal row, uint64_t value, Ranks ranks) {
  uint64_t* word = Signals<kCfg>(a, row) + a.rank;
  for (int i = 0; i < ranks.count; ++i)
    if (!Masked(a, ranks[i])) transport::signal_add(word, value, ranks[i]);
}
// Every thread of the block: CompleteBlock, then thread 0's SignalRanks.
template <EpNetCfg kCfg>
MORI_DEVICE void SignalAfterBlock(const EpNetArgs& a, NetSignal row, uint64_t value, Ranks ranks) {
  CompleteBlock<kCfg>();
  if (threadIdx.x == 0) SignalRanks<kCfg>(a, row, value, ranks);
}
template <EpNetCfg kCfg>
MORI_DEVICE void SignalEveryRank(const EpNetArgs& a, NetSignal row, uint64_t value) {
  SignalAfterBlock<kCfg>(a, row, value, EveryRank<kCfg>());
}

// The warp copies `bytes` (a multiple of 16) from src to dst with 16-byte vectors.
MORI_DEVICE void WarpCopy(void* dst, const void* src, int bytes) {
  auto* d = static_cast<vec16_t*>(dst);
  const auto* s = static_cast<const vec16_t*>(src);
  for (int v = plat::lane_id(); v < bytes / 16; v += plat::kWaveSize) d[v] = s[v];
}

// A pointer to `p` on `pe` for plain stores when `pe` is on this node and reachable by them; null
// when the row must travel as a put (another node: the network's path, even where P2P would reach).
template <EpNetCfg kCfg, typename P>
MORI_DEVICE P* Direct(const EpNetArgs& a, P* p, int pe) {
  if (pe / kCfg.gpuPerNode != a.rank / kCfg.gpuPerNode) return nullptr;
  return transport::peer_ptr(p, pe);
}

// fp32 accumulation of 16-byte vectors of T (bf16: 8 values, fp32: 4).
template <typename T>
struct VecSum {
  static constexpr int kN = 16 / sizeof(T);
  float v[kN] = {};

  MORI_DEVICE void add(vec16_t x) {
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    if constexpr (sizeof(T) == 4) {
      for (int i = 0; i < 4; ++i) v[i] += __uint_as_float(w[i]);
    } else {
      for (int i = 0; i < 4; ++i) {
        v[2 * i] += to_f32(T{uint16_t(w[i] & 0xFFFFu)});
        v[2 * i + 1] += to_f32(T{uint16_t(w[i] >> 16)});
      }
    }
  }

  MORI_DEVICE vec16_t pack() const {
    uint32_t w[4];
    PackWords<T>(v, w);
    return vec16_t{w[0], w[1], w[2], w[3]};
  }
};

// The warp's index over the grid and the grid's warps: a phase's loops stride over rows by warp.
template <EpNetCfg kCfg>
MORI_DEVICE int GridWarp() { return blockIdx.x * kCfg.warpPerBlock + plat::wave_id(); }
template <EpNetCfg kCfg>
MORI_DEVICE int GridWarps() { return gridDim.x * kCfg.warpPerBlock; }

// Warp, token t: lane j < k holds the rank of the token's j-th expert, or -1 for an invalid id and
// for a rank an earlier lane holds (each destination rank gets the token once).
template <EpNetCfg kCfg>
MORI_DEVICE int DistinctDestRank(const EpNetArgs& a, int t) {
  constexpr int kK = kCfg.numExpertPerToken;
  const int lane = plat::lane_id();
  const int e = lane < kK ? a.inpIndices[t * kK + lane] : -1;
  int pe = (e >= 0 && e < NetNumExperts(kCfg)) ? e / kCfg.numExpertPerRank : -1;
  for (int j = 0; j < kK; ++j) {
    const int pj = plat::shfl(pe, j);
    if (j < lane && pj == pe) pe = -1;
  }
  return pe;
}

// Thread 0 of the dispatch's receive phase: publish the rows received (total_recv) and reset the
// slot counter. No claim can land meanwhile: every writer waits for the slots-free signal that follows first.
MORI_DEVICE void PublishTotalRecv(const EpNetArgs& a) {
  if (threadIdx.x != 0) return;
  int* cnt = Local<int>(a, a.off_recv_cnt);
  *Local<int>(a, a.off_total_recv) = plat::load_volatile(cnt);
  *cnt = 0;
}

// The combine input rows this rank sends: every received row, or the rows given when the input is
// short (then the error is recorded and the home ranks of the missing rows are told).
// `epoch` is this combine's (from 1).
template <EpNetCfg kCfg>
MORI_DEVICE int CombineInputRows(const EpNetArgs& a, uint64_t epoch) {
  const int total = *Local<int>(a, a.off_total_recv);
  if (a.inpRows >= total) return total;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    RecordError(a, kErrShortInput, uint64_t(a.rank) << 16, (uint64_t(total) << 32) | uint32_t(a.inpRows));
  MarkShortRows(a, a.inpRows, total, kCfg.maxTokPerRank, int(epoch), GridWarp<kCfg>(), GridWarps<kCfg>());
  return a.inpRows;
}

}  // namespace mori::epnet
