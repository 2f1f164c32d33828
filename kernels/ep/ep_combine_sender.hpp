// EP combine: the sender, which pushes the rows this rank's experts produced to their tokens' home
// ranks (see ep_intranode.hpp for the protocol).
#pragma once
#include "ep/ep_combine_words.hpp"

namespace mori::ep {

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
// The sender stride SenderStart loads a second task for, before the counts decide it: a send
// kernel's (every block sends), else the dedicated senders' (the usual case of the whole leg).
template <EpCfg kCfg>
MORI_DEVICE int StartStride() { return kCfg.phase == EpPhase::Send ? int(gridDim.x) : DedicatedSenders(); }

// What a sender block needs before its first store that no token count decides, loaded at the
// kernel's start, all at once: the reverse-map entries of its first two tasks (lane < kRangeTok;
// the second for StartStride's stride, since the stride itself waits for the counts), the
// dispatch's epoch tag, and (lane < worldSize) the peers' combine-done counts.
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
    nextSlot = stride == StartStride<kCfg>() ? Decode(nextTask, start.entry[1]) : TaskSlot(nextTask);
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
    s.entry[1] = EntryOf(a, int(blockIdx.x) + StartStride<kCfg>());
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
    if (pass == 0) StoreWeights<false>(dstW);
  }
  // The task's weights (with weights; the first pass): f32, or (low latency) relaxed TaggedWeights,
  // a row beyond a short input's as 0.
  template <bool kLow>
  MORI_DEVICE void StoreWeights(CombWeight<kLow>* dstW) const {
    if (!withWeights) return;
#pragma unroll
    for (int u = 0; u < P::kWtsPer; ++u) {
      const int j = u * P::kThreads + int(threadIdx.x), s = SlotOf(j / kK);
      if constexpr (kLow) {
        if (j < P::kWts && (s >= 0 || s == kShortSlot))
          plat::store_relaxed_system(dstW + j, TaggedWeight(target, s >= 0 ? w[u] : 0.f));
      } else if (j < P::kWts && s >= 0) {
        dstW[j] = w[u];
      }
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
    if (pass == 0) StoreWeights<true>(dstW);
  }
  // The fp8 wire (CombWire): each vector cast on the way (every thread casts: a block's scale is a
  // shuffle; a block's lanes share their row, so they are live together), into rows of
  // EpWireBytes; low latency as StorePassLow (its data words are never signal words).
  template <bool kLow>
  MORI_DEVICE void StorePassWire(int pass, char* dst, CombWeight<kLow>* dstW) const {
    using W = CombWire<kCfg>;
#pragma unroll
    for (int u = 0; u < P::kPerPass; ++u) {
      const int v = (pass * P::kPerPass + u) * P::kThreads + int(threadIdx.x), i = v / kVecs, s = SlotOf(i);
      const bool in = v < P::kTaskVecs;
      const typename W::Vec c = W::Cast(buf[u], in && s >= 0);
      if (in && (s >= 0 || (kLow && s == kShortSlot)))
        W::template Store<kLow>(dst + size_t(i) * W::kRowBytes, v - i * kVecs, s >= 0 ? c : W::Fill(kShortWord));
    }
    if (pass == 0) StoreWeights<kLow>(dstW);
  }
  // Push task q (this block's current one) into its peer's comb_recv and raise its range flag
  // (low latency: no flag); returns the block's next task (numTasks or more: none).
  MORI_DEVICE int Send(int q) {
    constexpr bool kLow = kCfg.lowLatency;
    const int b = q / kDests, d = Dest(q), rank = args.rank;
    const bool live = b < NumRanges<kCfg>(int(numTok[d])) && !Masked(args, d);  // block-uniform
    if (live) {
      const size_t row0 = size_t(rank * kM + b * kRangeTok<kCfg>);
      char* dst = At<char>(args, d, args.off_comb_recv) + row0 * EpWireBytes(kCfg);
      CombWeight<kLow>* dstW = At<CombWeight<kLow>>(args, d, args.off_comb_recv_wts) + row0 * kK;
#pragma unroll 1
      for (int pass = 0; pass < P::kPasses; ++pass) {
        if (pass > 0) LoadPass(pass);
        if constexpr (CombWire<kCfg>::kQuant) StorePassWire<kLow>(pass, dst, dstW);
        else if constexpr (kLow) StorePassLow(pass, reinterpret_cast<vec16_t*>(dst), dstW);
        else StorePass(pass, reinterpret_cast<vec16_t*>(dst), dstW);
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

}  // namespace mori::ep
