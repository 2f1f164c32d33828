"""CPU tests of the EP op: the torch backend on gloo through the public API, the capability gate,
config errors, the tuning lookup, and EpCfg construction."""
from __future__ import annotations

import dataclasses
import re

import subprocess
import sys

import pytest
import torch

from conftest import REPO

from mori_jit.jit.fields import ConfigError
from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpUnsupportedError
from mori_jit.ops.ep.backends.hip.intranode import tuning
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, DISPATCH, EpCfg, EpDType, make_ep_cfg
from mori_jit.ops.ep.backends.hip.variants import DEFAULT_NUM_CUS, ep_variants
from mori_jit.testing.distributed import run_distributed

FP8 = torch.float8_e4m3fn


def _op_job(rank, ws):
    from mori_jit.testing.golden import golden_check, make_inputs

    gen = torch.Generator().manual_seed(31 + rank)
    cpu = torch.device("cpu")
    m, hidden = 24, 64
    for k in (1, 8):
        cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=m,
                                      num_experts_per_rank=4, num_experts_per_token=k, kernel_backend="torch")
        with EpDispatchCombineOp(cfg) as op:
            assert type(op).__name__ == "EpDispatchCombineOpTorch" and isinstance(op, EpDispatchCombineOp)
            for n, drop, all_to in ((m, 0.0, None), (0, 0.0, None), (m - 3 * rank, 0.4, None), (m, 0.0, 0)):
                x, w, idx = make_inputs(rank, n, hidden, k, cfg.num_experts, torch.bfloat16, cpu, gen,
                                        drop_frac=drop, all_to_rank=all_to, world_size=ws)
                out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
                assert out.shape == (cfg.recv_capacity, hidden) and total.dtype == torch.int32
                y, y_w = op.combine(out, weights=out_w, routing=routing)
                golden_check(op.group, rank, ws, m, cfg.num_experts_per_rank, x, w, idx, out, out_w, out_idx,
                             total, routing.recv_src, y, y_w)
                # caller-provided outputs: written in place (poisoned first) and returned as is
                y2, y_w2 = torch.full_like(y, float("nan")), torch.full_like(y_w, float("nan"))
                r = op.combine(out, weights=out_w, routing=routing, out=y2, out_weights=y_w2)
                assert r[0] is y2 and r[1] is y_w2
                assert torch.equal(y2, y) and torch.equal(y_w2, y_w)
                with pytest.raises(ValueError, match=r"out: expected shape \[%d, %d\]" % (n, hidden)):
                    op.combine(out, weights=out_w, routing=routing, out=torch.empty(n + 1, hidden, dtype=y.dtype))
                with pytest.raises(TypeError, match="out_weights: expected dtype torch.float32"):
                    op.combine(out, weights=out_w, routing=routing, out_weights=y_w.double())
                with pytest.raises(ValueError, match="out_weights: given without weights"):
                    op.combine(out, routing=routing, out_weights=y_w2)
                if n:  # an output that aliases the combine input is refused
                    with pytest.raises(ValueError, match="out: overlaps input"):
                        op.combine(out, weights=out_w, routing=routing, out=out[:n])
    # asymmetric legs: fp8 moved as bytes, bf16 combined
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=m,
                                  num_experts_per_rank=4, num_experts_per_token=4, dispatch_data_type=FP8,
                                  combine_data_type=torch.bfloat16, kernel_backend="torch")
    with EpDispatchCombineOp(cfg) as op:
        x, w, idx = make_inputs(rank, m, hidden, 4, cfg.num_experts, FP8, cpu, gen)
        out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        golden_check(op.group, rank, ws, m, 4, x, w, idx, out, out_w, out_idx, total, routing.recv_src, None, None)
        # input validation names the argument; nothing is sent for a rejected call
        with pytest.raises(TypeError, match="indices: expected dtype torch.int32"):
            op.dispatch(x, w, None, idx.long())
        with pytest.raises(ValueError, match="exceed max_num_inp_token_per_rank"):
            op.dispatch(torch.cat([x, x]), w, None, idx)
        with pytest.raises(TypeError, match="input: expected dtype"):
            op.dispatch(x.view(torch.uint8).to(torch.bfloat16), w, None, idx)
        with pytest.raises(ValueError, match="weights: expected shape"):
            op.dispatch(x, w[:, :2].contiguous(), None, idx)
        with pytest.raises(ValueError, match="contiguous"):
            op.dispatch(x, w, None, idx.t().contiguous().t())
        raw = torch.empty(x.numel() + 16, dtype=torch.uint8)  # a contiguous view 1 byte past a 16-byte boundary
        shifted = raw[(16 - raw.data_ptr() % 16) % 16 + 1:][:x.numel()].view(FP8).view(x.shape)
        with pytest.raises(ValueError, match=r"input: data at 0x[0-9a-f]+ is not 16-byte aligned"):
            op.dispatch(shifted, w, None, idx)
        out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
        y_raw = torch.empty(m * hidden + 8, dtype=torch.bfloat16)  # combine: the same rule for out=
        y_mis = y_raw[(8 - y_raw.data_ptr() // 2 % 8) % 8 + 1:][:m * hidden].view(m, hidden)
        with pytest.raises(ValueError, match=r"out: data at 0x[0-9a-f]+ is not 16-byte aligned"):
            op.combine(out.to(torch.bfloat16), weights=out_w, routing=routing, out=y_mis)
        # the op still works after rejected calls
        out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        golden_check(op.group, rank, ws, m, 4, x, w, idx, out, out_w, out_idx, total, routing.recv_src, None, None)


@pytest.mark.parametrize("ws", [2, 4])
def test_torch_backend_golden(ws):
    run_distributed(_op_job, ws, timeout=240)


def _gate_job(rank, ws):
    cfg = EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=256, max_num_inp_token_per_rank=8,
                                  num_experts_per_rank=4, num_experts_per_token=2, combine_mode="scatter",
                                  dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8,
                                  combine_data_type=torch.bfloat16, scale_dim=2, scale_type_size=4,
                                  index_dtype=torch.int64, expert_counts=True, expert_capacity=16,
                                  routing_replay=True, kernel_backend="hip")
    with pytest.raises(EpUnsupportedError) as e:
        EpDispatchCombineOp(cfg)
    msg = str(e.value)
    # every MoE option has passed the GPU suite on the hip kernels: none of them is missing
    assert "combine_mode='scatter'" in msg and "MoE-layer" not in msg, msg
    if not torch.cuda.is_available():  # a newcomer without a GPU is pointed at the backend that runs
        assert "kernel_backend='torch'" in msg, msg
    for option in ("quant_type", "index_dtype", "expert_counts", "expert_capacity", "routing_replay", "scale_dim"):
        assert option not in msg, msg
    # the torch backend serves every MoE feature of that config: only the scatter combine is missing
    with pytest.raises(EpUnsupportedError) as e:
        EpDispatchCombineOp(dataclasses.replace(cfg, kernel_backend="torch"))
    assert str(e.value) == "backend EpDispatchCombineOpTorch does not support: combine_mode='scatter' (only 'gather')"
    with pytest.raises(EpUnsupportedError, match="combine_mode"):
        EpDispatchCombineOp(EpDispatchCombineConfig(
            rank=0, world_size=1, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=4,
            num_experts_per_token=2, combine_mode="scatter", kernel_backend="torch"))
    with pytest.raises(ValueError, match="rank 3 of 4"):
        EpDispatchCombineOp(EpDispatchCombineConfig(
            rank=3, world_size=4, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=4,
            num_experts_per_token=2, kernel_backend="torch"))


def test_capability_gate_lists_everything_before_allocating():
    run_distributed(_gate_job, 1, timeout=60)


@pytest.mark.parametrize("field,value,match", [
    ("world_size", 0, "world_size=0"),
    ("hidden_dim", -1, "hidden_dim=-1"),
    ("combine_mode", "sum", "combine_mode='sum'"),
    ("kernel_backend", "flydsl", "kernel_backend='flydsl'"),
    ("max_total_recv_tokens", 5, "max_total_recv_tokens=5"),
    ("data_type", torch.float16, "allowed"),
    ("dispatch_data_type", FP8, "set together"),
    ("dispatch_block_num", 0, "dispatch_block_num=0"),
    ("schedule", [(None, 1, 2)], "schedule bucket"),
    ("combine_low_latency", "yes", "combine_low_latency='yes': expected None"),
    ("combine_low_latency", 1, "combine_low_latency=1: expected None"),
])
def test_config_errors_name_the_field(field, value, match):
    base = dict(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=4,
                num_experts_per_token=2)
    with pytest.raises(ValueError, match=match):
        EpDispatchCombineConfig(**{**base, field: value})


def test_combine_refuses_byte_dtypes():
    with pytest.raises(ValueError, match="combine sums"):
        EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=8,
                                num_experts_per_rank=4, num_experts_per_token=2, data_type=FP8)
    with pytest.raises(ConfigError, match="cannot be summed"):
        make_ep_cfg(COMBINE, "sm_90a", {"worldSize": 2, "dtype": "fp8"})


@pytest.mark.parametrize("request_,rule", [
    ({"hiddenDim": 7}, "multiple of 16"),
    ({"worldSize": 9}, "worldSize must be <= 8"),
    ({"numExpertPerToken": 33}, "topk"),
    ({"maxRecv": 3, "worldSize": 2}, "worst case"),
    ({"warpPerBlock": 40}, "<= 1024"),
    ({"blockNum": 1 << 20}, "done counter's unit"),
])
def test_ep_cfg_validity_is_a_construction_error(request_, rule):
    with pytest.raises(ConfigError, match=rule):
        make_ep_cfg(DISPATCH, "sm_90a", request_)


def test_make_ep_cfg_env_overrides(monkeypatch):
    monkeypatch.setenv("MORI_V2_EP_BLOCK_NUM", "24")
    monkeypatch.setenv("MORI_V2_EP_COMBINE_WARP_PER_BLOCK", "4")
    d = make_ep_cfg(DISPATCH, "gfx942", {"worldSize": 8, "blockNum": 80})
    c = make_ep_cfg(COMBINE, "gfx942", {"worldSize": 8})
    assert (d.blockNum, d.warpPerBlock, d.waveSize) == (24, 16, 64)
    assert (c.blockNum, c.warpPerBlock) == (24, 4)
    assert make_ep_cfg(DISPATCH, "sm_90a", {"worldSize": 2}).waveSize == 32
    monkeypatch.setenv("MORI_EP_CFG_BLOKNUM", "3")
    with pytest.raises(ConfigError, match="MORI_EP_CFG_BLOKNUM"):
        make_ep_cfg(DISPATCH, "sm_90a", {})


def test_tuning_lookup_merges_misaligned_edges_and_clamps(monkeypatch):
    key = (2, 7168, 8, None)
    monkeypatch.setitem(tuning.DISPATCH_TABLE, "bf16", {key: [(128, 32, 8), (1024, 64, 16), (None, 132, 16)]})
    monkeypatch.setattr(tuning, "COMBINE_TABLE", {key: [(256, 16, 8), (None, 200, 4)]})
    s = tuning.lookup("bf16", 2, 7168, 8, 128, num_cus=132)
    assert s.edges == (128, 256, 1024, None)
    assert s.dispatch == ((32, 8), (64, 16), (64, 16), (132, 16))
    assert s.combine == ((16, 8), (16, 8), (132, 4), (132, 4))  # 200 clamped to 132 SMs
    assert [s.index(n) for n in (0, 128, 129, 256, 257, 1024, 1025, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # a dtype whose dispatch is unswept: default dispatch, but combine is dtype-free
    monkeypatch.setitem(tuning.DISPATCH_TABLE, "fp8", {})
    d = tuning.lookup("fp8", 2, 7168, 8, 128, num_cus=132)
    assert d.edges == (256, None) and d.dispatch == (tuning.DEFAULT_DISPATCH,) * 2
    assert d.combine == ((16, 8), (132, 4))
    # an unswept shape: the single default
    u = tuning.lookup("bf16", 4, 4096, 8, 128, num_cus=132)
    assert u.edges == (None,) and u.dispatch == (tuning.DEFAULT_DISPATCH,)
    assert u.combine == (tuning.DEFAULT_COMBINE,)
    # experts_per_rank is a wildcard in this entry but an exact key wins
    monkeypatch.setitem(tuning.DISPATCH_TABLE, "bf16", {key: [(None, 8, 8)], (2, 7168, 8, 64): [(None, 4, 4)]})
    assert set(tuning.lookup("bf16", 2, 7168, 8, 64, 132).dispatch) == {(4, 4)}
    assert set(tuning.lookup("bf16", 2, 7168, 8, 128, 132).dispatch) == {(8, 8)}
    # warps are counted on the swept arch: a 64-wide wave caps them at 1024 threads per block
    monkeypatch.setitem(tuning.DISPATCH_TABLE, "bf16", {key: [(None, 132, 32)]})
    assert set(tuning.lookup("bf16", 2, 7168, 8, 128, 304, max_warps=16).dispatch) == {(132, 16)}
    assert set(tuning.lookup("bf16", 2, 7168, 8, 128, 132).dispatch) == {(132, 32)}


def test_variants_follow_schedule_and_pins():
    cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=4096,
                                  num_experts_per_rank=128, num_experts_per_token=8, data_type=torch.bfloat16,
                                  schedule=[(128, 16, 8, 8, 8), (None, 132, 16, 120, 8)])
    v = ep_variants(cfg, "sm_90a", 132)
    assert [(c.blockNum, c.warpPerBlock) for c in v.dispatch] == [(16, 8), (132, 16)]
    assert [(c.blockNum, c.warpPerBlock) for c in v.combine] == [(8, 8), (120, 8)]
    assert all(c.dtype == EpDType.Bf16 and c.waveSize == 32 and c.maxTokPerRank == 4096 for c in v.dispatch)
    pinned = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=64,
                                     num_experts_per_rank=8, num_experts_per_token=8, dispatch_block_num=300,
                                     warp_num_per_block=4)
    v = ep_variants(pinned, "gfx942", 304)
    assert [(c.blockNum, c.warpPerBlock, c.waveSize) for c in v.dispatch] == [(300, 4, 64)]
    assert len(v.all_cfgs()) == 2


@pytest.mark.parametrize("field,pins", [
    ("dispatch_block_num", {"dispatch_block_num": 133}),
    ("combine_block_num", {"combine_block_num": 200}),
    ("schedule bucket (None, 16, 8, 140, 8) combine blocks", {"schedule": [(None, 16, 8, 140, 8)]}),
])
def test_a_pin_beyond_the_device_is_refused_naming_it(field, pins):
    cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=64,
                                  num_experts_per_rank=8, num_experts_per_token=8, **pins)
    with pytest.raises(ConfigError, match=re.escape(field) + r"=\d+ exceeds 132, the 132 CUs/SMs of the device"):
        ep_variants(cfg, "sm_90a", 132)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_ranks_on_one_device_share_its_sms(ranks):
    """Every rank sizes its grids to its share of the SMs, so all grids are resident together."""
    share = 132 // ranks
    for m in (32, 128, 4096):  # low latency one-token ranges (every SM of the share), tuned buckets
        cfg = EpDispatchCombineConfig(rank=0, world_size=8, hidden_dim=7168, max_num_inp_token_per_rank=m,
                                      num_experts_per_rank=32, num_experts_per_token=8)
        v = ep_variants(cfg, "sm_90a", 132, ranks)
        blocks = [c.blockNum for c in v.dispatch + v.combine]
        assert max(blocks) <= share and ranks * max(blocks) <= 132, (m, blocks)
        if ranks == 1:
            assert max(blocks) > 132 // 2, (m, blocks)  # a lone rank still takes most of the device
    # a pin that fits one rank alone but not its share of a shared device is refused, naming why
    pinned = EpDispatchCombineConfig(rank=0, world_size=8, hidden_dim=7168, max_num_inp_token_per_rank=64,
                                     num_experts_per_rank=32, num_experts_per_token=8, combine_block_num=share + 1)
    if ranks > 1:
        with pytest.raises(ConfigError, match=rf"combine_block_num={share + 1} exceeds {share}, this rank's share "
                                              rf"of the 132 CUs/SMs of a device that {ranks} ranks share"):
            ep_variants(pinned, "sm_90a", 132, ranks)
    assert {c.blockNum for c in ep_variants(dataclasses.replace(pinned, combine_block_num=share), "sm_90a", 132,
                                            ranks).combine} == {share}


def test_low_latency_is_the_ops_choice_and_reaches_the_combine_leg_only():
    from mori_jit.ops.ep.backends.hip.intranode.specs import EP_COMBINE as COMBINE_SPEC

    base = dict(rank=0, world_size=2, hidden_dim=7168, num_experts_per_rank=128, num_experts_per_token=8)
    cut = tuning.LOW_LATENCY_MAX_TOKENS

    def legs(m, **kw):
        v = ep_variants(EpDispatchCombineConfig(**base, max_num_inp_token_per_rank=m, **kw), "sm_90a", 132)
        return {c.lowLatency for c in v.dispatch}, {c.lowLatency for c in v.combine}, v

    assert legs(cut)[:2] == ({False}, {True})  # by the op's size: up to the cut, every combine
    amd = ep_variants(EpDispatchCombineConfig(**base, max_num_inp_token_per_rank=128), "gfx942", 304)
    assert {c.lowLatency for c in amd.combine} == {False}  # by default only where it was measured
    amd = ep_variants(EpDispatchCombineConfig(**base, max_num_inp_token_per_rank=128, combine_low_latency=True),
                      "gfx942", 304)
    assert {c.lowLatency for c in amd.combine} == {True}
    assert legs(cut + 1)[:2] == ({False}, {False})
    assert legs(4096, combine_low_latency=True)[:2] == ({False}, {True})
    assert legs(128, combine_low_latency=False)[:2] == ({False}, {False})
    _, _, on = legs(128)
    _, _, off = legs(128, combine_low_latency=False)
    assert set(on.dispatch) == set(off.dispatch) and not set(on.combine) & set(off.combine)  # other keys
    assert all(COMBINE_SPEC.entry_name(c).endswith("_ll") for c in on.combine)
    one = ep_variants(EpDispatchCombineConfig(**{**base, "world_size": 1, "num_experts_per_rank": 256},
                                              max_num_inp_token_per_rank=128), "sm_90a", 132)
    assert {c.lowLatency for c in one.combine} == {False}  # one rank: no peer rows to signal


def test_low_latency_ops_whose_tasks_fit_the_grid_take_every_sm_and_one_token_ranges():
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EpRangeTok

    base = dict(rank=0, world_size=2, hidden_dim=7168, num_experts_per_rank=128, num_experts_per_token=8)

    def combine(m, num_cus=132, **kw):
        v = ep_variants(EpDispatchCombineConfig(**{**base, **kw}, max_num_inp_token_per_rank=m), "sm_90a", num_cus)
        return [(c.blockNum, EpRangeTok(c)) for c in v.combine]

    table = {(b, 2) for _, b, _ in tuning.COMBINE_TABLE[(2, 7168, 8, 128)]}  # (64, 2), (132, 2)
    small = min(table)  # the table's geometry for up to 128 tokens
    assert set(combine(128)) == {(132, 1)}  # 128 peer-token tasks fit 132 blocks: every SM, one token each
    assert set(combine(132)) == {(132, 1)} and combine(133)[0] == small  # the edge is the grid
    assert set(combine(256)) == table  # more tasks than SMs: the table, two-token ranges
    assert set(combine(128, combine_low_latency=False)) == table  # range flags: always two
    assert set(combine(128, combine_block_num=64)) == {(64, 2)}  # a pinned grid is kept; its tasks do not fit
    assert combine(128, num_cus=100)[0] == small
    ep8 = dict(world_size=8, num_experts_per_rank=32)
    assert {g for g in combine(16, **ep8)} == {(132, 1)} and {r for _, r in combine(32, **ep8)} == {2}


def test_one_token_ranges_take_their_tuning_and_an_override_still_wins(monkeypatch):
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EpRangeTok

    def unrolls(m, **kw):
        cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, num_experts_per_rank=128,
                                      num_experts_per_token=8, max_num_inp_token_per_rank=m, **kw)
        return {(EpRangeTok(c), c.vecUnroll) for c in ep_variants(cfg, "sm_90a", 132).combine}

    one = tuning.ONE_TOKEN_COMBINE["vecUnroll"]
    default = EpCfg().vecUnroll
    assert one != default  # (else this test proves nothing)
    assert unrolls(128) == {(1, one)}
    assert unrolls(256) == {(2, default)} and unrolls(128, combine_low_latency=False) == {(2, default)}
    monkeypatch.setenv("MORI_EP_CFG_COMBINE_VEC_UNROLL", str(default))
    assert unrolls(128) == {(1, default)}
    monkeypatch.setenv("MORI_EP_CFG_COMBINE_BLOCK_NUM", "64")  # the override's grid: two-token ranges, untuned
    monkeypatch.delenv("MORI_EP_CFG_COMBINE_VEC_UNROLL")
    assert unrolls(128) == {(2, default)}


def test_dispatch_buckets_whose_blocks_own_many_tokens_take_the_bulk_copy_path(monkeypatch):
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EpBulkSmemBytes, EpBulkStages, EpTokenBytes
    from mori_jit.ops.ep.backends.hip.intranode.specs import EP_DISPATCH

    least = tuning.BULK_DISPATCH_MIN_TOKENS

    def dispatch(m, arch="sm_90a", **kw):
        cfg = EpDispatchCombineConfig(**{**dict(rank=0, world_size=2, hidden_dim=7168, num_experts_per_rank=128,
                                                num_experts_per_token=8, max_num_inp_token_per_rank=m), **kw})
        v = ep_variants(cfg, arch, 132)
        return [(edge, c.blockNum, c.bulkMinTokens) for edge, c in zip(v.schedule.edges, v.dispatch)]

    # 132 blocks own up to 31 tokens at 4096: the open bucket asks; the 64-block buckets (<= 512) cannot reach it
    assert dispatch(4096) == [(128, 64, 0), (512, 64, 0), (None, 132, least)]
    assert dispatch(132 * least)[-1] == (None, 132, least)
    assert dispatch(132 * least - 132)[-1] == (None, 132, 0)  # at most least - 1 per block
    assert {b for _, _, b in dispatch(128)} == {0}
    assert dispatch(4096, dispatch_block_num=16) == [(128, 16, 0), (512, 16, least), (None, 16, least)]
    assert {b for _, _, b in dispatch(4096, world_size=1, num_experts_per_rank=256)} == {0}  # no peers, no link
    assert {b for _, _, b in dispatch(4096, arch="sm_80")} == {0}  # no bulk-copy unit there
    assert {b for _, _, b in dispatch(4096, arch="gfx942")} == {0}
    assert {b for _, _, b in dispatch(4096, hidden_dim=65536)} == {0}  # 4 stages of 128 KB rows do not fit
    c = ep_variants(EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, num_experts_per_rank=128,
                                            num_experts_per_token=8, max_num_inp_token_per_rank=4096), "sm_90a", 132)
    bulk, plain = c.dispatch[-1], c.dispatch[0]
    assert EpBulkStages(bulk) == 4 and EP_DISPATCH.geometry(bulk).shared_bytes == 4 * EpTokenBytes(bulk)
    assert EP_DISPATCH.geometry(plain).shared_bytes == 0 == EpBulkSmemBytes(plain)
    assert EP_DISPATCH.entry_name(bulk).endswith("_132x8_bulk") and not EP_DISPATCH.entry_name(plain).endswith("_bulk")
    assert {x.bulkMinTokens for x in c.combine} == {0}
    # a request: an override wins either way; it is refused where no unit exists, and on the combine leg
    monkeypatch.setenv("MORI_EP_CFG_DISPATCH_BULK_MIN_TOKENS", "0")
    assert {b for _, _, b in dispatch(4096)} == {0}
    monkeypatch.setenv("MORI_EP_CFG_DISPATCH_BULK_MIN_TOKENS", "1")
    assert {b for _, _, b in dispatch(128)} == {1}
    with pytest.raises(ConfigError, match="bulkMinTokens=1 on gfx942: no bulk-copy unit"):
        dispatch(128, arch="gfx942")
    monkeypatch.delenv("MORI_EP_CFG_DISPATCH_BULK_MIN_TOKENS")
    monkeypatch.setenv("MORI_EP_CFG_BULK_MIN_TOKENS", "8")
    with pytest.raises(ConfigError, match="bulkMinTokens=8 on the combine leg.*MORI_EP_CFG_DISPATCH_BULKMINTOKENS"):
        dispatch(128)
    monkeypatch.delenv("MORI_EP_CFG_BULK_MIN_TOKENS")
    with pytest.raises(ConfigError, match="bulk-copy stages"):
        make_ep_cfg(DISPATCH, "sm_90a", {"hiddenDim": 65536, "bulkMinTokens": 1})
    with pytest.raises(ConfigError, match="bulkMinTokens must be >= 0"):
        make_ep_cfg(DISPATCH, "sm_90a", {"bulkMinTokens": -1})


def test_combine_blocks_above_the_sm_count_are_refused(monkeypatch):
    cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=64,
                                  num_experts_per_rank=8, num_experts_per_token=8)
    assert max(c.blockNum for c in ep_variants(cfg, "sm_90a", 132).combine) <= 132
    monkeypatch.setenv("MORI_EP_CFG_COMBINE_BLOCK_NUM", "200")
    with pytest.raises(ConfigError, match="combine blockNum=200 exceeds 132, the 132 CUs/SMs"):
        ep_variants(cfg, "sm_90a", 132)
    monkeypatch.delenv("MORI_EP_CFG_COMBINE_BLOCK_NUM")
    monkeypatch.setenv("MORI_EP_CFG_COMBINE_LOW_LATENCY", "0")  # it sizes regions: the config says it
    with pytest.raises(ConfigError, match="lowLatency=False from MORI_EP_CFG_.*combine_low_latency instead"):
        ep_variants(cfg, "sm_90a", 132)


def _shipped_entries():
    for dtype, table in tuning.DISPATCH_TABLE.items():
        for key, buckets in table.items():
            yield DISPATCH, dtype, key, buckets
    for key, buckets in tuning.COMBINE_TABLE.items():
        yield COMBINE, "bf16", key, buckets


@pytest.mark.parametrize("arch", ["sm_90a", "gfx942"])
def test_shipped_tuning_tables_are_well_formed(arch):
    entries = list(_shipped_entries())
    assert entries, "the shipped tables are empty"
    for kind, dtype, (ws, hidden, k, epr), buckets in entries:
        edges = [b[0] for b in buckets]
        assert edges[-1] is None and None not in edges[:-1], f"{kind} {ws, hidden, k, epr}: last bucket must be open"
        assert edges[:-1] == sorted(set(edges[:-1])), f"{kind} {ws, hidden, k, epr}: edges must increase"
        # the op's own path (lookup, clamps, EpCfg validation) builds every variant on this arch,
        # and on the arch the tables were swept on it launches exactly the table's geometries
        torch_dtype = FP8 if dtype == "fp8" else torch.bfloat16
        cfg = EpDispatchCombineConfig(rank=0, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=4096,
                                      num_experts_per_rank=epr or 8, num_experts_per_token=k,
                                      data_type=torch.bfloat16, dispatch_data_type=torch_dtype,
                                      combine_data_type=torch.bfloat16)
        v = ep_variants(cfg, arch, DEFAULT_NUM_CUS[arch])
        launched = {(c.blockNum, c.warpPerBlock) for c in (v.dispatch if kind == DISPATCH else v.combine)}
        if arch == "sm_90a":
            assert launched == {(b, w) for _, b, w in buckets}, f"{kind} {dtype} {ws, hidden, k, epr}"


def test_overlapping_outputs_are_refused_by_name():
    """The one overlap rule behind combine's out= refusal: byte ranges, empty ones overlap nothing."""
    from mori_jit.ops.ep.core.arguments import byte_span as _span, refuse_overlaps as _refuse_overlaps

    base = torch.empty(64, dtype=torch.uint8)
    region = ("the arena", _span(base[48:64]))

    def refused(out, inp=None, weights=None, out_w=None):
        try:
            _refuse_overlaps((("out", out), ("out_weights", out_w)), (("input", inp), ("weights", weights)), region)
        except ValueError as e:
            return str(e)
        return None

    assert refused(base[8:16], inp=base[15:20]) == "out: overlaps input; pass a separate tensor"
    assert refused(base[8:16], inp=base[16:20]) is None  # adjacent
    assert refused(base[0:40], weights=base[10:12]) == "out: overlaps weights; pass a separate tensor"  # containment
    assert refused(base[10:12], weights=base[0:40]) is not None
    assert refused(base[40:50]) == "out: overlaps the arena; pass a separate tensor"
    assert refused(base[40:48]) is None
    assert refused(base[20:20], inp=base[0:40]) is None  # an empty output
    assert refused(base[0:8], inp=base[4:4]) is None  # an empty input
    assert refused(base[0:8], out_w=base[50:52]) == "out_weights: overlaps the arena; pass a separate tensor"
    assert refused(None, inp=base, out_w=base[60:61]) is not None
    assert _span(None) == (0, 0) and _span(base[8:16]) == (base.data_ptr() + 8, base.data_ptr() + 16)


def test_combine_outputs_are_fresh_contiguous_and_shaped():
    """combine()'s allocating path: empty_like of zero-stride templates must give new, contiguous
    [n, hidden] / [n, k] tensors (never a view of a template, never one shared between calls)."""
    from mori_jit.ops.ep.backends.hip.backend import CombineOutputs

    fresh = CombineOutputs(torch.bfloat16, 7168, 8, torch.device("cpu"))
    seen, held = set(), []  # held: live outputs, so no later call may reuse their memory
    for n in (5, 5, 0, 1, 300, 5):
        y, w = fresh.y(n), fresh.w(n)
        assert (y.shape, y.dtype, w.shape, w.dtype) == ((n, 7168), torch.bfloat16, (n, 8), torch.float32)
        assert y.is_contiguous() and w.is_contiguous()
        # every output takes a dtype view (an empty one too: an engine views outputs as bytes)
        assert y.view(torch.uint8).shape == (n, 7168 * 2) and w.view(torch.int32).shape == (n, 8)
        if n:
            assert y.stride() == (7168, 1) and w.stride() == (8, 1)
            y.fill_(1), w.fill_(2)  # every element is its own (a zero-stride view would not hold these)
            assert y.sum(dtype=torch.float32).item() == n * 7168 and w.sum().item() == 2 * n * 8
            assert y.data_ptr() not in seen
            seen.add(y.data_ptr())
            held.append((y, w))
    for n in range(CombineOutputs._MAX_CACHED + 10):  # the template cache stays bounded
        fresh.y(n)
    assert len(fresh._like) <= CombineOutputs._MAX_CACHED


def test_the_op_imports_no_backend_module():
    """The backend-neutral op (and the package) import neither a backend nor its tuning tables."""
    code = ("import sys, mori_jit.ops.ep, mori_jit.ops.ep.core.op; "
            "print(sorted(m for m in sys.modules if m.startswith('mori_jit.ops.ep.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    loaded = set(eval(out))
    assert "mori_jit.ops.ep.core.schedule" in loaded
    assert not loaded & {"mori_jit.ops.ep.backends.hip.intranode.tuning", "mori_jit.ops.ep.backends.hip.backend", "mori_jit.ops.ep.backends.torch.backend",
                         "mori_jit.ops.ep.backends.hip.intranode.cfg"}, loaded
