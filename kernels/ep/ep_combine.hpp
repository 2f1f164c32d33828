// EP combine kernel body: senders and summers in one grid (see ep_intranode.hpp for the protocol).
#pragma once
#include "ep/ep_combine_sender.hpp"
#include "ep/ep_combine_summer.hpp"

namespace mori::ep {

template <EpCfg kCfg, typename T>
MORI_DEVICE void EpCombineBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(EpSummable(kCfg), "combine sums: the dtype must be Bf16 or Fp32");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  static_assert(sizeof(T) == EpElemBytes(kCfg), "element type does not match the Cfg dtype");
  static_assert(kRangeTok<kCfg> <= kCfg.waveSize, "a range's slots are held one per lane");
  static_assert(kCfg.worldSize <= 8 && kMaxPeers <= 16, "ItemSources packs a source's rank in 4 bits, 8 sources");
  constexpr int kWs = kCfg.worldSize;
  // The split legs' halves (kCfg.phase): a send kernel's blocks all send, then end; a receive
  // kernel's all sum, from the rows the send kernels pushed (its own rank's pushed before it,
  // stream order), and count the combine done.
  constexpr bool kSends = kCfg.phase != EpPhase::Recv, kSums = kCfg.phase != EpPhase::Send;
  const int rank = args.rank;
  uint64_t* sync = SyncWords(args);
  // Every rank passes weights, or none does: a rank with n = 0 (possibly null y_w) still sends its
  // rows' weights to their home ranks.
  const bool sendWeights = kCfg.useWeights && args.inpWeights != nullptr;
  const bool sumWeights = sendWeights && args.outWeights != nullptr;
  // Block 0's count of the rows this rank received, checked against the input at its end (finish),
  // where it also resets the next combine's claim counters: nothing at the start waits for a load
  // but the loads every block's first push needs, issued together (SenderStart).
  int total = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    StampAt(args, kStCombStart);
    if constexpr (kSums) total = *At<int>(args, rank, args.off_total_recv);
  }

  const SenderStart start = kSends && kWs > 1 ? Sender<kCfg>::Start(args) : SenderStart{};  // in flight with the counts
  const uint64_t* numTok = XdbFlags(args, rank, kXdbNumTok);  // each peer's dispatch n (its ranges)
  int maxRanges = 0;
#pragma unroll
  for (int d = 0; d < kWs; ++d)
    if (d != rank && !Masked(args, d)) maxRanges = max(maxRanges, NumRanges<kCfg>(int(numTok[d])));
  // (maxRanges is 0 on one rank: no peers)
  const uint64_t target = CombEpoch(args) + 1;  // (read after the loads above are issued: none waits for it)
  const int parity = int(target & 1);
  const int numTasks = maxRanges * Sender<kCfg>::kDests, grid = int(gridDim.x);
  const int senders = kCfg.phase == EpPhase::Whole ? CombSenders(numTasks) : kSends ? grid : 0;
  if (kSends && kWs > 1 && int(blockIdx.x) < senders && int(blockIdx.x) < numTasks) {  // one rank: no senders
    __shared__ int sendClaims[2];
    Sender<kCfg> sender(args, target, sendWeights, numTasks, senders, sendClaims, start);
    // Before the first store: comb_recv on a peer is free once its previous combine is done. The
    // count read at the start usually says so already; then no acquire load follows it (one more
    // memory latency before the first push). The stores below depend on that read's value, and no
    // GPU performs a store before the load that decides it returns; the peer counted only after
    // its reads of comb_recv were done (FenceBlockLocalDevice), as NCCL returns a receive credit.
    if (threadIdx.x < kWs && threadIdx.x != rank && start.done < (target - 1) * kDoneUnit && !Masked(args, threadIdx.x))
      WaitAtLeast(args, XdbFlags(args, rank, kXdbCombine) + threadIdx.x, (target - 1) * kDoneUnit, kWaitCombineDone,
                  threadIdx.x);
    sender.Publish();
    __syncthreads();  // the acquire above, then the barrier, order every thread's stores below
    if constexpr (plat::kFenceEveryWave) plat::fence_system();
    if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStCombFirstStore);
    for (int q = blockIdx.x; q < numTasks; q = sender.Send(q)) {}
    if (threadIdx.x == 0) StampMax(args, kStCombSent, plat::now_ns());
  }
  if constexpr (!kSums) return;  // (a send kernel: its pushes and flags are out)
  unsigned* next = Claims(sync, kCombSumNext, parity);  // the sums' claim counter
  // The block's end, once it has read everything it will (its inputs and comb_recv, all in this
  // GPU's memory; it writes nothing a peer reads): its share of kDoneUnit goes to this rank's
  // combine-done counter on every rank. A peer's next dispatch, which writes this rank's arena
  // (where the input or the weights may lie), and its next combine, which writes comb_recv, wait
  // for the unit before their first store here; this rank's own counter is its combine epoch. No
  // block waits for another. seen: when this block last saw a range's flags (0: it summed none).
  auto finish = [&](uint64_t seen) {
    const uint64_t summed = plat::now_ns();
    // Every load (and empty-word store) of this block, before the counts. One rank: nothing reads
    // this rank's memory before the kernel's end (its next kernels follow in stream order), so no
    // fence, and block 0 counts the whole unit: one atomic per block on one word sat on the
    // kernel's tail (docs/performance.md, "One-rank block end: no fence, one count"). A block that
    // starts after that count reads the next epoch, which is harmless: at one rank only block 0
    // uses its epoch (parity), here.
    if constexpr (!kSolo<kCfg>) FenceBlockLocalDevice();
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) {
      // The next combine's claim counters: the last combine that used them is done (stream order).
      *ClaimWord(sync, kCombSendNext, parity ^ 1) = 0;
      *ClaimWord(sync, kCombSumNext, parity ^ 1) = 0;
      if (total > args.inpRows)  // rows beyond the caller's tensor were skipped: tell the host
        RecordError(args, kErrShortInput, uint64_t(rank) << 16, (uint64_t(total) << 32) | uint32_t(args.inpRows));
    }
    if constexpr (kSolo<kCfg>) {
      if (blockIdx.x == 0) plat::add_relaxed_system(XdbFlags(args, rank, kXdbCombine) + rank, kDoneUnit);
    } else {
      const uint64_t share = BlockShare();
      for (int pe = 0; pe < kWs; ++pe)
        if (!Masked(args, pe)) plat::add_relaxed_system(XdbFlags(args, pe, kXdbCombine) + rank, share);
      if (seen) {  // (after the counts: the fence before them would wait for these atomics)
        StampMax(args, kStCombFlagsSeen, seen);
        StampMax(args, kStCombSummed, summed);
      }
    }
    StampMax(args, kStCombEnd, plat::now_ns());
  };
  // Sum. With dedicated senders, ranges are claimed in order from a counter, so the senders take
  // their share of the last ranges when their pushes are done; the next claim is in flight while a
  // range is summed (double buffered: SumRange's barrier separates a slot's read from its next
  // write). Otherwise (one task per block, or one rank) every block is free at once, so a fixed
  // stride does as well: block b sums ranges b, b + grid, ... with no atomic per range.
  __shared__ int claimed[2];
  // (block-uniform; never on one rank, nor in a receive kernel: no senders)
  const bool claims = kCfg.phase == EpPhase::Whole && kWs > 1 && senders < grid;
  const int numRanges = NumRanges<kCfg>(args.numTokens), claimer = int(blockDim.x) - 1;
  if (claims && int(threadIdx.x) == claimer) claimed[0] = int(plat::atomic_add_device(next, 1u));
  __syncthreads();
  const int first = claims ? claimed[0] : int(blockIdx.x);
  if (first >= numRanges) finish(0);  // (a block with no range to sum ends here)
  for (int i = 0, r = first; r < numRanges; ++i) {
    if (!kSolo<kCfg> && int(threadIdx.x) == claimer)
      claimed[(i + 1) & 1] = claims ? int(plat::atomic_add_device(next, 1u)) : r + grid;
    SumRange<kCfg, T>(args, target, sumWeights, r, &claimed[(i + 1) & 1], numRanges, finish);
    r = kSolo<kCfg> ? r + grid : claimed[(i + 1) & 1];  // (one rank: no barrier publishes claimed)
  }
}

}  // namespace mori::ep
