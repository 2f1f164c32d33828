"""The hip backend's split legs on the CPU (docs/design.md §8, "Send and receive kernels"): the
EpCfg ``phase`` each half is built with (its own specialization, entry name and key; the whole
leg's default renders as before), the variant walk that the op and ``mori-jit precompile`` share,
the real compilers building every half (nvcc for ``sm_90a``, Debian's hipcc for ``gfx90a``), and
nvcc's PTX of each half: a send kernel raises its signals and waits for no peer's rows."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from jit_helpers import nvcc_ptx, toolchain_or_skip
from mori_jit.jit.compile import build, resolve
from mori_jit.jit.fields import ConfigError
from mori_jit.jit.paths import kernels_dir
from mori_jit.jit.toolchain import make_toolchain
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, DISPATCH, LAYOUT, EpCfg, EpPhase, make_ep_cfg
from mori_jit.ops.ep.backends.hip.intranode.specs import EP_COMBINE, EP_DISPATCH
from mori_jit.ops.ep.backends.hip.variants import ep_variants, hip_gaps, plan_requests

BASE = dict(rank=0, world_size=4, hidden_dim=7168, max_num_inp_token_per_rank=4096, num_experts_per_rank=8,
            num_experts_per_token=8)
MOE = dict(expert_counts=True, expert_capacity=64, routing_replay=True, index_dtype=torch.int64, scale_dim=56,
           scale_type_size=4)
HALVES = (EpPhase.Send, EpPhase.Recv)


def _cfg(**fields) -> EpDispatchCombineConfig:
    return EpDispatchCombineConfig(**{**BASE, **fields})


def test_an_op_without_the_split_builds_what_it_built_before():
    tc = make_toolchain("sm_90a")
    for fields in ({}, MOE, dict(max_num_inp_token_per_rank=128)):
        var = ep_variants(_cfg(**fields), "sm_90a", 132)
        assert not var.split and var.half(DISPATCH, EpPhase.Send) == ()
        for spec, c in var.requests():
            assert c.phase == EpPhase.Whole
            assert "phase" not in spec.render_source(c, tc)  # the default is never rendered: same text, same key
            assert not spec.entry_name(c).endswith(("_send", "_recv"))


@pytest.mark.parametrize("fields", [{}, MOE, dict(max_num_inp_token_per_rank=128)], ids=["plain", "moe", "ll"])
def test_the_split_adds_a_send_and_a_receive_kernel_per_leg_and_bucket(fields):
    tc = make_toolchain("sm_90a")
    whole, split = ep_variants(_cfg(**fields), "sm_90a", 132), ep_variants(_cfg(split_send_recv=True, **fields),
                                                                           "sm_90a", 132)
    assert (split.dispatch, split.combine, split.expert_combine) == (whole.dispatch, whole.combine,
                                                                     whole.expert_combine)
    assert split.region_bytes() == whole.region_bytes()  # the halves share the whole leg's arena
    added = [r for r in split.requests() if r not in whole.requests()]
    assert set(whole.requests()) <= set(split.requests())
    for kind, spec, legs in ((DISPATCH, EP_DISPATCH, whole.dispatch), (COMBINE, EP_COMBINE, whole.combine)):
        for phase, mark in zip(HALVES, ("_send", "_recv")):
            half = split.half(kind, phase)
            assert half == tuple(dataclasses.replace(c, phase=phase) for c in legs)  # one per bucket
            for c, w in zip(half, legs):
                assert (spec, c) in added
                assert spec.entry_name(c) == spec.entry_name(w) + mark
                assert f".phase=EpPhase::{phase.name}" in spec.render_source(c, tc)
                assert resolve(spec, c, tc).key != resolve(spec, w, tc).key
                geo, wgeo = spec.geometry(c), spec.geometry(w)
                if (kind, phase) == (DISPATCH, EpPhase.Recv):  # one block's waits and counts
                    assert geo.grid == (1, 1, 1) and geo.block == wgeo.block and geo.shared_bytes == 0
                else:
                    assert geo == wgeo
    assert len(added) == 2 * (len(set(whole.dispatch)) + len(set(whole.combine)))


def test_a_one_rank_combine_has_no_send_kernel():
    """At one rank the combine's send has no peer to push to: the variants (and so the op and
    precompile) have no combine send kernel there, and every other half as at several ranks."""
    one = ep_variants(_cfg(world_size=1, num_experts_per_rank=32, split_send_recv=True), "sm_90a", 132)
    two = ep_variants(_cfg(world_size=2, split_send_recv=True), "sm_90a", 132)
    assert one.half(COMBINE, EpPhase.Send) == () and len(two.half(COMBINE, EpPhase.Send)) == len(two.combine)
    assert len(one.half(COMBINE, EpPhase.Recv)) == len(one.combine)
    assert all(len(one.half(DISPATCH, p)) == len(one.dispatch) for p in HALVES)
    assert not [c for spec, c in one.requests() if spec is EP_COMBINE and c.phase == EpPhase.Send]


def test_the_phase_is_chosen_by_the_call_never_by_an_override(monkeypatch):
    assert make_ep_cfg(DISPATCH, "sm_90a", {"phase": "Send"}).phase == EpPhase.Send
    with pytest.raises(ConfigError, match="phase=Recv on the layout kernel: only dispatch and combine run in halves"):
        make_ep_cfg(LAYOUT, "sm_90a", {"phase": "Recv"})
    monkeypatch.setenv("MORI_EP_CFG_COMBINE_PHASE", "Send")
    with pytest.raises(ConfigError, match=r"MORI_EP_CFG_\*PHASE: the phase is chosen by the op's call"):
        ep_variants(_cfg(), "sm_90a", 132)
    with pytest.raises(ConfigError, match="not an EpPhase; allowed: Whole, Send, Recv"):
        make_ep_cfg(DISPATCH, "sm_90a", {"phase": "Both"})


def test_the_gate_takes_the_split():  # (internode: tests/test_ep_net_split_cpu.py)
    assert hip_gaps(_cfg(split_send_recv=True), "sm_90a") == []


def test_precompile_builds_every_half_a_live_op_asks_for(fake_cc, capsys):
    from mori_jit.cli import main
    from mori_jit.jit import cache

    tc = make_toolchain("sm_90a")
    cfg = _cfg(split_send_recv=True)
    want = {resolve(spec, c, tc).path for spec, c in plan_requests(cfg, "sm_90a", 132)}
    args = [f"{k}={v}" for k, v in BASE.items() if k != "rank"] + ["split_send_recv=on", "num_cus=132"]
    assert main(["precompile", "--arch", "sm_90a", "--ep", *args]) == 0, capsys.readouterr().err
    got = set(cache.list_entries())
    assert got == want
    names = {p.name.split(".")[1] for p in got}
    assert {n for n in names if n.endswith("_send")} and {n for n in names if n.endswith("_recv")}


#: op configs whose halves the real compilers build: both combine protocols, the bulk-copy dispatch
#: (4096 tokens on sm_90a), every MoE option, in-op fp8 cast, fp8 rows
REAL = {
    "low_latency": dict(max_num_inp_token_per_rank=128),
    "flags_bulk": dict(combine_low_latency=False),
    "moe": dict(MOE, max_num_inp_token_per_rank=128),
    "fp8_cast": dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=torch.float8_e4m3fn,
                     combine_data_type=torch.bfloat16, scale_dim=56, scale_type_size=1, expert_counts=True,
                     max_num_inp_token_per_rank=256),
    "fp8_rows": dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16,
                     max_num_inp_token_per_rank=512),
}


@pytest.mark.parametrize("name", list(REAL))
@pytest.mark.parametrize("arch", ["sm_90a", "gfx90a"])
def test_real_compilers_build_every_half(arch, name):
    tc = toolchain_or_skip(arch)
    var = ep_variants(_cfg(split_send_recv=True, **REAL[name]), arch, 132 if arch == "sm_90a" else 104)
    built = 0
    for spec, c in var.requests():
        if c.phase != EpPhase.Whole:
            e = build(spec, c, tc)
            assert spec.entry_name(c).encode() in e.binary.read_bytes()
            built += 1
    assert built == 2 * (len(set(var.dispatch)) + len(set(var.combine))) and built >= 4
    if name == "flags_bulk" and arch == "sm_90a":
        assert any(c.bulkMinTokens for c in var.half(DISPATCH, EpPhase.Send))


@pytest.mark.parametrize("low", [False, True], ids=["flags", "low_latency"])
def test_send_kernels_signal_and_wait_for_no_peer_rows(tmp_path, low):
    """nvcc's PTX of each half against the whole leg's: the spin-waits (acquire loads) and the done
    counts (system-scope reductions) of the whole leg are split between its halves, and the send
    kernels' only wait is the one for the peers' previous combine (before the first store)."""
    tc = toolchain_or_skip("sm_90a")
    cfg = _cfg(max_num_inp_token_per_rank=128, expert_counts=True, combine_low_latency=low, split_send_recv=True)
    var = ep_variants(cfg, "sm_90a", 132)

    def marks(spec, c):
        src = tmp_path / f"{spec.entry_name(c)}.cu"
        src.write_text(spec.render_source(c, tc))
        text = nvcc_ptx(tc, src, tmp_path / f"{spec.entry_name(c)}.ptx", [kernels_dir()])
        return {k: len(re.findall(p, text)) for k, p in (
            ("waits", r"ld\.acquire\.sys\.global\.u64"), ("done", r"red\.relaxed\.sys\.global\.add\.u64"),
            ("flags", r"st\.release\.sys\.global\.u64"), ("pushes", r"st\.relaxed\.sys"),
            ("outputs", r"st\.global\.v4"))}

    for kind, spec, legs in ((DISPATCH, EP_DISPATCH, var.dispatch), (COMBINE, EP_COMBINE, var.combine)):
        w = marks(spec, legs[0])
        s, r = (marks(spec, c[0]) for c in (var.half(kind, EpPhase.Send), var.half(kind, EpPhase.Recv)))
        assert s["waits"] + r["waits"] == w["waits"], (kind, w, s, r)
        assert s["waits"] == 2, (kind, s)  # the previous combine's wait: a first load, then its loop
        if kind == DISPATCH:  # the send counts its blocks done; the receive waits for every rank's
            assert s["done"] == w["done"] > 0 and r["done"] == 0, (w, s, r)
        else:  # the send pushes and flags; the receive sums, stores the outputs and counts done
            assert s["done"] == 0 and r["done"] == w["done"] > 0, (w, s, r)
            assert s["outputs"] == 0 and r["outputs"] == w["outputs"] > 0, (w, s, r)
            assert (s["pushes"] > 0) if low else (s["flags"] == w["flags"] > 0 and r["flags"] == 0), (w, s, r)


@pytest.mark.parametrize("m", [128, 4096])
def test_two_micro_batch_ops_cost_the_arena_of_one_op_of_the_whole_batch(m):
    """One op per micro-batch (docs/design.md §6, "Send and receive"): an arena's receive
    side grows with max_num_inp_token_per_rank, so two ops of half the batch each hold what one op
    of the whole batch holds, but for the fixed words (counters, flags, stamps) and alignment."""
    from mori_jit.ops.ep.memory.arena import layout

    def arena_bytes(tokens):
        cfg = _cfg(world_size=8, max_num_inp_token_per_rank=tokens, split_send_recv=True)
        return layout(ep_variants(cfg, "sm_90a", 132).region_bytes())[1]

    whole, half = arena_bytes(m), arena_bytes(m // 2)
    assert 0 <= 2 * half - whole < 64 * 1024, (whole, half)
    assert whole > 8 * m * 7168 * 2  # (the receive rows alone: world_size * M rows of 7168 bf16)
