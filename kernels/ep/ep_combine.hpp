// EP combine kernel body (see ep_intranode.hpp for the protocol).
#pragma once
#include <type_traits>

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

// How this rank's blocks split the work (a local choice: peers only see flags). With at most one
// send task per block, every block sends its task, then sums. With more, blocks [0, senders) send
// while the rest sum, and the senders join the summing when their pushes are done (see the end of
// EpCombineBody). Interleaving sends and sums in every block measured far slower (219 against 181
// µs at 4096 tokens): a block's pushes stall on every range wait, as the flags queue behind the
// data on the link. kSenderShare / 16 of the grid sends: 6, 7, 8 and 9 measured 187.5, 178.6, 177.1
// and 177.8 µs at 4096 tokens (two benches each in one call; with a fixed task stride instead of
// claims, 185.5, 180.5 and 181.7 for 6, 7 and 8: docs/performance.md, "Sender share 8 / 16").
constexpr int kSenderShare = 8;
MORI_DEVICE int DedicatedSenders() { return max(1, int(gridDim.x) * kSenderShare / 16); }
MORI_DEVICE int CombSenders(int tasks) { return tasks <= int(gridDim.x) ? int(gridDim.x) : DedicatedSenders(); }

// What a sender block needs before its first store that no token count decides, loaded at the
// kernel's start, all at once: the reverse-map entries of its first two tasks (lane < kRangeTok;
// the second for the stride of dedicated senders, the usual case, since the stride itself waits
// for the counts), the dispatch's epoch tag, and (lane < worldSize) the peers' combine-done counts.
// Loaded one after another, as they once were, they were a chain of four memory latencies (HBM
// misses at 4096 tokens, where the last combine's traffic has swept the L2) before the first push.
struct SenderStart {
  uint64_t entry[2] = {0, 0};
  uint64_t done = 0;
  uint32_t dispTag = 0;
};

// Sender: push the rows this rank's experts produced back to their tokens' home ranks, range by
// range in token order (every rank walks the ranges in the same order, so the home rank's summers
// can start on the first ranges while the last ones are still in flight). A task is one range of
// one peer's tokens; its block raises that range's flag on the peer when its stores are done (low
// latency: no flag, its words are relaxed system-scope stores; see CombWord).
// A task's rows are one flat array of vectors spread over all the block's threads (no wave idles
// on a range that is not a multiple of its chunks), and the next task's loads are issued right
// after this task's stores, so they overlap the release fence instead of following it.
template <EpCfg kCfg>
struct SendPlan {
  static constexpr int kVecs = EpTokenBytes(kCfg) / 16, kThreads = EpBlockThreads(kCfg);
  static constexpr int kTaskVecs = kRangeTok<kCfg> * kVecs;
  static constexpr int kFit = (kTaskVecs + kThreads - 1) / kThreads;
  static constexpr int kPerPass = kFit < 2 * kCfg.vecUnroll ? kFit : 2 * kCfg.vecUnroll;  // registers per lane
  static constexpr int kPasses = (kTaskVecs + kThreads * kPerPass - 1) / (kThreads * kPerPass);
  static constexpr int kWts = kRangeTok<kCfg> * kCfg.numExpertPerToken, kWtsPer = (kWts + kThreads - 1) / kThreads;
};

// A block's sender state: the current task's slots and first-pass rows (in registers), and the
// slots of the task after it. A block's first kFixed tasks are fixed (b, b + senders, ...: nothing
// before its first push waits for the counter's atomic); later ones are claimed from a counter, so
// blocks whose pushes run faster take more (with a fixed stride the first and last sender ended
// 25 µs apart at 4096 tokens). Claims run well ahead of use: thread 0 issues
// one at a task's barrier, publishes its value in shared memory at the next barrier, and every
// thread reads it at the task after (no thread waits on the atomic).
template <EpCfg kCfg>
struct Sender {
  using P = SendPlan<kCfg>;
  static constexpr int kK = kCfg.numExpertPerToken, kWs = kCfg.worldSize, kM = kCfg.maxTokPerRank;
  static constexpr int kVecs = P::kVecs, kDests = kWs > 1 ? kWs - 1 : 1;
  struct Slots { int s[kRangeTok<kCfg>]; };

  const EpArgs& args;
  const uint64_t target;
  const bool withWeights;
  const int numTasks, stride;
  const uint64_t* numTok;  // each peer's dispatch n (its ranges)
  const uint32_t dispTag;
  Slots cur;
  int nextTask, nextSlot;  // the task after the current one, and its slots
  int pending;  // thread 0 only: the claim issued at the last barrier, published at the next, as an
                // offset from kFixed * stride (so no instruction waits for the atomic before then)
  int* const claims;  // shared: published claims, double buffered (a barrier between write and read)
  int barriers = 0;
  vec16_t buf[P::kPerPass];
  float w[P::kWtsPer];

  // start: Start(), issued by the caller before the token counts that decide `tasks` arrive.
  MORI_DEVICE Sender(const EpArgs& a, uint64_t tgt, bool wts, int tasks, int senders, int* shared, const SenderStart& start)
      : args(a), target(tgt), withWeights(wts), numTasks(tasks), stride(senders),
        numTok(XdbFlags(a, a.rank, kXdbNumTok)), dispTag(start.dispTag), claims(shared) {
    if (threadIdx.x == 0) pending = int(blockIdx.x) - stride;  // published as b + (kFixed - 1) * stride
    cur = Spread(Decode(blockIdx.x, start.entry[0]));
    // The first task's rows before the second task's entry is decoded (the combine-done wait guards
    // only the stores): the start's chain of dependent loads is SenderStart's, then the rows.
    LoadPass(0);
    nextTask = blockIdx.x + stride;
    nextSlot = stride == DedicatedSenders() ? Decode(nextTask, start.entry[1]) : TaskSlot(nextTask);
  }
  // The reverse-map entry of task q's lane (lane < kRangeTok), loaded with no dependence on the
  // token counts: every address it may form lies inside the map.
  MORI_DEVICE static uint64_t EntryOf(const EpArgs& a, int q) {
    const int lane = plat::lane_id(), t = q / kDests * kRangeTok<kCfg> + lane;
    if (lane >= kRangeTok<kCfg> || t >= kM) return 0;
    return At<uint64_t>(a, a.rank, a.off_src_to_recv)[DestOf(a.rank, q) * kM + t];
  }
  // SenderStart's loads, by every thread of every block (only senders use them).
  MORI_DEVICE static SenderStart Start(const EpArgs& a) {
    SenderStart s;
    s.entry[0] = EntryOf(a, int(blockIdx.x));
    s.entry[1] = EntryOf(a, int(blockIdx.x) + DedicatedSenders());
    s.dispTag = uint32_t(SyncWords(a)[kDispEpoch]);
    if (int(threadIdx.x) < kWs && int(threadIdx.x) != a.rank)  // (relaxed: see the wait before the first push)
      s.done = plat::load_relaxed_system(XdbFlags(a, a.rank, kXdbCombine) + threadIdx.x);
    return s;
  }
  // A block's first kFixed tasks are b, b + stride, ...; Claim() gives one past them, as an offset
  // from kFixed * stride (numTasks, i.e. none, when the fixed ones cover every task).
  static constexpr int kFixed = 3;
  MORI_DEVICE int Claim() const {
    if (numTasks <= kFixed * stride) return numTasks;
    return int(plat::atomic_add_device(Claims(SyncWords(args), kCombSendNext, int(target & 1)), 1u));
  }
  // Thread 0, before each of the block's barriers: publish the last claim, issue the next.
  MORI_DEVICE void Publish() {
    if (threadIdx.x != 0) return;
    claims[barriers & 1] = min(kFixed * stride + pending, numTasks);
    pending = Claim();
  }
  // The task after next (every thread; published at the last barrier). Call once per barrier.
  MORI_DEVICE int Claimed() { return claims[barriers++ & 1]; }
  MORI_DEVICE static int DestOf(int rank, int q) { return (rank + 1 + q % kDests) % kWs; }
  MORI_DEVICE int Dest(int q) const { return DestOf(args.rank, q); }
  // Lane i < kRangeTok: this rank's row of token t0 + i of task q's peer; -1 if that token was not
  // routed here this epoch or the task is empty, kShortSlot if its row lies beyond a short input
  // (this rank's host is told by block 0, the peer by the range flag). Loaded two tasks ahead and
  // decoded at once: the wave waits for the load here, but deferring the decode a task measured
  // no faster (docs/performance.md, "Deferred decode of a task's map entry").
  MORI_DEVICE int TaskSlot(int q) const { return q < numTasks ? Decode(q, EntryOf(args, q)) : -1; }
  // TaskSlot's answer from the entry e of task q's lane.
  MORI_DEVICE int Decode(int q, uint64_t e) const {
    const int lane = plat::lane_id(), d = Dest(q), t = q / kDests * kRangeTok<kCfg> + lane;
    if (lane >= kRangeTok<kCfg> || q >= numTasks || t >= kM) return -1;
    const int slot = int(uint32_t(e));
    return t >= int(numTok[d]) || uint32_t(e >> 32) != dispTag ? -1 : slot < args.inpRows ? slot : kShortSlot;
  }
  MORI_DEVICE static Slots Spread(int slot) {  // every thread gets the task's slots (wave shuffles)
    Slots r;
#pragma unroll
    for (int i = 0; i < kRangeTok<kCfg>; ++i) r.s[i] = plat::shfl(slot, i);
    return r;
  }
  MORI_DEVICE int SlotOf(int i) const {  // cur.s[i] without a dynamically indexed (local) array
    int s = cur.s[0];
#pragma unroll
    for (int k = 1; k < kRangeTok<kCfg>; ++k)
      if (i == k) s = cur.s[k];
    return s;
  }
  MORI_DEVICE void LoadPass(int pass) {
    const vec16_t* in = static_cast<const vec16_t*>(args.inpTok);
#pragma unroll
    for (int u = 0; u < P::kPerPass; ++u) {
      const int v = (pass * P::kPerPass + u) * P::kThreads + int(threadIdx.x), i = v / kVecs, s = SlotOf(i);
      if (v < P::kTaskVecs && s >= 0) buf[u] = plat::load_stream(in + size_t(s) * kVecs + (v - i * kVecs));
    }
    if (pass == 0 && withWeights)
#pragma unroll
      for (int u = 0; u < P::kWtsPer; ++u) {
        const int j = u * P::kThreads + int(threadIdx.x), s = SlotOf(j / kK);
        if (j < P::kWts && s >= 0) w[u] = args.inpWeights[size_t(s) * kK + j % kK];
      }
  }
  MORI_DEVICE void StorePass(int pass, vec16_t* dst, float* dstW) const {
#pragma unroll
    for (int u = 0; u < P::kPerPass; ++u) {
      const int v = (pass * P::kPerPass + u) * P::kThreads + int(threadIdx.x);
      if (v < P::kTaskVecs && SlotOf(v / kVecs) >= 0) dst[v] = buf[u];
    }
    if (pass == 0 && withWeights)
#pragma unroll
      for (int u = 0; u < P::kWtsPer; ++u) {
        const int j = u * P::kThreads + int(threadIdx.x);
        if (j < P::kWts && SlotOf(j / kK) >= 0) dstW[j] = w[u];
      }
  }
  // Low latency: every word relaxed and system-scope; a row beyond a short input goes as
  // kShortWord words (and weight 0), so the home rank sums its token without it and says so.
  MORI_DEVICE void StorePassLow(int pass, vec16_t* dst, uint64_t* dstW) const {
#pragma unroll
    for (int u = 0; u < P::kPerPass; ++u) {
      const int v = (pass * P::kPerPass + u) * P::kThreads + int(threadIdx.x), s = SlotOf(v / kVecs);
      if (v < P::kTaskVecs && (s >= 0 || s == kShortSlot))
        plat::store_words_relaxed(dst + v, s >= 0 ? CanonVec(buf[u]) : WordVec(kShortWord));
    }
    if (pass == 0 && withWeights)
#pragma unroll
      for (int u = 0; u < P::kWtsPer; ++u) {
        const int j = u * P::kThreads + int(threadIdx.x), s = SlotOf(j / kK);
        if (j < P::kWts && (s >= 0 || s == kShortSlot))
          plat::store_relaxed_system(dstW + j, TaggedWeight(target, s >= 0 ? w[u] : 0.f));
      }
  }
  // Push task q (this block's current one) into its peer's comb_recv and raise its range flag
  // (low latency: no flag); returns the block's next task (numTasks or more: none).
  MORI_DEVICE int Send(int q) {
    constexpr bool kLow = kCfg.lowLatency;
    const int b = q / kDests, d = Dest(q), rank = args.rank;
    const bool live = b < NumRanges<kCfg>(int(numTok[d]));  // block-uniform
    if (live) {
      vec16_t* dst = At<vec16_t>(args, d, args.off_comb_recv) + size_t(rank * kM + b * kRangeTok<kCfg>) * kVecs;
      CombWeight<kLow>* dstW = At<CombWeight<kLow>>(args, d, args.off_comb_recv_wts) + size_t(rank * kM + b * kRangeTok<kCfg>) * kK;
#pragma unroll 1
      for (int pass = 0; pass < P::kPasses; ++pass) {
        if (pass > 0) LoadPass(pass);
        if constexpr (kLow) StorePassLow(pass, dst, dstW);
        else StorePass(pass, dst, dstW);
      }
    }
    bool shortInput = false;
#pragma unroll
    for (int i = 0; i < kRangeTok<kCfg>; ++i) shortInput |= cur.s[i] == kShortSlot;
    // The next task's first loads reuse the registers the stores above have already read.
    cur = Spread(nextSlot);
    const int after = Claimed(), next = nextTask;
    nextTask = after;
    nextSlot = TaskSlot(after);
    LoadPass(0);
    if (!kLow && live && plat::kFenceEveryWave) plat::fence_system();
    Publish();
    __syncthreads();  // the release below is cumulative over the block's stores
    if (!kLow && live && threadIdx.x == 0)
      plat::store_release_system(At<uint64_t>(args, d, args.off_comb_flags) + rank * kM + b, RangeFlag(target, shortInput));
    return next;
  }
};

// Where one work item's rows come from: one source per rank its token went to (its own row
// straight from the input, a peer's from comb_recv, where that peer pushed it), and this lane's
// weight (lane < k) of each. `flat` is the token's forward-map entry on lane j < k (-1 elsewhere).
// Low latency (kLow): a peer's weight is a TaggedWeight, and nibble i of `pes` is source i's rank,
// so that peers' words are awaited, not just loaded. With `prefetchV0` >= 0, this lane's vectors
// of the own row (prefetchV0, + waveSize, ...) are hinted into L2 as soon as the row is known: the
// input was complete at the kernel's start, so its HBM latency can pass while the wave waits for
// the peers' flags. (Loading it into registers there instead delayed the poll: docs/performance.md,
// "Own row hinted into L2".)
template <EpCfg kCfg>
struct ItemSources {
  static constexpr bool kLow = kCfg.lowLatency;
  static constexpr int kWs = kCfg.worldSize, kK = kCfg.numExpertPerToken, kM = kCfg.maxTokPerRank;
  static constexpr int kVecs = EpTokenBytes(kCfg) / 16, kRecv = EpMaxRecv(kCfg);
  static constexpr int kW = kCfg.waveSize, kUnroll = kCfg.vecUnroll;
  const vec16_t* row[kWs];
  const void* w[kWs];  // the own row's: a float of the input's weights; a peer's: a CombWeight
  int n = 0;
  uint32_t pes = 0;
  MORI_DEVICE ItemSources(const EpArgs& args, bool sumWeights, int flat, int t, int prefetchV0 = -1) {
    const int rank = args.rank, lane = plat::lane_id();
    const vec16_t* in = static_cast<const vec16_t*>(args.inpTok);
    const vec16_t* recv = At<vec16_t>(args, rank, args.off_comb_recv);
    const CombWeight<kLow>* recvW = At<CombWeight<kLow>>(args, rank, args.off_comb_recv_wts);
#pragma unroll
    for (int i = 0; i < kWs; ++i) row[i] = nullptr, w[i] = nullptr;
    for (uint64_t m = plat::ballot(flat >= 0); m; m &= m - 1) {
      const int f = plat::shfl(flat, plat::lowest_bit(m)), pe = f / kRecv, slot = f % kRecv;
      if (pe == rank && slot >= args.inpRows) continue;  // short input (reported): never read past it
      const vec16_t* r = pe == rank ? in + size_t(slot) * kVecs : recv + size_t(pe * kM + t) * kVecs;
      if (pe == rank && prefetchV0 >= 0)
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (prefetchV0 + u * kW < kVecs) plat::prefetch_l2(r + prefetchV0 + u * kW);
      // (formed only with weights: the input's weights pointer may be null otherwise)
      const void* wp = !sumWeights ? nullptr
                       : pe == rank ? static_cast<const void*>(args.inpWeights + size_t(slot) * kK + lane)
                                    : static_cast<const void*>(recvW + size_t(pe * kM + t) * kK + lane);
#pragma unroll
      for (int i = 0; i < kWs; ++i)  // (static indices: the arrays stay in registers)
        if (i == n) row[i] = r, w[i] = wp;
      if constexpr (kLow) pes |= uint32_t(pe) << (4 * n);
      ++n;
    }
  }
  MORI_DEVICE int Pe(int i) const { return int(pes >> (4 * i)) & 15; }
  MORI_DEVICE bool Peer(int i, int rank) const { return Pe(i) != rank; }
};

// Low latency, after a pair of sources' first loads (SumRange): wait for each peer's weight (here
// once it carries this combine's epoch; a short row's is 0), then reload whatever vector still
// holds an empty word until none does: every lane polls its own vectors, so the wave has its rows
// one load after the last lands (polling one word per row first, then loading, cost a load more:
// docs/performance.md, "Every lane polls its own vectors"). The timeout decision is wave-uniform:
// each lane reads its own clock, and a lane that left alone would leave its wave's next vote short
// of it: the wave would hang.
template <EpCfg kCfg, typename Src>
MORI_DEVICE void AwaitRest(const EpArgs& args, uint64_t target, const Src& src, int s, int pair, bool withW, int v0,
                           int t, uint64_t (&tw)[2], float* wv, vec16_t (&buf)[2][kCfg.vecUnroll]) {
  constexpr int kW = kCfg.waveSize, kVecs = EpTokenBytes(kCfg) / 16, kUnroll = kCfg.vecUnroll;
  const int rank = args.rank;
#pragma unroll
  for (int p = 0; p < 2; ++p)
    if (withW && p < pair && src.Peer(s + p, rank)) {
      for (uint64_t since = 0; !WeightArrived(tw[p], target);) {
        const uint64_t now = plat::now_ns();
        if (!since) since = now;
        if (now - since > uint64_t(args.timeoutNs)) {  // (no vote in this loop: per lane is safe)
          RecordError(args, kErrTimeout, TimeoutDetail(kWaitCombineRows, src.Pe(s + p), rank), uint64_t(t));
          break;
        }
        tw[p] = plat::load_relaxed_system(static_cast<const uint64_t*>(src.w[s + p]));
      }
      wv[s + p] = __uint_as_float(uint32_t(tw[p]));
    }
  for (uint64_t since = 0;;) {
    bool empty = false;
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (p < pair && src.Peer(s + p, rank) && v0 + u * kW < kVecs) empty |= HasWord(buf[p][u], kEmptyWord);
    if (!plat::wave_any(empty)) return;
    const uint64_t now = plat::now_ns();
    if (!since) since = now;
    if (plat::wave_any(now - since > uint64_t(args.timeoutNs))) {
      const int peer = src.Pe(src.Peer(s, rank) ? s : s + 1);
      RecordError(args, kErrTimeout, TimeoutDetail(kWaitCombineRows, peer, rank), uint64_t(t));
      return;
    }
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (p < pair && src.Peer(s + p, rank) && v0 + u * kW < kVecs && HasWord(buf[p][u], kEmptyWord))
          buf[p][u] = plat::load_words_relaxed(src.row[s + p] + v0 + u * kW);
  }
}

// Sum range b of this rank's tokens: wait for every peer's flag of the range, then sum each token's
// rows (ItemSources) in fp32. One work item is one chunk of one token's row; the items go round the
// block's waves in block-uniform rounds. `*nextRange` (shared, set before the call) is the block's
// next range: when there is none, `finish(seen)` (the block's end) runs between the last round's
// loads and its stores, so that neither the block's count nor the combine-done release waits for
// those stores (nothing needs them before the kernel's end). `seen`: when the flags were seen.
// Low latency (kLow): no flags. Each wave waits for its own item's rows: it loads the chunk with
// strong loads and reloads any vector still holding an empty word (AwaitRest), sums, and sets the
// words it read back to kEmptyWord for the next combine (before its block's count); `seen` is then
// when the wave last had its rows.
template <EpCfg kCfg, typename T, typename Finish>
MORI_DEVICE void SumRange(const EpArgs& args, uint64_t target, bool sumWeights, int b, const int* nextRange,
                          int numRanges, Finish&& finish) {
  constexpr int kW = kCfg.waveSize, kK = kCfg.numExpertPerToken, kWs = kCfg.worldSize, kM = kCfg.maxTokPerRank;
  constexpr int kVecs = EpTokenBytes(kCfg) / 16, kUnroll = kCfg.vecUnroll, kWaves = kCfg.warpPerBlock;
  constexpr int kPerVec = 16 / sizeof(T), kChunkVecs = ep::kChunkVecs<kCfg>, kChunks = ep::kChunks<kCfg>;
  constexpr bool kLow = kCfg.lowLatency;
  using Src = ItemSources<kCfg>;
  const int rank = args.rank, lane = plat::lane_id(), wave = plat::wave_id(), n = args.numTokens;
  const int* tokOff = At<int>(args, rank, args.off_tok_off);
  const int t0 = b * kRangeTok<kCfg>, numItems = min(kRangeTok<kCfg>, n - t0) * kChunks;
  // The wave's first item's sources (from the forward map, which a previous kernel wrote), worked
  // out before the wait: after it, that arithmetic cost 0.6-0.8 us of issue (every wave of the
  // block runs it at once, four to a scheduler).
  Src src(args, sumWeights, wave < numItems && lane < kK ? tokOff[(t0 + wave / kChunks) * kK + lane] : -1,
          t0 + wave / kChunks, (wave % kChunks) * kChunkVecs + lane);
  uint64_t seen = 0;
  if constexpr (!kLow) {
    // One poller per peer and block (a poller per wave measured slower: the polls load the memory
    // system the senders use).
    if (threadIdx.x < kWs && threadIdx.x != rank) {
      const uint64_t* flags = At<uint64_t>(args, rank, args.off_comb_flags);
      const uint64_t got = WaitAtLeast(args, flags + threadIdx.x * kM + b, RangeFlag(target, false), kWaitCombineRange,
                                       threadIdx.x);
      if (got == RangeFlag(target, true))  // the peer's rows of some of these tokens were never sent
        RecordError(args, kErrPeerShortInput, PeerShortDetail(threadIdx.x, rank), uint64_t(t0));
    }
    __syncthreads();  // the acquire loads above, then the barrier, order every thread's loads below
    if constexpr (plat::kFenceEveryWave) plat::fence_system();
    seen = plat::now_ns();
    if (b == 0 && threadIdx.x == 0) StampAt(args, kStCombFirstRange);
  } else {
    __syncthreads();  // publishes *nextRange (the claimer's store before this call)
  }
  const bool closing = *nextRange >= numRanges;  // block-uniform (the barrier above published it)
  const int rounds = (numItems + kWaves - 1) / kWaves;
  for (int round = 0; round < rounds; ++round) {
    const int item = round * kWaves + wave, t = t0 + item / kChunks, chunk = item % kChunks, next = item + kWaves;
    const bool has = item < numItems;  // wave-uniform
    // the next round's forward-map entry, in flight during this round
    const int nextFlat = next < numItems && lane < kK ? tokOff[(t0 + next / kChunks) * kK + lane] : -1;
    float acc[kUnroll][kPerVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int e = 0; e < kPerVec; ++e) acc[u][e] = 0.f;
    float wv[kWs];
#pragma unroll
    for (int s = 0; s < kWs; ++s) wv[s] = 0.f;
    // A token's weights (first chunk, lane < k): every source's load issued with the rows' loads
    // below, not after them, so this item costs one memory latency, not two.
    const bool withW = has && sumWeights && chunk == 0 && lane < kK;
    const int v0 = chunk * kChunkVecs + lane;
    if (has) {
      const int numSrc = src.n;
      if constexpr (!kLow)
#pragma unroll
        for (int s = 0; s < kWs; ++s)
          if (withW && s < numSrc) wv[s] = plat::load_peer_f32(static_cast<const float*>(src.w[s]));
      // two sources' loads in flight at once (a token has one source per rank it went to)
#pragma unroll
      for (int s = 0; s < kWs; s += 2) {  // (static indices into src: registers, not the stack)
        if (s >= numSrc) break;
        const int pair = s + 1 < numSrc ? 2 : 1;
        vec16_t buf[2][kUnroll];
        bool shortRow[2] = {false, false};
        if constexpr (kLow) {
          uint64_t tw[2] = {0, 0};  // a peer's TaggedWeight, loaded before the rows
#pragma unroll
          for (int p = 0; p < 2; ++p)
            if (withW && p < pair) {
              if (src.Peer(s + p, rank)) tw[p] = plat::load_relaxed_system(static_cast<const uint64_t*>(src.w[s + p]));
              else wv[s + p] = plat::load_peer_f32(static_cast<const float*>(src.w[s + p]));
            }
#pragma unroll
          for (int p = 0; p < 2; ++p)
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (p < pair && v0 + u * kW < kVecs)
                buf[p][u] = src.Peer(s + p, rank) ? plat::load_words_relaxed(src.row[s + p] + v0 + u * kW)
                                                  : plat::load_peer(src.row[s + p] + v0 + u * kW);
          AwaitRest<kCfg>(args, target, src, s, pair, withW, v0, t, tw, wv, buf);
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            // a peer's row beyond its short input came as kShortWord words: summed without it, reported
            const bool peer = p < pair && src.Peer(s + p, rank);
            shortRow[p] = plat::wave_any(peer && v0 < kVecs && HasWord(buf[p][0], kShortWord));
            if (shortRow[p] && chunk == 0 && lane == 0)
              RecordError(args, kErrPeerShortInput, PeerShortDetail(src.Pe(s + p), rank), uint64_t(t));
          }
        } else {
#pragma unroll
          for (int p = 0; p < 2; ++p)
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (p < pair && v0 + u * kW < kVecs) buf[p][u] = plat::load_peer(src.row[s + p] + v0 + u * kW);
        }
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const T* el = reinterpret_cast<const T*>(&buf[p][u]);
#pragma unroll
            for (int e = 0; e < kPerVec; ++e)
              if (p < pair && (!kLow || !shortRow[p])) acc[u][e] += to_f32(el[e]);
          }
        if constexpr (kLow)  // the peers' words back to empty for the next combine (before the count)
#pragma unroll
          for (int p = 0; p < 2; ++p)
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (p < pair && src.Peer(s + p, rank) && v0 + u * kW < kVecs)
                plat::store_words_relaxed(const_cast<vec16_t*>(src.row[s + p]) + v0 + u * kW, WordVec(kEmptyWord));
      }
      if constexpr (kLow) {
        seen = plat::now_ns();
        if (b == 0 && round == 0 && threadIdx.x == 0) StampAt(args, kStCombFirstRange);
      }
    }
    if (closing && round == rounds - 1) finish(seen);  // every read of this block is done
    if (has) {
      vec16_t* out = reinterpret_cast<vec16_t*>(static_cast<char*>(args.outTok) + size_t(t) * EpTokenBytes(kCfg));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + u * kW >= kVecs) break;
        vec16_t o;
        T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) oe[e] = from_f32<T>(acc[u][e]);
        out[v0 + u * kW] = o;
      }
      if (withW) {
        float w = 0.f;
#pragma unroll
        for (int s = 0; s < kWs; ++s) w += wv[s];
        args.outWeights[t * kK + lane] = w;
      }
    }
    if (round + 1 < rounds) src = Src(args, sumWeights, nextFlat, t0 + next / kChunks);
  }
}

template <EpCfg kCfg, typename T>
MORI_DEVICE void EpCombineBody(const EpArgs& args) {
  static_assert(EpIsValid(kCfg), "invalid EpCfg");
  static_assert(EpSummable(kCfg), "combine sums: the dtype must be Bf16 or Fp32");
  static_assert(kCfg.waveSize == plat::kWaveSize, "Cfg waveSize does not match the target");
  static_assert(sizeof(T) == EpElemBytes(kCfg), "element type does not match the Cfg dtype");
  static_assert(kRangeTok<kCfg> <= kCfg.waveSize, "a range's slots are held one per lane");
  static_assert(kCfg.worldSize <= 8 && kMaxPeers <= 16, "ItemSources packs a source's rank in 4 bits, 8 sources");
  constexpr int kWs = kCfg.worldSize;
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
    total = *At<int>(args, rank, args.off_total_recv);
  }

  const SenderStart start = kWs > 1 ? Sender<kCfg>::Start(args) : SenderStart{};  // in flight with the counts
  const uint64_t* numTok = XdbFlags(args, rank, kXdbNumTok);  // each peer's dispatch n (its ranges)
  int maxRanges = 0;
#pragma unroll
  for (int d = 0; d < kWs; ++d)
    if (d != rank) maxRanges = max(maxRanges, NumRanges<kCfg>(int(numTok[d])));
  // (maxRanges is 0 on one rank: no peers)
  const uint64_t target = CombEpoch(args) + 1;  // (read after the loads above are issued: none waits for it)
  const int parity = int(target & 1);
  const int numTasks = maxRanges * Sender<kCfg>::kDests, senders = CombSenders(numTasks), grid = int(gridDim.x);
  if (kWs > 1 && int(blockIdx.x) < senders && int(blockIdx.x) < numTasks) {  // one rank: no senders
    __shared__ int sendClaims[2];
    Sender<kCfg> sender(args, target, sendWeights, numTasks, senders, sendClaims, start);
    // Before the first store: comb_recv on a peer is free once its previous combine is done. The
    // count read at the start usually says so already; then no acquire load follows it (one more
    // memory latency before the first push). The stores below depend on that read's value, and no
    // GPU performs a store before the load that decides it returns; the peer counted only after
    // its reads of comb_recv were done (FenceBlockLocalDevice), as NCCL returns a receive credit.
    if (threadIdx.x < kWs && threadIdx.x != rank && start.done < (target - 1) * kDoneUnit)
      WaitAtLeast(args, XdbFlags(args, rank, kXdbCombine) + threadIdx.x, (target - 1) * kDoneUnit, kWaitCombineDone,
                  threadIdx.x);
    sender.Publish();
    __syncthreads();  // the acquire above, then the barrier, order every thread's stores below
    if constexpr (plat::kFenceEveryWave) plat::fence_system();
    if (blockIdx.x == 0 && threadIdx.x == 0) StampAt(args, kStCombFirstStore);
    for (int q = blockIdx.x; q < numTasks; q = sender.Send(q)) {}
    if (threadIdx.x == 0) StampMax(args, kStCombSent, plat::now_ns());
  }
  unsigned* next = Claims(sync, kCombSumNext, parity);  // the sums' claim counter
  // The block's end, once it has read everything it will (its inputs and comb_recv, all in this
  // GPU's memory; it writes nothing a peer reads): its share of kDoneUnit goes to this rank's
  // combine-done counter on every rank. A peer's next dispatch, which writes this rank's arena
  // (where the input or the weights may lie), and its next combine, which writes comb_recv, wait
  // for the unit before their first store here; this rank's own counter is its combine epoch. No
  // block waits for another. seen: when this block last saw a range's flags (0: it summed none).
  auto finish = [&](uint64_t seen) {
    const uint64_t summed = plat::now_ns();
    FenceBlockLocalDevice();  // every load (and empty-word store) of this block, before the counts
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) {
      // The next combine's claim counters: the last combine that used them is done (stream order).
      *ClaimWord(sync, kCombSendNext, parity ^ 1) = 0;
      *ClaimWord(sync, kCombSumNext, parity ^ 1) = 0;
      if (total > args.inpRows)  // rows beyond the caller's tensor were skipped: tell the host
        RecordError(args, kErrShortInput, uint64_t(rank) << 16, (uint64_t(total) << 32) | uint32_t(args.inpRows));
    }
    const uint64_t share = BlockShare();
    for (int pe = 0; pe < kWs; ++pe) plat::add_relaxed_system(XdbFlags(args, pe, kXdbCombine) + rank, share);
    if (seen) {  // (after the counts: the fence before them would wait for these atomics)
      StampMax(args, kStCombFlagsSeen, seen);
      StampMax(args, kStCombSummed, summed);
    }
    StampMax(args, kStCombEnd, plat::now_ns());
  };
  // Sum. With dedicated senders, ranges are claimed in order from a counter, so the senders take
  // their share of the last ranges when their pushes are done; the next claim is in flight while a
  // range is summed (double buffered: SumRange's barrier separates a slot's read from its next
  // write). Otherwise (one task per block, or one rank) every block is free at once, so a fixed
  // stride does as well: block b sums ranges b, b + grid, ... with no atomic per range.
  __shared__ int claimed[2];
  const bool claims = kWs > 1 && senders < grid;  // block-uniform; never on one rank (no senders)
  const int numRanges = NumRanges<kCfg>(args.numTokens), claimer = int(blockDim.x) - 1;
  if (claims && int(threadIdx.x) == claimer) claimed[0] = int(plat::atomic_add_device(next, 1u));
  __syncthreads();
  const int first = claims ? claimed[0] : int(blockIdx.x);
  if (first >= numRanges) finish(0);  // (a block with no range to sum ends here)
  for (int i = 0, r = first; r < numRanges; ++i) {
    if (int(threadIdx.x) == claimer) claimed[(i + 1) & 1] = claims ? int(plat::atomic_add_device(next, 1u)) : r + grid;
    SumRange<kCfg, T>(args, target, sumWeights, r, &claimed[(i + 1) & 1], numRanges, finish);
    r = claimed[(i + 1) & 1];
  }
}

}  // namespace mori::ep
