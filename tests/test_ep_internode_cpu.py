"""Internode EP on the CPU: config rules, regions, family selection, the gate, the tuning table,
precompile's walk, and a real nvcc build + NVSHMEM device link of every internode kernel for sm_90a.

The GPU runs are in ``tests/test_gpu_ep_internode.py``.
"""
from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import pytest

from conftest import REPO
from jit_helpers import EM_CUDA, STT_FUNC, elf_header, elf_symbols, toolchain_or_skip
from mori_jit.jit.compile import build, resolve
from mori_jit.jit.devlib import DeviceLibraryError
from mori_jit.jit.fields import ConfigError
from mori_jit.jit.nvshmem import NVSHMEM
from mori_jit.jit.toolchain import make_toolchain
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.internode.errors import NET_WAIT_MESSAGES, decode_net_error
from mori_jit.ops.ep.backends.hip.internode.cfg import (EP_NET_ARGS, EP_NET_REGIONS, LEGS, EpNetCfg, ErrCode, NetWaitId,
                                           make_net_cfg, net_region_bytes)
from mori_jit.ops.ep.backends.hip.internode.specs import NET_SPECS
from mori_jit.ops.ep.backends.hip.intranode.cfg import EpDType
from mori_jit.ops.ep.backends.hip.internode.tuning import DEFAULT_ROWS, NET_TABLE, check_rows, net_rows
from mori_jit.ops.ep.backends.hip.internode.variants import bucket_families, internode_gaps, net_variants
from mori_jit.ops.ep.backends.hip.variants import precompile_targets

BASE = dict(hidden_dim=256, max_num_inp_token_per_rank=64, num_experts_per_rank=2, num_experts_per_token=4)


def _cfg(**kw):
    return EpDispatchCombineConfig(**{"rank": 0, "world_size": 4, "gpu_per_node": 2, "internode_kernel": "v2_ll",
                                      **BASE, **kw})


# -- config and regions ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"worldSize": 6, "gpuPerNode": 4}, "worldSize must be a multiple of gpuPerNode"),
    ({"worldSize": 1, "gpuPerNode": 1}, "worldSize must be >= 2"),
    ({"numExpertPerToken": 33}, "numExpertPerToken \\(topk\\) must fit in one warp"),
    ({"hiddenDim": 7}, "multiple of 16"),
    ({"warpPerBlock": 33}, "warpPerBlock\\*waveSize must be <= 1024"),
])
def test_bad_net_cfgs_name_the_rule(kw, match):
    with pytest.raises(ConfigError, match=match):
        EpNetCfg(**kw)


def test_the_combine_refuses_byte_dtypes_and_legs_take_the_requested_geometry():
    with pytest.raises(ConfigError, match="Fp8 cannot be summed"):
        make_net_cfg("combine", "sm_90a", {"dtype": "Fp8"})
    assert make_net_cfg("dispatch", "sm_90a", {"dtype": "Fp8"}).dtype.name == "Fp8"
    c = make_net_cfg("dispatch", "sm_90a", {"blockNum": 40, "warpPerBlock": 16})
    assert (c.blockNum, c.warpPerBlock) == (40, 16)
    with pytest.raises(ValueError, match="internode leg must be one of"):
        make_net_cfg("dispatch_send", "sm_90a", {})


def test_regions_and_args_come_from_one_table():
    disp = EpNetCfg(worldSize=4, gpuPerNode=2, hiddenDim=256, maxTokPerRank=64, numExpertPerToken=4)
    sizes = net_region_bytes(disp, disp)
    assert list(sizes) == list(EP_NET_REGIONS)
    offsets = [f.name for f in EP_NET_ARGS.fields if f.name.startswith("off_")]
    assert offsets == [f"off_{n}" for n in EP_NET_REGIONS]
    assert sizes["disp_out"] == 4 * 64 * 512 and sizes["comb_recv"] == 4 * 64 * 512
    assert sizes["signals"] == 6 * 4 * 8  # one word per rank in each signal row
    assert all(sizes[n] == 0 for n in EP_NET_REGIONS if EP_NET_REGIONS[n].startswith("v2:"))
    with_v2 = net_region_bytes(disp, disp, ("v2_ll", "v2"))
    assert with_v2["relay"] == 2 * 64 * 512 and with_v2["comb_relay"] == 4 * 64 * 512  # 2 nodes; 4 ranks
    assert with_v2["relay_meta"] == 2 * 64 * (2 * 4 + 3) * 4
    assert {n for n in EP_NET_REGIONS if with_v2[n] != sizes[n]} == {n for n in EP_NET_REGIONS
                                                                     if EP_NET_REGIONS[n].startswith("v2:")}
    fp32 = EpNetCfg(worldSize=4, gpuPerNode=2, hiddenDim=256, maxTokPerRank=64, numExpertPerToken=4, dtype=EpDType.Fp32)
    assert net_region_bytes(disp, fp32)["comb_recv"] == 2 * sizes["comb_recv"]


# -- selection and the gate ------------------------------------------------------------------------

def test_auto_switches_family_at_the_threshold():
    cfg = _cfg(internode_kernel="auto", max_num_inp_token_per_rank=1024, internode_auto_ll_max_tokens=512)
    assert bucket_families(cfg, [128, 512, None]) == ("v2_ll", "v2_ll", "v2")
    small = _cfg(internode_kernel="auto", max_num_inp_token_per_rank=256)
    assert bucket_families(small, [128, None]) == ("v2_ll", "v2_ll")  # every call is at most 256 tokens
    assert bucket_families(_cfg(), [128, None]) == ("v2_ll", "v2_ll")


def test_v2_ll_variants_pick_by_token_count_one_kernel_per_leg():
    var = net_variants(_cfg(max_num_inp_token_per_rank=512), "sm_90a", 132)
    assert var.schedule.edges == (128, None) and var.families == ("v2_ll", "v2_ll")
    assert [var.schedule.index(n) for n in (0, 1, 128, 129, 512)] == [0, 0, 0, 1, 1]
    assert [d.blockNum for d in var.dispatch] == [16, 32]  # DEFAULT_ROWS
    names = [s.name for s, _ in var.requests()]
    assert names == ["ep_ll_dispatch", "ep_ll_combine", "ep_ll_dispatch", "ep_ll_combine"]


def test_auto_adds_the_threshold_edge_and_builds_both_families():
    cfg = _cfg(internode_kernel="auto", max_num_inp_token_per_rank=256, internode_auto_ll_max_tokens=100)
    var = net_variants(cfg, "sm_90a", 132)
    assert var.schedule.edges == (100, 128, None) and var.families == ("v2_ll", "v2", "v2")
    assert [var.schedule.index(n) for n in (100, 101, 128, 129, 256)] == [0, 1, 1, 2, 2]
    assert len(var.dispatch) == len(var.combine) == 3
    names = {s.name for s, _ in var.requests()}
    assert names == {f"ep_{f}_{leg}" for f in ("ll", "v2") for leg in LEGS}
    assert net_variants(_cfg(internode_kernel="v2"), "sm_90a", 132).families == ("v2",)


def test_the_share_of_the_sms_clamps_and_refuses_pins():
    var = net_variants(_cfg(), "sm_90a", 132, ranks_per_device=8)
    assert max(c.blockNum for c in var.combine) <= 132 // 8
    with pytest.raises(ConfigError, match="dispatch_block_num=40 exceeds 16"):
        net_variants(_cfg(dispatch_block_num=40), "sm_90a", 132, ranks_per_device=8)


def test_an_mps_thread_limit_is_already_the_share_of_the_sms(monkeypatch):
    from mori_jit.ops.ep.backends.hip.common.grid import ranks_dividing_cus
    from mori_jit.testing.gpu_world_shmem import MPS_THREAD_PERCENTAGE
    monkeypatch.delenv(MPS_THREAD_PERCENTAGE, raising=False)
    assert ranks_dividing_cus(8) == 8  # the device reports every SM: each of 8 ranks takes an eighth
    monkeypatch.setenv(MPS_THREAD_PERCENTAGE, "12")
    assert ranks_dividing_cus(8) == 1  # the device reports this process's 12 %, already its share
    assert max(c.blockNum for c in net_variants(_cfg(), "sm_90a", 14, ranks_dividing_cus(8)).combine) == 14


@pytest.mark.parametrize("kw, match", [
    ({"world_size": 128, "gpu_per_node": 64}, "gpu_per_node=64 > 32"),
    ({"symm_memory": "ipc"}, "the internode arena is NVSHMEM symmetric memory"),
    ({"world_size": 6, "gpu_per_node": 4}, "world_size must be a multiple of gpu_per_node"),
])
def test_the_gate_names_what_is_missing(kw, match):
    cfg = _cfg(**kw)
    assert any(match in g for g in internode_gaps(cfg, "sm_90a")), internode_gaps(cfg, "sm_90a")
    with pytest.raises(ConfigError, match=re.escape(match)):
        net_variants(cfg, "sm_90a", 132)


def test_amd_is_refused_by_engine_name():
    (gap,) = internode_gaps(_cfg(), "gfx942")
    assert "rocSHMEM" in gap and "mori-shmem" in gap and "gfx942" in gap


# -- tuning table ----------------------------------------------------------------------------------

def test_every_table_entry_is_paired_rows():
    check_rows(DEFAULT_ROWS, "DEFAULT_ROWS")
    for key, by_dtype in NET_TABLE.items():
        for dtype, rows in by_dtype.items():
            check_rows(rows, f"NET_TABLE[{key}][{dtype}]")


@pytest.mark.parametrize("rows, match", [
    (((None, 8, 0, 4, 8, 0),), "has 6 values"),
    (((64, 8, 0, 4, 8, 0, 4),), "None in the last row only"),
    (((64, 8, 0, 4, 8, 0, 4), (32, 8, 0, 4, 8, 0, 4), (None, 8, 0, 4, 8, 0, 4)), "must rise"),
    (((None, 0, 0, 4, 8, 0, 4),), "blocks and warps must be ints >= 1"),
    (((None, 8, 8, 4, 8, 0, 4),), "network blocks"),
])
def test_bad_rows_are_refused(rows, match):
    with pytest.raises(ValueError, match=match):
        check_rows(rows)


def test_lookup_clamps_to_the_budget_and_prefers_the_device_key(monkeypatch):
    assert net_rows("sm_90a", 4, 256, 4, "bf16", 10) == ((128, 10, 0, 8, 10, 0, 8), (None, 10, 0, 8, 10, 0, 8))
    monkeypatch.setitem(NET_TABLE, (None, 4, 256, 4), {"bf16": ((None, 4, 1, 4, 6, 2, 4),)})
    monkeypatch.setitem(NET_TABLE, ("sm_100a", 4, 256, 4), {"bf16": ((None, 8, 2, 4, 8, 2, 4),)})
    assert net_rows("sm_90a", 4, 256, 4, "bf16", 132) == ((None, 4, 1, 4, 6, 2, 4),)
    assert net_rows("sm_100a", 4, 256, 4, "bf16", 132) == ((None, 8, 2, 4, 8, 2, 4),)
    assert net_rows("sm_100a", 4, 256, 4, "fp8", 132) == DEFAULT_ROWS
    assert net_rows("sm_90a", 4, 256, 4, "bf16", 3) == ((None, 3, 1, 4, 3, 2, 4),)


# -- specs, names, keys, precompile ----------------------------------------------------------------

def test_each_leg_is_its_own_spec_with_its_own_names_and_keys(fake_cc, monkeypatch, tmp_path):
    _fake_nvshmem(monkeypatch, tmp_path)
    tc = make_toolchain("sm_90a")
    var = net_variants(_cfg(), "sm_90a", 132)
    entries = {spec.entry_name(c) for spec, c in var.requests()}
    assert len(entries) == len(var.requests())
    assert all(e.startswith("mori_epll_") and "_ws4_g2_h256_k4_" in e for e in entries)
    keys = {resolve(spec, c, tc).key for spec, c in var.requests()}
    assert len(keys) == len(var.requests())
    assert set(NET_SPECS) == {(f, leg) for f in ("v2_ll", "v2") for leg in LEGS}


def test_precompile_builds_the_live_ops_walk(fake_cc, monkeypatch, tmp_path, capsys):
    from mori_jit.cli import main
    _fake_nvshmem(monkeypatch, tmp_path)
    request = {"world_size": "8", "gpu_per_node": "2", "internode_kernel": "v2_ll",
               **{k: str(v) for k, v in BASE.items()}}
    live = net_variants(EpDispatchCombineConfig(rank=0, world_size=8, gpu_per_node=2, internode_kernel="v2_ll", **BASE),
                        "sm_90a", 132).requests()
    assert precompile_targets(request, "sm_90a") == live
    assert main(["precompile", "--arch", "sm_90a", "--ep", *(f"{k}={v}" for k, v in request.items())]) == 0
    built = {c["cwd"] for c in fake_cc.compiles() if "-dlink" not in c["argv"]}  # (one build dir each)
    assert len([c for c in fake_cc.compiles() if "-dlink" in c["argv"]]) == len(live)
    assert len(built) == len(live)


def _fake_nvshmem(monkeypatch, tmp_path) -> Path:
    root = tmp_path / "nvshmem"
    (root / "include" / "non_abi").mkdir(parents=True)
    (root / "include" / "nvshmem.h").write_text("#pragma once\n")
    (root / "lib").mkdir()
    (root / "lib" / "libnvshmem_device.a").write_bytes(b"!<arch>\nfake\n")
    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(root))
    return root


# -- errors and the transport ----------------------------------------------------------------------

def test_every_wait_has_a_message_and_a_timeout_names_wait_peer_and_rank():
    assert set(NET_WAIT_MESSAGES) == set(NetWaitId)
    detail = (int(NetWaitId.kNetWaitCombineDone) << 48) | (3 << 32) | (1 << 16)
    msg = decode_net_error([int(ErrCode.kErrTimeout), detail, 5 << 20, 0])
    assert msg.startswith("rank 1: combine: waiting for a peer's rows") and "from rank 3 timed out" in msg
    msg = decode_net_error([int(ErrCode.kErrShortInput), 2 << 16, (10 << 32) | 7, 0])
    assert msg.startswith("rank 2: combine input had 7 rows but dispatch received 10")
    msg = decode_net_error([int(ErrCode.kErrPeerShortInput), (5 << 32) | (2 << 16), 0, 0])
    assert msg.startswith("rank 2: rank 5's combine input was short") and "output on rank 2 is wrong" in msg


def test_internode_bodies_reach_the_engine_only_through_the_transport():
    from mori_jit.ops.ep.backends.hip.internode.specs import FAMILY_BODIES
    bodies = ["ep/ep_net_common.hpp"] + [header for header, _ in FAMILY_BODIES.values()]
    code = ""
    for rel in bodies:
        text = (REPO / "kernels" / rel).read_text()
        body = "\n".join(ln.split("//")[0] for ln in text.splitlines())
        assert not re.search(r"\bnvshmem\w*", body), f"kernels/{rel}: an engine call outside kernels/transport/"
        code += body
    for call in ("put_warp", "put_int", "atomic_fetch_add", "signal_add", "peer_ptr", "quiet"):  # (all in use)
        assert f"transport::{call}(" in code, call


# -- a real build ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtypes, kernel", [(("bf16", "bf16"), "auto"), (("fp8", "fp32"), "v2_ll")],
                         ids=["bf16-auto", "fp8-fp32-ll"])
def test_real_nvcc_builds_and_device_links_every_internode_kernel(dtypes, kernel):
    import torch
    tc = toolchain_or_skip("sm_90a")
    try:
        NVSHMEM.locate()
    except DeviceLibraryError as e:
        pytest.skip(f"NVSHMEM absent: {e}")
    names = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}
    # auto on both sides of its threshold; one geometry, so the buckets of a family share binaries
    cfg = _cfg(dispatch_data_type=names[dtypes[0]], combine_data_type=names[dtypes[1]], internode_kernel=kernel,
               max_num_inp_token_per_rank=128, internode_auto_ll_max_tokens=64, dispatch_block_num=8,
               combine_block_num=8)
    var = net_variants(cfg, "sm_90a", 132)
    assert set(var.families) == ({"v2_ll", "v2"} if kernel == "auto" else {kernel})
    for spec, c in var.requests():
        entry = build(spec, c, tc)
        data = entry.read_binary()
        assert elf_header(data)["machine"] == EM_CUDA
        assert struct.unpack_from("<H", data, 0x10)[0] == 2  # ET_EXEC: device-linked
        symbols = elf_symbols(data)
        assert symbols.get(spec.entry_name(c)) == STT_FUNC, spec.entry_name(c)
        assert "nvshmemi_device_lib_version_d" in symbols  # NVSHMEM's device library is linked in


# -- the GPU harness's MPS share -------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_every_rank_sharing_a_gpu_gets_an_equal_mps_share_summing_to_at_most_100(ranks):
    from mori_jit.testing.gpu_world_shmem import mps_thread_percentage
    share = mps_thread_percentage(ranks)
    if ranks == 1:
        assert share is None  # one PE per GPU: no limit
    else:
        assert 1 <= share and share * ranks <= 100 and (share + 1) * ranks > 100
    with pytest.raises(ValueError, match="ranks_per_gpu=0"):
        mps_thread_percentage(0)


def test_plain_precompile_builds_internode_kernels_only_where_they_can_be(fake_cc, monkeypatch, tmp_path):
    spec = NET_SPECS[("v2_ll", "dispatch")]
    assert spec.precompile_cfgs(make_toolchain("gfx90a")) == []  # no AMD transport
    _fake_nvshmem(monkeypatch, tmp_path)
    assert spec.precompile_cfgs(make_toolchain("sm_90a")) == [spec.default_cfg(make_toolchain("sm_90a"))]
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(tmp_path / "none"))
    assert spec.precompile_cfgs(make_toolchain("sm_90a")) == []  # NVSHMEM not installed there
    with pytest.raises(ConfigError, match=r"no SHMEM transport for gfx90a \(amd\); they run on NVSHMEM"):
        spec.default_cfg(make_toolchain("gfx90a"))


# -- the NVSHMEM arena's checks --------------------------------------------------------------------

def _nvshmem_gap_job(rank, ws):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from mori_jit.ops.ep.memory.nvshmem import nvshmem_gap
    sub = dist.new_group([1])  # (collective: every rank creates it)
    symm_mem.is_nvshmem_available = lambda: False  # this torch build, as a CUDA build without NVSHMEM
    assert "NVSHMEM is not available to torch" in nvshmem_gap(dist.group.WORLD)
    symm_mem.is_nvshmem_available = lambda: True
    assert nvshmem_gap(dist.group.WORLD) is None
    if rank == 1:
        assert nvshmem_gap(sub) == ("the op's group (rank 0 of 1) is not the whole default group (rank 1 of 2): "
                                    "NVSHMEM's PEs are the default group's ranks")


def test_the_nvshmem_arena_needs_nvshmem_and_the_default_group():
    from mori_jit.testing.distributed import run_distributed
    run_distributed(_nvshmem_gap_job, 2, timeout=120)


def test_the_backend_is_chosen_once_and_a_fixed_other_one_is_named(monkeypatch):
    from types import SimpleNamespace

    from mori_jit.ops.ep.memory import nvshmem as nvshmem_memory

    calls = []

    def refuse(name):
        calls.append(name)
        raise RuntimeError("cannot change the backend after an allocation")

    monkeypatch.setattr(nvshmem_memory, "_BACKEND_CHOSEN", False)
    fixed = SimpleNamespace(get_backend=lambda dev: "CUDA", set_backend=refuse)
    with pytest.raises(RuntimeError, match=r"already uses the 'CUDA' backend.*symm_memory='ipc'"):
        nvshmem_memory._use_nvshmem_backend(fixed, "cuda:0")
    free = SimpleNamespace(get_backend=lambda dev: None, set_backend=calls.append)
    nvshmem_memory._use_nvshmem_backend(free, "cuda:0")
    nvshmem_memory._use_nvshmem_backend(free, "cuda:0")  # once per process
    assert calls == ["NVSHMEM", "NVSHMEM"]


def test_the_ranks_get_their_share_and_the_environment_is_restored(monkeypatch):
    from mori_jit.testing import gpu_world_shmem
    from mori_jit.testing.gpu_world import placement

    seen = []
    monkeypatch.setattr(gpu_world_shmem, "placement", lambda ws: placement(ws, gpus=1))  # one GPU
    monkeypatch.setattr(gpu_world_shmem, "run_ep_job",
                        lambda fn, ws, *a, timeout: seen.append(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")))
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")
    gpu_world_shmem.run_shmem_job(None, 8)
    gpu_world_shmem.run_shmem_job(None, 3)
    monkeypatch.setattr(gpu_world_shmem, "placement", lambda ws: placement(ws, gpus=8))  # a GPU per rank
    gpu_world_shmem.run_shmem_job(None, 8)
    assert seen == ["12", "33", "40"] and os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"


def test_the_receive_views_alias_their_regions_of_the_internode_arena():
    import torch
    from test_ep_layout_cpu import _RecordingProvider

    from mori_jit.ops.ep.memory.arena import SymmArena
    from mori_jit.ops.ep.backends.hip.common.host import receive_views

    cfg = _cfg()
    var = net_variants(cfg, "sm_90a", 132)
    arena = SymmArena.create(net_region_bytes(var.dispatch[0], var.combine[0]), None, torch.device("cpu"),
                             _RecordingProvider())
    cap = cfg.recv_capacity
    views = receive_views(arena, cfg, cap)
    base = arena.tensor.data_ptr()
    expect = {"out": ("disp_out", cfg.dispatch_dtype, (cap, cfg.hidden_dim)),
              "weights": ("out_wts", torch.float32, (cap, cfg.num_experts_per_token)),
              "indices": ("out_idx", torch.int32, (cap, cfg.num_experts_per_token)),
              "recv_src": ("recv_to_src", torch.int32, (cap,)), "total_recv": ("total_recv", torch.int32, (1,))}
    for field, (region, dtype, shape) in expect.items():
        t = getattr(views, field)
        assert (t.data_ptr() - base, t.dtype, tuple(t.shape)) == (arena.offsets[region], dtype, shape), field
    arena.close()
