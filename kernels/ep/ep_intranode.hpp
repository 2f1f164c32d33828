// Intranode EP dispatch/combine: the portable body (HIP dialect over mori::plat, wave 64 or 32).
//
// Memory model: every rank owns one symmetric arena; a peer's region is peerBase[pe] + off_<region>.
// Region offsets and the rank are runtime args (never Cfg fields), so one binary serves every rank.
//
// Dispatch: block b owns tokens b, b + blockNum, ... (so a small batch still spans the grid), in
// two phases split by a block barrier (per round of owned tokens; one round unless the grid is small).
// 1. Claim: one lane per (token, expert slot) maps ids to destination ranks and drops invalid ids
//    and ranks seen earlier in the token (dedup). One system-scope atomic per (block pass,
//    destination) claims all the block's rows there; the forward map (tok_off) records
//    pe*maxRecv + slot, and shared memory keeps it with the ids and weights for the copy.
// 2. Copy: a work item is one chunk of one owned token's row (waveSize*vecUnroll vectors), spread
//    over the block's waves, so a token is copied by several waves at once. Each vector is loaded
//    once and stored to every destination; a token's first chunk also carries its ids, weights and
//    reverse-map entry. A wave's first chunk is loaded before the claim, overlapping its round trip.
// The last block to finish publishes a done flag (device epoch + 1) on every peer, waits for every
// peer's flag, then publishes total_recv and advances the epoch on the device (graph replays stay
// correct).
//
// Combine (gather/pull): copy the expert output rows that peers will pull into the symmetric staging
// region, a cross-device barrier, then each rank pulls its tokens' rows from the peers' staging
// regions (its own straight from its input, unless that lies in the arena) and sums them in fp32,
// one wave per (token, chunk of the row). When the expert wrote into the staging region
// (zero-copy) and few weights remain to stage, block 0 stages them and tells the peers at once,
// with no grid-wide arrival count. Each block counts itself once it has read the combine epoch (a
// release atomic issued before the pull); the last one advances the epoch when it ends.
//
// Every spin-wait gives up after args.timeoutNs and records which wait, on which rank, for which
// peer, in the host-mapped error words; the host raises on the next call.
//
// Files: ep_dispatch.hpp and ep_combine.hpp hold the two kernel bodies, ep_common.hpp what they share.
#pragma once
#include "ep/ep_combine.hpp"
#include "ep/ep_dispatch.hpp"
