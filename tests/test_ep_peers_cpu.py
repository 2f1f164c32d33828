"""CPU tests of what the ranks learn about each other at construction (``ops/ep/peers.py``): the
config comparison, ranks per device, the memory provider choice; and the pointer the ``hip``
backend passes for weights with no rows."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mori_jit.testing.distributed import run_distributed

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
from mori_jit.ops.ep.memory.peers import RankCard, config_mismatch, memory_kind, ranks_sharing_device

BASE = dict(world_size=4, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=2, num_experts_per_token=2)


def _cards(devices, hosts=None, symm=True, **per_rank_cfg):
    hosts = hosts or ["h"] * len(devices)
    out = []
    for r, (dev, host) in enumerate(zip(devices, hosts)):
        extra = {k: v[r] for k, v in per_rank_cfg.items()}
        cfg = EpDispatchCombineConfig(rank=r, **{**BASE, "world_size": len(devices), **extra})
        out.append(RankCard(r, host, dev, symm, cfg))
    return out


def test_ranks_per_device_counts_same_host_and_uuid():
    cards = _cards(["A", "A", "B", "A"], hosts=["h", "h", "h", "other"])
    assert [ranks_sharing_device(cards, r) for r in range(4)] == [2, 2, 1, 1]
    assert ranks_sharing_device(_cards([None, None]), 0) == 1  # host tensors share no SMs


def test_auto_memory_picks_ipc_where_ranks_share_a_device_or_for_one_rank():
    assert memory_kind("auto", _cards(["A", "B"])) == "torch"
    assert memory_kind("auto", _cards(["A", "A"])) == "ipc"
    assert memory_kind("auto", _cards(["A", "B"], symm=False)) == "ipc"
    assert memory_kind("auto", _cards(["A"])) == "ipc"  # nothing to share: a plain allocation
    assert memory_kind("ipc", _cards(["A", "B"])) == "ipc"


def test_impossible_memory_requests_are_refused_naming_the_ranks():
    with pytest.raises(ValueError, match=r"symm_memory='torch': ranks \[0, 1\] share a device"):
        memory_kind("torch", _cards(["A", "A", "B"]))
    with pytest.raises(ValueError, match=r"symm_memory='ipc' needs every rank on one host; the group spans 2 "
                                         r"\(h: ranks \[0\]; z: ranks \[1\]\)"):
        memory_kind("ipc", _cards(["A", "B"], hosts=["h", "z"]))
    with pytest.raises(ValueError, match=r"symm_memory='shm': allowed \('auto', 'torch', 'ipc'\)"):
        EpDispatchCombineConfig(rank=0, **BASE, symm_memory="shm")


def test_config_mismatch_names_the_field_and_every_ranks_value():
    assert config_mismatch(_cards(["A"] * 3)) is None
    # geometry is per rank: each rank sizes its grids for itself
    assert config_mismatch(_cards(["A"] * 3, dispatch_block_num=[8, 16, 32], schedule=[None, None, [(None, 1, 1, 1, 1)]])) is None
    got = config_mismatch(_cards(["A"] * 3, hidden_dim=[64, 64, 128]))
    assert got == ("EpDispatchCombineConfig.hidden_dim differs between ranks (rank 0: 64, rank 1: 64, rank 2: 128); "
                   "every rank must pass the same hidden_dim")
    got = config_mismatch(_cards(["A"] * 2, data_type=[torch.bfloat16, torch.float32]))
    assert "data_type differs between ranks (rank 0: torch.bfloat16, rank 1: torch.float32)" in got
    per_rank = {f.name for f in dataclasses.fields(EpDispatchCombineConfig) if f.metadata.get("per_rank")}
    assert per_rank == {"rank", "dispatch_block_num", "combine_block_num", "warp_num_per_block",
                        "combine_warp_num_per_block", "schedule"}


def _mismatch_job(rank, ws, field, values):
    cfg = EpDispatchCombineConfig(rank=rank, **{**BASE, "world_size": ws, field: values[rank]}, kernel_backend="torch")
    with pytest.raises(ValueError, match=f"EpDispatchCombineConfig.{field} differs between ranks"):
        EpDispatchCombineOp(cfg)
    # the group is still usable: nobody was left inside a collective
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == ws


@pytest.mark.parametrize("field,values", [("hidden_dim", (64, 128)), ("num_experts_per_rank", (2, 4)),
                                          ("data_type", (torch.bfloat16, torch.float32))])
def test_ranks_out_of_step_raise_on_every_rank(field, values):
    run_distributed(_mismatch_job, 2, field, values, timeout=120)


def test_weights_with_no_rows_are_still_weights_given():
    """torch reports data_ptr() == 0 for any empty tensor, which the kernels read as 'no weights':
    a rank that received no rows would then neither send nor sum its tokens' weights."""
    from mori_jit.ops.ep.backends.hip.backend import _weights_ptr

    w = torch.rand(6, 4)
    assert w[:0].data_ptr() == 0  # the premise
    assert _weights_ptr(w[:0], given=0x1000) == 0x1000
    assert _weights_ptr(w, given=0x1000) == w.data_ptr()
    assert _weights_ptr(None, given=0x1000) == 0


def test_ipc_blocks_must_share_a_host_and_a_size():
    from mori_jit.ops.ep.memory.symm import check_peer_blocks, make_provider

    check_peer_blocks([("h", 4096), ("h", 4096)])
    with pytest.raises(RuntimeError, match=r"needs every rank on one host; the group spans 2 \(rank 0: a; rank 1: b\)"):
        check_peer_blocks([("a", 4096), ("b", 4096)])
    with pytest.raises(RuntimeError, match=r"ranks asked for different sizes \[4096, 8192\]"):
        check_peer_blocks([("h", 4096), ("h", 8192)])
    assert {make_provider(k).kind for k in ("torch", "ipc")} == {"torch", "ipc"}
    with pytest.raises(ValueError, match=r"provider 'auto': allowed \('torch', 'ipc', 'nvshmem'\)"):
        make_provider("auto")


def test_arena_layout_is_one_declaration_aligned_in_order():
    from mori_jit.ops.ep.memory.arena import ALIGN, layout

    offsets, total = layout({"a": 1, "b": 256, "c": 0, "d": 300})
    assert offsets == {"a": 0, "b": 256, "c": 512, "d": 512} and total == 512 + 512 and ALIGN == 256
    with pytest.raises(ValueError, match="region 'x': negative size -1"):
        layout({"x": -1})
