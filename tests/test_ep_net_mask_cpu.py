"""Rank masking on the internode kernels, on the CPU (docs/design.md §6, "Rank masking"): the mask
regions declared once for both families, which ops serve masking (``v2_ll`` alone) and the refusal's
message otherwise, the timeout's peer the host masks, and nvcc's PTX of every ``v2_ll`` kernel
holding the mask's reads and the dropped pairs' count. The GPU runs are in ``test_gpu_ep_mask.py``.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from conftest import REPO
from jit_helpers import toolchain_or_skip
from mori_jit.jit.devlib import DeviceLibraryError
from mori_jit.jit.nvshmem import NVSHMEM
from mori_jit.ops.ep import EpDispatchCombineConfig, EpUnsupportedError
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, DISPATCH, MASK_REGIONS, SPLIT_PHASES
from mori_jit.ops.ep.backends.hip.common.consts import ErrCode
from mori_jit.ops.ep.backends.hip.common.wait_errors import waited_for
from mori_jit.ops.ep.backends.hip.internode.cfg import EP_NET_REGIONS, NetWaitId, net_region_bytes
from mori_jit.ops.ep.backends.hip.internode.errors import decode_net_error
from mori_jit.ops.ep.backends.hip.internode.kernels import NET_SYNC_REGIONS
from mori_jit.ops.ep.backends.hip.internode.specs import net_spec
from mori_jit.ops.ep.backends.hip.internode.variants import mask_refusal, net_variants
from mori_jit.ops.ep.backends.hip.intranode.args import EP_MAX_PEERS, EP_REGIONS
from mori_jit.ops.ep.core.kernel_set import KernelSet
from mori_jit.ops.ep.core.mask import RankMask

BASE = dict(hidden_dim=256, max_num_inp_token_per_rank=64, num_experts_per_rank=2, num_experts_per_token=4)


def _cfg(**kw):
    return EpDispatchCombineConfig(**{"rank": 0, "world_size": 8, "gpu_per_node": 4, "internode_kernel": "v2_ll",
                                      **BASE, **kw})


def _refusal(cfg) -> str:
    return mask_refusal(cfg, net_variants(cfg, "sm_90a", 132).families)


# -- one declaration -------------------------------------------------------------------------------

def test_the_mask_regions_are_declared_once_for_both_families():
    import torch
    from test_ep_layout_cpu import _RecordingProvider

    from mori_jit.ops.ep.backends.hip.common.host import mask_views
    from mori_jit.ops.ep.memory.arena import SymmArena

    for table in (EP_REGIONS, EP_NET_REGIONS):
        assert {n: table[n] for n in MASK_REGIONS} == MASK_REGIONS
    var = net_variants(_cfg(), "sm_90a", 132)
    sizes = net_region_bytes(var.dispatch[0], var.combine[0])
    assert (sizes["rank_mask"], sizes["masked_pairs"]) == (8 * 4, 3 * 4)  # one word per rank; parity pair, last
    from mori_jit.ops.ep.backends.hip.intranode.cfg import region_bytes
    from mori_jit.ops.ep.backends.hip.variants import ep_variants
    intra = ep_variants(EpDispatchCombineConfig(rank=0, world_size=4, **BASE), "sm_90a", 132)
    assert region_bytes(intra.dispatch[0], intra.combine[0])["rank_mask"] == EP_MAX_PEERS * 4
    # a reset clears the dropped pairs' count and keeps the mask (it runs among the survivors)
    assert "masked_pairs" in NET_SYNC_REGIONS and "rank_mask" not in NET_SYNC_REGIONS
    arena = SymmArena.create(sizes, None, torch.device("cpu"), _RecordingProvider())
    views, base = mask_views(arena, 8), arena.tensor.data_ptr()
    assert (views["rank_mask"].data_ptr() - base, views["rank_mask"].dtype, tuple(views["rank_mask"].shape)) == \
        (arena.offsets["rank_mask"], torch.int32, (8,))
    assert (views["masked_pairs"].data_ptr() - base, tuple(views["masked_pairs"].shape)) == \
        (arena.offsets["masked_pairs"] + 2 * 4, (1,))  # (the last dispatch's count: the third word)
    arena.close()


# -- which ops serve it ----------------------------------------------------------------------------

def test_v2_ll_ops_serve_masking():
    assert _refusal(_cfg()) == ""
    # auto whose every call is at most the threshold builds v2_ll alone
    assert _refusal(_cfg(internode_kernel="auto", internode_auto_ll_max_tokens=64)) == ""


@pytest.mark.parametrize("kw, why", [
    ({"internode_kernel": "v2"}, "internode_kernel='v2' builds"),
    ({"internode_kernel": "auto", "max_num_inp_token_per_rank": 128, "internode_auto_ll_max_tokens": 32},
     "internode_kernel='auto' with max_num_inp_token_per_rank=128 > internode_auto_ll_max_tokens=32 builds"),
], ids=["v2", "auto-with-v2"])
def test_ops_that_build_v2_refuse_masking_naming_what_serves_it(kw, why):
    """The op's refusal (``core.mask.RankMask``, over the KernelSet the internode kernel set hands
    it): the field and its value, why, and what is allowed; nothing is masked."""
    cfg = _cfg(**kw)
    kernels = KernelSet(dispatch=None, combine=None, schedule=None, capabilities=frozenset(),
                        mask_refusal=_refusal(cfg))
    mask = RankMask(SimpleNamespace(cfg=cfg, _kernels=kernels, group=None, _watch=None, _number=0))
    with pytest.raises(EpUnsupportedError) as e:
        mask.set(3, True)
    msg = str(e.value)
    assert msg.startswith(f"rank masking (mask_rank(3)): {why} the 'v2' family"), msg
    assert "relay rank" in msg and "internode_kernel='v2_ll'" in msg and "low-latency" in msg, msg
    assert "max_num_inp_token_per_rank <= internode_auto_ll_max_tokens" in msg, msg
    assert mask.masked == frozenset() and mask.live == tuple(range(8))


def test_a_timeout_names_the_peer_the_host_masks():
    for wait in NetWaitId:
        detail = (int(wait) << 48) | (5 << 32) | (2 << 16)
        assert waited_for(detail) == 5
        assert "from rank 5 timed out" in decode_net_error([int(ErrCode.kErrTimeout), detail, 0, 0])


# -- nvcc's PTX ------------------------------------------------------------------------------------

def _line(header: str, pattern: str) -> int:
    lines = (REPO / "kernels" / "ep" / header).read_text().splitlines()
    hits = [i + 1 for i, text in enumerate(lines) if pattern in text]
    assert len(hits) == 1, (header, pattern, hits)
    return hits[0]


def _code_lines(ptx: str, header: str) -> set[int]:
    """The lines of ``kernels/ep/<header>`` that instructions of ``ptx`` come from (its line info)."""
    files = {m.group(1) for m in re.finditer(r'\.file\s+(\d+)\s+"([^"]+)"', ptx) if m.group(2).endswith(f"ep/{header}")}
    return {int(m.group(2)) for m in re.finditer(r"\.loc\s+(\d+)\s+(\d+)\s", ptx) if m.group(1) in files}


def test_every_v2_ll_kernel_reads_the_mask_and_the_dispatch_counts_the_dropped_pairs(tmp_path):
    """Each v2_ll kernel (whole legs and halves) holds code of the mask's read; the dispatch's send
    holds the dropped pairs' add and its receive their publication."""
    from test_ep_net_split_cpu import _ptx

    tc = toolchain_or_skip("sm_90a")
    try:
        NVSHMEM.locate()
    except DeviceLibraryError as e:
        pytest.skip(f"NVSHMEM absent: {e}")
    masked = _line("ep_net_common.hpp", "MORI_DEVICE bool Masked(")
    add = _line("ep_net_ll.hpp", "plat::atomic_add_device(drops,")
    publish = _line("ep_net_ll.hpp", "drops[2] = ")
    var = net_variants(_cfg(split_send_recv=True, dispatch_block_num=8, combine_block_num=8), "sm_90a", 132)
    for leg, legs in ((DISPATCH, var.dispatch), (COMBINE, var.combine)):
        for c in (legs[0], *(var.half(leg, p)[0] for p in SPLIT_PHASES)):
            ptx = _ptx(tc, net_spec("v2_ll", leg), c, tmp_path)
            common, ll = _code_lines(ptx, "ep_net_common.hpp"), _code_lines(ptx, "ep_net_ll.hpp")
            assert masked in common, (leg, c.phase)
            if leg == DISPATCH:
                assert (add in ll) == (c.phase.name != "Recv") and (publish in ll) == (c.phase.name != "Send"), \
                    (c.phase, add in ll, publish in ll)
