// What the internode kernel families share: arena addressing, signal rows and bounded waits on
// them, error reports, completion before a signal, warp copies, and the fp32 row sums.
#pragma once
#include "common/types.hpp"
#include "ep/ep_net_generated.hpp"

namespace mori::epnet {

using plat::vec16_t;

template <typename P>
MORI_DEVICE P* Local(const EpNetArgs& a, uint64_t off) {
  return reinterpret_cast<P*>(a.base + off);
}

// Row `row` of the signals region: one u64 word per writing rank.
template <EpNetCfg kCfg>
MORI_DEVICE uint64_t* Signals(const EpNetArgs& a, NetSignal row) {
  return Local<uint64_t>(a, a.off_signals) + uint64_t(row) * kCfg.worldSize;
}

// The first thread of this rank to fail claims the error words (sync word 0), so the host reads
// one report whole, and it is the first error until op.reset().
MORI_DEVICE void RecordError(const EpNetArgs& a, ErrCode code, uint64_t detail, uint64_t extra) {
  if (plat::atomic_add_device(reinterpret_cast<unsigned*>(Local<uint64_t>(a, a.off_sync)), 1u) != 0) return;
  volatile uint64_t* err = a.errWord;
  err[1] = detail;
  err[2] = extra;
  plat::fence_system();
  err[0] = code;
}

MORI_DEVICE constexpr uint64_t TimeoutDetail(NetWaitId wait, uint64_t peer, uint64_t rank) {
  return (uint64_t(wait) << 48) | (peer << 32) | (rank << 16);
}

// A sender whose combine input is short (fewer rows than it received) tells the home rank of each
// row it cannot send (a put of the combine epoch into the home's comb_short[sender]); the home's
// receive pass reports every sender that did so in this epoch. Rows [rows, total) are the missing ones.
MORI_DEVICE void MarkShortRows(const EpNetArgs& a, int rows, int total, int maxTokPerRank, int epoch, int warp,
                               int warps) {
  int* marks = Local<int>(a, a.off_comb_short);
  const int* recv_to_src = Local<int>(a, a.off_recv_to_src);
  if (plat::lane_id() != 0) return;
  for (int i = rows + warp; i < total; i += warps) transport::put_int(marks + a.rank, epoch, recv_to_src[i] / maxTokPerRank);
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
  if (plat::load_acquire_system(flag) >= target) return;
  const uint64_t t0 = plat::now_ns();
  while (plat::load_acquire_system(flag) < target) {
    if (plat::now_ns() - t0 > uint64_t(a.timeoutNs)) {
      RecordError(a, kErrTimeout, TimeoutDetail(wait, peer, a.rank), target);
      return;
    }
  }
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
  for (int i = threadIdx.x; i < ranks.count; i += blockDim.x) WaitAtLeast(a, words + ranks[i], target, wait, ranks[i]);
  __syncthreads();
}
template <EpNetCfg kCfg>
MORI_DEVICE void WaitEveryRank(const EpNetArgs& a, NetSignal row, uint64_t target, NetWaitId wait) {
  WaitRanks<kCfg>(a, row, target, wait, EveryRank<kCfg>());
}

// This rank's own count in `row` (on itself): read by a pass whose rank's earlier pass signalled it.
template <EpNetCfg kCfg>
MORI_DEVICE uint64_t OwnCount(const EpNetArgs& a, NetSignal row) {
  return plat::load_acquire_system(Signals<kCfg>(a, row) + a.rank);
}

// This block's share of a done unit: a rank's blocks add kDoneUnit in all per epoch, whatever its
// grid (a launch's partial sum stays below a unit, so count / kDoneUnit is the epochs done).
MORI_DEVICE uint64_t BlockShare() { return blockIdx.x == 0 ? kDoneUnit - (gridDim.x - 1) : 1; }

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
  for (int i = 0; i < ranks.count; ++i) transport::signal_add(word, value, ranks[i]);
}
template <EpNetCfg kCfg>
MORI_DEVICE void SignalEveryRank(const EpNetArgs& a, NetSignal row, uint64_t value) {
  CompleteBlock<kCfg>();
  if (threadIdx.x == 0) SignalRanks<kCfg>(a, row, value, EveryRank<kCfg>());
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
    if constexpr (sizeof(T) == 4) {
      for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(v[i]);
    } else {
      for (int i = 0; i < 4; ++i)
        w[i] = uint32_t(from_f32<T>(v[2 * i]).bits) | (uint32_t(from_f32<T>(v[2 * i + 1]).bits) << 16);
    }
    return vec16_t{w[0], w[1], w[2], w[3]};
  }
};

}  // namespace mori::epnet
