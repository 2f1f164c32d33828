// EP combine: the summer, which waits for a range's rows and sums each token's in fp32 (see
// ep_intranode.hpp for the protocol).
#pragma once
#include "ep/ep_combine_sources.hpp"

namespace mori::ep {

// Low latency, after a pair of sources' first loads (SumRange): wait for each peer's weight (here
// once it carries this combine's epoch; a short row's is 0), then reload whatever vector still
// holds an empty word until none does: every lane polls its own vectors, so the wave has its rows
// one load after the last lands (polling one word per row first, then loading, cost a load more:
// docs/performance.md, "Every lane polls its own vectors"). The timeout decision is wave-uniform:
// each lane reads its own clock, and a lane that left alone would leave its wave's next vote short
// of it: the wave would hang.
// A low-latency vector as loaded (the row's own 16 bytes, or the fp8 wire's words and scale): whether
// it holds `word`, and its reload.
MORI_DEVICE bool Holds(const vec16_t& b, uint32_t word) { return HasWord(b, word); }
template <int kWords>
MORI_DEVICE bool Holds(const WireVec<kWords>& c, uint32_t word) {
  bool any = c.scale == word;  // (0 where there is no scale word: never a signal word)
#pragma unroll
  for (int i = 0; i < kWords; ++i) any |= c.w[i] == word;
  return any;
}
template <EpCfg kCfg>
MORI_DEVICE void Reload(const vec16_t* row, int v, vec16_t& b) { b = plat::load_words_relaxed(row + v); }
template <EpCfg kCfg, int kWords>
MORI_DEVICE void Reload(const vec16_t* row, int v, WireVec<kWords>& c) { c = CombWire<kCfg>::template Load<true>(row, v); }

template <EpCfg kCfg, typename Src, typename Buf>
MORI_DEVICE void AwaitRest(const EpArgs& args, uint64_t target, const Src& src, int s, int pair, bool withW, int v0,
                           int t, uint64_t (&tw)[2], float* wv, Buf (&buf)[2][kCfg.vecUnroll]) {
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
        if (p < pair && src.Peer(s + p, rank) && v0 + u * kW < kVecs) empty |= Holds(buf[p][u], kEmptyWord);
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
        if (p < pair && src.Peer(s + p, rank) && v0 + u * kW < kVecs && Holds(buf[p][u], kEmptyWord))
          Reload<kCfg>(src.row[s + p], v0 + u * kW, buf[p][u]);
  }
}

// One rank (kWs 1) has no flags to wait for and no claims (its blocks take ranges by the grid's
// stride), so its summer has no barrier: each wave goes on to its next range once its stores are
// issued, and one wave's loads overlap another's stores.
template <EpCfg kCfg>
constexpr bool kSolo = kCfg.worldSize == 1;

// Sum range b of this rank's tokens: wait for every peer's flag of the range, then sum each token's
// rows (ItemSources) in fp32. One work item is one chunk of one token's row; the items go round the
// block's waves in block-uniform rounds. `*nextRange` (shared, set before the call; one rank: b +
// the grid, kSolo) is the block's next range: when there is none, `finish(seen)` (the block's end)
// runs between the last round's loads and its stores, so that neither the block's count nor the
// combine-done release waits for those stores (nothing needs them before the kernel's end).
// `seen`: when the flags were seen.
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
  // The fp8 wire (CombWire): a peer's vectors come as wire words, the own row's are cast here as
  // its senders would cast them (every lane of the wave casts: a block's scale is a shuffle).
  using W = CombWire<kCfg>;
  using Buf = std::conditional_t<W::kQuant, typename W::Vec, vec16_t>;
  const int rank = args.rank, lane = plat::lane_id(), wave = plat::wave_id(), n = args.numTokens;
  const int* tokOff = At<int>(args, rank, args.off_tok_off);
  const int t0 = b * kRangeTok<kCfg>, numItems = min(kRangeTok<kCfg>, n - t0) * kChunks;
  // The wave's first item's sources (from the forward map, which a previous kernel wrote), worked
  // out before the wait: after it, that arithmetic cost 0.6-0.8 us of issue (every wave of the
  // block runs it at once, four to a scheduler).
  // (one rank: no wait to hide the own row's latency behind, so no L2 hint either)
  Src src(args, sumWeights, wave < numItems && lane < kK ? tokOff[(t0 + wave / kChunks) * kK + lane] : -1,
          t0 + wave / kChunks, kSolo<kCfg> ? -1 : (wave % kChunks) * kChunkVecs + lane);
  uint64_t seen = 0;
  if constexpr (kSolo<kCfg>) {
    // (no flags to wait for, no claim to publish; `seen` stays 0: a one-rank block stamps its end only)
  } else if constexpr (!kLow) {
    // One poller per peer and block (a poller per wave measured slower: the polls load the memory
    // system the senders use).
    if (threadIdx.x < kWs && threadIdx.x != rank && !Masked(args, threadIdx.x)) {
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
  // block-uniform (the barrier above published it; one rank's blocks go by the grid's stride)
  const bool closing = (kSolo<kCfg> ? b + int(gridDim.x) : *nextRange) >= numRanges;
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
        const int pair = s + 1 < kWs && s + 1 < numSrc ? 2 : 1;  // (kWs: a second source only where one can be)
        Buf buf[2][kUnroll];
        bool shortRow[2] = {false, false};
        if constexpr (W::kQuant)
#pragma unroll
          for (int p = 0; p < 2; ++p)
            if (p < pair && !src.Peer(s + p, rank))  // (wave-uniform: every lane casts)
#pragma unroll
              for (int u = 0; u < kUnroll; ++u) {
                const bool in = v0 + u * kW < kVecs;
                buf[p][u] = W::Cast(in ? plat::load_peer(src.row[s + p] + v0 + u * kW) : vec16_t{}, in);
              }
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
              if (p < pair && v0 + u * kW < kVecs) {
                if constexpr (W::kQuant) {
                  if (src.Peer(s + p, rank)) buf[p][u] = W::template Load<true>(src.row[s + p], v0 + u * kW);
                } else {
                  buf[p][u] = src.Peer(s + p, rank) ? plat::load_words_relaxed(src.row[s + p] + v0 + u * kW)
                                                    : plat::load_peer(src.row[s + p] + v0 + u * kW);
                }
              }
          AwaitRest<kCfg>(args, target, src, s, pair, withW, v0, t, tw, wv, buf);
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            // a peer's row beyond its short input came as kShortWord words: summed without it, reported
            const bool peer = p < pair && src.Peer(s + p, rank);
            shortRow[p] = plat::wave_any(peer && v0 < kVecs && Holds(buf[p][0], kShortWord));
            if (shortRow[p] && chunk == 0 && lane == 0)
              RecordError(args, kErrPeerShortInput, PeerShortDetail(src.Pe(s + p), rank), uint64_t(t));
          }
        } else {
#pragma unroll
          for (int p = 0; p < 2; ++p)
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (p < pair && v0 + u * kW < kVecs) {
                if constexpr (W::kQuant) {
                  if (src.Peer(s + p, rank)) buf[p][u] = W::template Load<false>(src.row[s + p], v0 + u * kW);
                } else {
                  buf[p][u] = plat::load_peer(src.row[s + p] + v0 + u * kW);
                }
              }
        }
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if constexpr (W::kQuant) {
              if (p < pair && (!kLow || !shortRow[p])) W::Add(buf[p][u], acc[u]);
            } else {
              const T* el = reinterpret_cast<const T*>(&buf[p][u]);
#pragma unroll
              for (int e = 0; e < kPerVec; ++e)
                if (p < pair && (!kLow || !shortRow[p])) acc[u][e] += to_f32(el[e]);
            }
          }
        if constexpr (kLow)  // the peers' words back to empty for the next combine (before the count)
#pragma unroll
          for (int p = 0; p < 2; ++p)
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
              if (p < pair && src.Peer(s + p, rank) && v0 + u * kW < kVecs) {
                if constexpr (W::kQuant) W::template Store<true>(const_cast<vec16_t*>(src.row[s + p]), v0 + u * kW, W::Fill(kEmptyWord));
                else plat::store_words_relaxed(const_cast<vec16_t*>(src.row[s + p]) + v0 + u * kW, WordVec(kEmptyWord));
              }
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
        uint32_t o[4];
        PackWords<T>(acc[u], o);
        out[v0 + u * kW] = vec16_t{o[0], o[1], o[2], o[3]};
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

}  // namespace mori::ep
