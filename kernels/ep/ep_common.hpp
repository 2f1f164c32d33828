// What both EP kernels share: arena addressing, the sync words and cross-device flags, phase
// stamps, bounded spin-waits, the blocks' shares of a done count, and the copy loops' work item.
#pragma once
#include "common/types.hpp"
#include "ep/ep_generated.hpp"
#include "ep/ep_report.hpp"

namespace mori::ep {

using plat::vec16_t;

constexpr int kMaxPeers = sizeof(EpArgs::peerBase) / sizeof(uint64_t);
// WaitId, ErrCode, XdbRow, SyncWord (the local `sync` region's words), FlagUnit and Stamp (the
// phase-timestamp slots; one thread's store each, negligible cost) are generated into
// ep_generated.hpp: the host decodes them or sizes their regions by them.

template <typename P>
MORI_DEVICE P* At(const EpArgs& a, int pe, uint64_t off) {
  return reinterpret_cast<P*>(a.peerBase[pe] + off);
}

// Rank masking: a masked rank's experts are dropped at the claim, and no kernel sends to, counts
// for or waits for it (the op writes rank_mask between calls; each kernel reads it, so a captured
// graph follows a change).
MORI_DEVICE bool Masked(const EpArgs& a, int pe) { return At<const int>(a, a.rank, a.off_rank_mask)[pe] != 0; }
// The dispatch's count of the (token, expert) pairs it dropped for a masked rank: two words by
// epoch parity, then the last dispatch's (published by its block 0).
MORI_DEVICE unsigned* MaskedPairs(const EpArgs& a) { return At<unsigned>(a, a.rank, a.off_masked_pairs); }
MORI_DEVICE uint64_t* SyncWords(const EpArgs& a) { return At<uint64_t>(a, a.rank, a.off_sync); }
// The word of claim counter w (a pair of the sync words) that a combine of epoch parity p (its
// epoch & 1) uses; the count is its low 32 bits (Claims).
MORI_DEVICE uint64_t* ClaimWord(uint64_t* sync, SyncWord w, int p) { return sync + (w + p); }
MORI_DEVICE unsigned* Claims(uint64_t* sync, SyncWord w, int p) { return reinterpret_cast<unsigned*>(ClaimWord(sync, w, p)); }
MORI_DEVICE void StampAt(const EpArgs& a, Stamp s) { At<uint64_t>(a, a.rank, a.off_stamps)[s] = plat::now_ns(); }
// The latest of several blocks' times t at slot s (fire and forget).
MORI_DEVICE void StampMax(const EpArgs& a, Stamp s, uint64_t t) { plat::max_relaxed_device(At<uint64_t>(a, a.rank, a.off_stamps) + s, t); }
MORI_DEVICE uint64_t* XdbFlags(const EpArgs& a, int pe, int row) {
  return At<uint64_t>(a, pe, a.off_xdb) + row * kMaxPeers;
}

// Record a device error for the host (ep_report.hpp: the first failure of this rank claims the words).
MORI_DEVICE void RecordError(const EpArgs& a, ErrCode code, uint64_t detail, uint64_t extra) {
  ep_report::RecordErrorWords(a, SyncWords(a) + kErrClaim, code, detail, extra);
}

// The detail words the host decodes (decode_error) for the two errors a peer causes: a wait that
// timed out (ep_report.hpp) and a peer's short combine input.
using ep_report::TimeoutDetail;
MORI_DEVICE constexpr uint64_t PeerShortDetail(uint64_t peer, uint64_t rank) { return (peer << 32) | (rank << 16); }

// Spin until *flag >= target; returns the value seen, which is below target only after
// args.timeoutNs (the timeout is recorded).
MORI_DEVICE uint64_t WaitAtLeast(const EpArgs& a, const uint64_t* flag, uint64_t target, WaitId wait, int peer) {
  return ep_report::SpinAtLeast(flag, target, a.timeoutNs, [&](uint64_t t) {
    RecordError(a, kErrTimeout, TimeoutDetail(wait, peer, a.rank), t);
  });
}

// Order the block's earlier accesses (its stores, to peers too, and its loads) system-wide before
// thread 0's next access. Where the platform allows (plat::kFenceEveryWave false), that is one
// fence by thread 0 after the barrier (cumulative over the block's accesses); otherwise every wave
// fences its own first.
MORI_DEVICE void FenceBlockSystem() {
  if constexpr (plat::kFenceEveryWave) plat::fence_system();
  __syncthreads();
  if (threadIdx.x == 0) plat::fence_system();
}

// Order the block's earlier accesses of this GPU's own memory (its loads, and the low-latency
// combine's stores that set comb_recv words back to empty) before thread 0's next access: a relaxed
// system-scope count that lets a peer overwrite that memory may follow. Performed at device scope,
// a load has its value and a store is in this GPU's L2, which is where a peer's stores land too,
// after the peer has seen the count; so a device-scope fence is enough (the system-scope one took
// 1.4 us here against 0.4: docs/performance.md). NCCL returns a receive credit with no fence at all.
MORI_DEVICE void FenceBlockLocalDevice() {
  if constexpr (plat::kFenceEveryWave) plat::fence_device();
  __syncthreads();
  if (threadIdx.x == 0) plat::fence_device();
}

// This block's share of a done counter's kDoneUnit (ep_report.hpp).
MORI_DEVICE uint64_t BlockShare() { return ep_report::BlockShare(kDoneUnit); }
// The combines done on this rank: its own combine-done count, in units (read at a kernel's start:
// the shares of its own blocks cannot make a unit).
MORI_DEVICE uint64_t CombEpoch(const EpArgs& a) { return XdbFlags(a, a.rank, kXdbCombine)[a.rank] / kDoneUnit; }

// The work item of both kernels' copy loops: one chunk of a token's row, kW * vecUnroll 16-byte
// vectors (one load per unroll slot per lane), so a row is kChunks items.
template <EpCfg kCfg>
constexpr int kChunkVecs = kCfg.waveSize * kCfg.vecUnroll;
template <EpCfg kCfg>
constexpr int kChunks = (EpTokenBytes(kCfg) / 16 + kChunkVecs<kCfg> - 1) / kChunkVecs<kCfg>;

}  // namespace mori::ep
