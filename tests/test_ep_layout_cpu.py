"""CPU checks of the EP op's declarations: arena layout, args/regions agreement, device error
decoding, and that choosing a backend imports only that backend."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mori_jit.ops.ep.memory.arena import ALIGN, layout
from mori_jit.ops.ep.backends.hip.intranode.errors import decode_error
from mori_jit.ops.ep.backends.hip.intranode.cfg import EP_ARGS, EP_MAX_PEERS, EP_REGIONS, EP_STAMP_WORDS, EpCfg, EpDType, region_bytes

REPO = Path(__file__).resolve().parents[1]


def test_layout_is_aligned_ordered_and_disjoint():
    sizes = {"a": 1, "b": 0, "c": 257, "d": 4096}
    offsets, total = layout(sizes)
    assert list(offsets) == list(sizes)
    assert all(off % ALIGN == 0 for off in offsets.values())
    spans = sorted((offsets[n], offsets[n] + sizes[n]) for n in sizes)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert total >= max(end for _, end in spans) and total % ALIGN == 0
    with pytest.raises(ValueError, match="negative"):
        layout({"x": -1})


def test_every_region_has_a_size_and_an_offset_arg():
    d = EpCfg(worldSize=2, hiddenDim=7168, maxTokPerRank=64, dtype=EpDType.Fp8, waveSize=32)
    c = EpCfg(worldSize=2, hiddenDim=7168, maxTokPerRank=64, waveSize=32)
    sizes = region_bytes(d, c)
    assert list(sizes) == list(EP_REGIONS)
    args = EP_ARGS.names()
    assert [a for a in args if a.startswith("off_")] == [f"off_{r}" for r in EP_REGIONS]
    # the asymmetric legs size their own buffers: fp8 rows are half the bf16 rows combine receives
    assert sizes["disp_out"] * 2 == sizes["comb_recv"] == 2 * 64 * 7168 * 2
    # combine's push targets are indexed by (source rank, token): world_size * M rows, whatever maxRecv
    big = region_bytes(dataclasses.replace(d, maxRecv=5 * 64), dataclasses.replace(c, maxRecv=5 * 64))
    assert big["disp_out"] == 5 * 64 * 7168
    assert big["comb_recv"] == sizes["comb_recv"] == 2 * 64 * 7168 * 2
    assert big["comb_recv_wts"] == 2 * 64 * c.numExpertPerToken * 4
    assert big["comb_flags"] == big["src_to_recv"] == 2 * 64 * 8
    # low latency: no range flags, and weights that carry an epoch (u64); nothing else moves
    low = region_bytes(d, dataclasses.replace(c, lowLatency=True))
    assert low["comb_flags"] == 0 and low["comb_recv_wts"] == 2 * sizes["comb_recv_wts"]
    assert {k: v for k, v in low.items() if k not in ("comb_flags", "comb_recv_wts")} == \
        {k: v for k, v in sizes.items() if k not in ("comb_flags", "comb_recv_wts")}


def test_every_arena_region_is_used_by_a_kernel():
    """Symmetric memory is scarce: a region no kernel addresses (``off_<name>``) is dead weight
    (a staging region for the combine's input would be one: the push combine reads it in place)."""
    bodies = "".join(f.read_text() for f in sorted((REPO / "kernels" / "ep").glob("*.hpp"))
                     if not f.name.endswith("_generated.hpp"))  # (the generated args struct names every region)
    unused = [r for r in EP_REGIONS if not re.search(rf"\boff_{r}\b", bodies)]
    assert not unused, f"arena regions no kernel uses: {unused}"


def test_every_wait_has_a_message_and_the_shared_codes_keep_their_values():
    from mori_jit.ops.ep.backends.hip.intranode.errors import WAIT_MESSAGES
    from mori_jit.ops.ep.backends.hip.intranode.cfg import ErrCode, Stamp, WaitId, XdbRow

    assert set(WAIT_MESSAGES) == set(WaitId)
    # the values are an ABI between kernels, host and recorded benchmark data
    assert [int(w) for w in WaitId] == [1, 2, 3, 4]
    assert [int(c) for c in ErrCode] == [int.from_bytes(c, "big") for c in (b"MORI", b"SHOR", b"PSHR", b"CAPA")]
    assert len(XdbRow) * EP_MAX_PEERS * 8 == region_bytes(EpCfg(worldSize=2), EpCfg(worldSize=2))["xdb"]
    assert max(Stamp) < EP_STAMP_WORDS and len(set(Stamp)) == len(Stamp.__members__)


def test_sync_words_leave_room_for_the_parity_pairs():
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EP_SYNC_WORDS, SYNC_PAIRS, SyncWord

    # a claim counter is two words (word + epoch parity): its second word is no other word
    used = [int(w) for w in SyncWord] + [int(w) + 1 for w in SYNC_PAIRS]
    assert len(set(used)) == len(used) and max(used) < EP_SYNC_WORDS
    assert region_bytes(EpCfg(worldSize=2), EpCfg(worldSize=2))["sync"] == EP_SYNC_WORDS * 8


def test_device_errors_decode_to_which_wait_which_rank_which_peer():
    timeout = [0x4D4F5249, (1 << 48) | (1 << 32) | (0 << 16), 7 << 20, 0]
    msg = decode_error(timeout, 0)
    assert "rank 0: dispatch" in msg and "from rank 1 timed out" in msg
    assert f"never reached {7 << 20} = {1 << 20} x dispatch epoch 7" in msg
    done = decode_error([0x4D4F5249, (2 << 48) | (1 << 32), 3 << 20, 0], 0)  # combine-done
    assert "finish its previous combine" in done and f"never reached {3 << 20} = {1 << 20} x combine epoch 3" in done
    ranges = [0x4D4F5249, (3 << 48) | (0 << 32) | (1 << 16), 9, 0]
    assert "rank 1: combine: waiting for a peer's rows of a token range" in decode_error(ranges, 1)
    assert "from rank 0 timed out" in decode_error(ranges, 1)
    assert "never reached 10 = 2 x combine epoch 5" in decode_error([0x4D4F5249, (3 << 48) | (1 << 16), 10, 0], 1)
    rows = decode_error([0x4D4F5249, (4 << 48) | (0 << 32) | (1 << 16), 9, 0], 1)  # low latency: a token's row
    assert "rank 1: combine (low latency): waiting for a peer's row of a token" in rows
    assert "from rank 0 timed out after MORI_EP_TIMEOUT_S (token 9)" in rows and "never reached" not in rows
    short = [0x53484F52, 1 << 16, (100 << 32) | 60, 0]
    assert "rank 1: combine input had 60 rows but dispatch received 100" in decode_error(short, 1)
    peer_short = [0x50534852, (0 << 32) | (1 << 16), 38, 0]
    msg = decode_error(peer_short, 1)
    assert "rank 1: rank 0's combine input was short" in msg and "(first reported at token 38)" in msg and "is wrong" in msg
    assert "unknown device error" in decode_error([5, 0, 0, 0], 0)
    capacity = decode_error([0x43415041, (3 << 32) | (2 << 16), (70 << 32) | 64, 0], 2)
    assert "rank 2: local expert 3 received 70 (token, expert) pairs, more than expert_capacity=64" in capacity
    assert "raise expert_capacity to at least 70" in capacity


def test_choosing_the_torch_backend_imports_no_jit_runtime():
    code = (
        "import sys, os, torch, torch.distributed as dist\n"
        "os.environ['GLOO_SOCKET_IFNAME']='lo'\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=0, world_size=1)\n"
        "from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp\n"
        "cfg = EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=32, max_num_inp_token_per_rank=4,\n"
        "    num_experts_per_rank=2, num_experts_per_token=2, kernel_backend='torch')\n"
        "with EpDispatchCombineOp(cfg) as op:\n"
        "    assert type(op).__name__ == 'EpDispatchCombineOpTorch'\n"
        "bad = [m for m in ('mori_jit.ops.ep.backends.hip.backend', 'mori_jit.jit.plan', 'mori_jit.jit.runtime')\n"
        "       if m in sys.modules]\n"
        "print('IMPORTED', bad)\n"
        "dist.destroy_process_group()\n"
    )
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run([sys.executable, "-c", code % port], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "IMPORTED []" in p.stdout, p.stdout


class _RecordingProvider:
    """A one-rank memory provider on the host that records releases (the arena's dependency)."""

    kind = "recording"

    def __init__(self):
        self.released = []

    def allocate(self, nbytes, device, group, wait=None):
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, [buf.data_ptr()]

    def release(self, tensor, wait=None):
        self.released.append(tensor)


def test_an_abandoned_arena_keeps_its_memory_and_releases_nothing():
    import gc
    import weakref

    import torch

    from mori_jit.ops.ep.memory.arena import SymmArena

    provider = _RecordingProvider()
    arena = SymmArena.create({"a": 100, "b": 300}, None, torch.device("cpu"), provider)
    block = weakref.ref(arena.tensor)
    arena.abandon()
    gc.collect()
    assert provider.released == [] and arena.tensor.numel() == 0 and arena.peer_bases == []
    assert block() is not None, "an abandoned arena's memory must stay mapped until the process exits"

    closed = SymmArena.create({"a": 100}, None, torch.device("cpu"), provider)
    closed.close()
    assert len(provider.released) == 1 and closed.tensor.numel() == 0
