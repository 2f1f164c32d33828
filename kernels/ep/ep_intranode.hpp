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
//    On NVIDIA sm_90+, when the Cfg asks (bulkMinTokens; the host asks only with peers), a block
//    that owns at least bulkMinTokens tokens instead has one thread move whole rows with the
//    bulk-copy unit (each loaded once into shared memory, the first before the claim, and stored
//    from there to every destination) while its waves store the ids, weights and reverse-map
//    entries (BulkRows in ep_dispatch.hpp).
// Before its first copy, each block waits (normally one load) until every peer has finished its
// last combine, which may still read rows in this rank's target regions. When its copies are done,
// each block fences them system-wide and adds its share to its rank's dispatch-done counter on
// every rank, its own too (kDoneUnit per epoch from all the rank's blocks together; block 0 first
// publishes the token count). Block 0 then waits for every rank's counter, publishes total_recv
// and advances the epoch on the device (graph replays stay correct). Each sent row also
// records on its destination where it landed (src_to_recv, tagged with the epoch), for the
// combine's senders.
//
// Combine (gather by push, pipelined): the rows a rank's experts produced go back to their tokens'
// home ranks. A sender task is one range of kRangeTok tokens of one peer, walked in token order
// (src_to_recv gives each token's row here): it pushes the rows (and weights) into the peer's
// comb_recv[source rank, token] and raises that range's flag there with a release store (its low
// bit set if the sender's input was too short for some of the rows: the home rank reports it). A task's
// rows are spread flat over the block's threads, and the next task's loads are issued right after
// this task's stores. A summer claims the next range of its own tokens from a counter, waits for
// every peer's flag of it, then sums each token's rows in fp32: its own straight from the input,
// the peers' from comb_recv. Every rank walks the ranges in the same order, so the sums of the
// first ranges overlap the transfer of the last: with more than one task per block, half the
// blocks send (each claims its tasks after its first three from a counter, in order) while the rest
// sum, and senders join the summing when their pushes are done; otherwise every block sends its
// task, then sums. Before its first store, a sender waits until the peer has finished its previous
// combine (the peer's count, read with the rest of the sender's start, usually says so). A block
// counts itself done as soon as its last loads are in registers, before its last output stores:
// its share of kDoneUnit goes to its rank's combine-done counter on every rank (what the peers'
// next dispatch and combine wait for; the rank's own counts its combine epochs); no block waits
// for another, and none for the output stores to drain. The claim counters come in
// pairs by epoch parity: a combine's block 0 resets the next one's at its end.
//
// Low-latency combine (Cfg lowLatency, the op's choice: on by default for ops of at most 256 tokens
// per rank): no release fence and no range flag. Every 32-bit word of a pushed row is a relaxed
// system-scope store, so the home rank sees each word either empty (CombWord::kEmptyWord, what the
// host fills comb_recv with) or arrived; data words that read as a signal (NaNs) are sent as
// another NaN, and weights carry the combine epoch. A summing wave loads its item and reloads any
// vector still holding an empty word until none does, sums, and sets the words back to empty
// before its block's done count. A row beyond a short input arrives as kShortWord words (the home
// rank reports it).
//
// Split legs (EpCfg phase; the op's split_send_recv): each leg also runs as a send kernel and a
// receive kernel on one stream, with the stream free for other work between them and no SM waiting
// for a peer. Each leg has one place where its blocks stop storing into peers and start waiting
// for them, and the split is there. Dispatch: the send kernel is the claim, the copies and every
// block's done count; the receive kernel is block 0's part (the wait for every rank's count,
// total_recv, the expert counts, the epoch), on one block. Combine: every block of the send kernel
// sends (no dedicated senders) and ends once its pushes and flags are out; every block of the
// receive kernel sums (a fixed range stride) and counts the combine done, for the send kernel's
// reads too (stream order: they are done when it starts). The epochs are read from the counts at
// each kernel's start and only the receive advances them, so both halves see the same epoch.
//
// Every spin-wait gives up after args.timeoutNs and records which wait, on which rank, for which
// peer, in the host-mapped error words; the host raises on the next call.
//
// Files: ep_dispatch.hpp and ep_combine.hpp hold the two kernel bodies, ep_common.hpp what they share
// (with ep_report.hpp, shared with the internode kernels too); ep_dispatch_route.hpp the dispatch
// round's routing; ep_layout.hpp the expert-major layout's (launched after a dispatch), ep_quant.hpp
// the fp8 cast.
// The combine's parts: ep_combine_words.hpp (ranges, flags and signal words, which both sides of a
// row agree on), ep_combine_sender.hpp (the pushes) and ep_combine_summer.hpp (the waits and sums).
#pragma once
#include "ep/ep_combine.hpp"
#include "ep/ep_dispatch.hpp"
#include "ep/ep_layout.hpp"
