"""The intranode EP kernels' arena regions and args struct: one table of named regions (their
offsets are runtime args ``off_<name>``, never Cfg fields) and the struct every launch fills,
generated into ``kernels/ep/ep_generated.hpp`` with the config (``intranode.cfg``)."""
from __future__ import annotations

from mori_jit.jit.args import ArgsSchema, i32, ptr, u64

from mori_jit.ops.ep.backends.hip.common.cfg import MASK_REGIONS, leg_io_args

__all__ = ["EP_MAX_PEERS", "EP_REGIONS", "EP_ARGS"]

#: Most ranks one intranode op spans (the size of the peer-pointer array in the args).
EP_MAX_PEERS = 8

#: Symmetric-arena regions (name → doc). Offsets are runtime args ``off_<name>``, never Cfg fields.
EP_REGIONS: dict[str, str] = {
    "disp_out": "received token rows [maxRecv, tokenBytes] (written by peers)",
    "out_wts": "received weights [maxRecv, k] f32 (written by peers)",
    "out_idx": "received expert ids [maxRecv, k] i32 (i64 with ids64) (written by peers)",
    "recv_to_src": "reverse map [maxRecv] i32: srcRank*M + srcTok (written by peers)",
    "tok_off": "forward map [M, k] i32: pe*maxRecv + slot, -1 for dropped/duplicate slots (local)",
    "recv_num": "slot counters [2] i32, by epoch parity (peers add atomically)",
    "total_recv": "received rows of the last dispatch [1] i32 (local)",
    "src_to_recv": "slot of each source token here [ws, M] i64: dispatch epoch << 32 | slot (written by peers)",
    "comb_recv": "combine rows pushed by peers [ws, M, combine tokenBytes], by source rank and token (written by peers); low latency: a word is kEmptyWord until written and once summed (CombWord)",
    "comb_recv_wts": "combine weights pushed by peers [ws, M, k] f32 (written by peers); low latency: u64, combine epoch << 32 | f32 bits",
    "comb_flags": "combine range-ready flags [ws, M] u64, by source rank and token range: 2*epoch, +1 if the sender's input was short (written by peers); none with low latency",
    "xdb": "cross-device words [XdbRow, EP_MAX_PEERS] u64, by writing rank: dispatch-done, combine-done, token count",
    "sync": "local sync words [SyncWord] u64: claim counters (by epoch parity), the dispatch epoch, the error-report claim",
    "stamps": "phase timestamps [EP_STAMP_WORDS] u64 (globaltimer ns, slots: Stamp) of the last call, for profiling (local)",
    "out_scales": "received per-token scales [maxRecv, scaleDim] of scaleTypeSize bytes (written by peers); none without scales",
    "expert_adds": "received (token, local expert) pairs [2, numExpertPerRank] i32, by epoch parity (peers add atomically); none without expertCounts",
    "expert_counts": "the last dispatch's received (token, local expert) pairs [numExpertPerRank] i32 (local); none without expertCounts",
    **MASK_REGIONS,
    "exp_cursor": "expert-major layout: next entry per local expert [numExpertPerRank] u32 (local; the dispatch zeroes it, the layout kernel claims); none without expertCapacity",
    "exp_x": "expert-major layout: rows [numExpertPerRank, expertCapacity, tokenBytes] (local)",
    "exp_scales": "expert-major layout: scales [numExpertPerRank, expertCapacity, scaleDim * scaleTypeSize bytes] (local)",
    "exp_wts": "expert-major layout: each entry's top-k weight [numExpertPerRank, expertCapacity] f32, 0 on padding (local)",
    "exp_maps": "expert-major layout: receive row, source (srcRank*M + srcTok), top-k slot [3, numExpertPerRank, expertCapacity] i32, -1 on padding (local)",
    "exp_entry": "expert-major layout: the entry e*expertCapacity + c of each received (row, top-k slot) [maxRecv, k] i32, -1 for none (local)",
}

EP_ARGS = ArgsSchema("EpArgs", [
    *leg_io_args("dispatch: expert ids [n, k] (int64 with ids64)", "this rank"),
    u64("peerBase", EP_MAX_PEERS, "arena base address of every rank, by rank"),
    *[u64(f"off_{name}", doc=doc) for name, doc in EP_REGIONS.items()],
    ptr("inpScales", "const void", "dispatch: per-token scales [n, scaleDim] of scaleTypeSize bytes, or null"),
    i32("replay", doc="dispatch (routingReplay): 1 = move the payload along the latest dispatch's routing"),
])
