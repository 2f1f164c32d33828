"""``mori-jit precompile --ep ...`` builds exactly the binaries a live hip op asks for (fake toolchain),
and the real compilers build every EP kernel for every dtype pair at the default geometries, and the
combine at the edge geometries its sender's pass split was written for; nvcc's PTX of the combine
has its phase stamps as fire-and-forget reductions and its own-row L2 hints before the flag wait."""
from __future__ import annotations

import pytest
import torch

from jit_helpers import toolchain_or_skip
from mori_jit.cli import main
from mori_jit.jit import cache
from mori_jit.jit.compile import build, resolve
from mori_jit.jit.fields import ConfigError
from mori_jit.jit.toolchain import make_toolchain
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.variants import config_from_strings, plan_requests

FP8 = torch.float8_e4m3fn
FP4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)


def _live_op_keys(cfg, arch, num_cus):
    """The cache directories the hip op's _build_kernels would prepare (same function the op calls)."""
    tc = make_toolchain(arch)
    return {resolve(spec, c, tc).path for spec, c in plan_requests(cfg, arch, num_cus)}


@pytest.mark.parametrize("arch,num_cus", [("sm_90a", 132), ("gfx942", 304)])
def test_precompile_key_set_equals_live_op(fake_cc, arch, num_cus, capsys):
    cfg = EpDispatchCombineConfig(rank=1, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=4096,
                                  num_experts_per_rank=128, num_experts_per_token=8,
                                  dispatch_data_type=FP8, combine_data_type=torch.bfloat16,
                                  schedule=[(128, 32, 16, 64, 8), (None, 132, 8, 100, 16)])
    # the CLI cannot pass a schedule: compare the table-driven op too
    table_cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=4096,
                                        num_experts_per_rank=128, num_experts_per_token=8,
                                        dispatch_data_type=FP8, combine_data_type=torch.bfloat16)
    want = _live_op_keys(table_cfg, arch, num_cus)
    rc = main(["precompile", "--arch", arch, "--ep", "world_size=2", "hidden_dim=7168",
               "max_num_inp_token_per_rank=4096", "num_experts_per_rank=128", "num_experts_per_token=8",
               "dispatch_data_type=fp8", "combine_data_type=bf16", f"num_cus={num_cus}"])
    assert rc == 0, capsys.readouterr().err
    got = set(cache.list_entries())
    assert got == want and len(got) >= 2
    assert all(p.name.startswith(("kernel.mori_ep_dispatch_fp8_ws2", "kernel.mori_ep_combine_bf16_ws2")) for p in got)
    # a scheduled op asks for more variants; they are all distinct and compile
    assert len(_live_op_keys(cfg, arch, num_cus)) == 4


def test_precompile_ep_bad_input(fake_cc, capsys):
    assert main(["precompile", "--arch", "sm_90a", "--ep", "world_size=2", "hidden_dim=7168"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_num_inp_token_per_rank" in err[0]
    with pytest.raises(ConfigError, match="unknown EP config field 'hiden_dim'"):
        config_from_strings({"hiden_dim": "7168"})
    with pytest.raises(ConfigError, match="combine sums"):
        config_from_strings({"world_size": "2", "hidden_dim": "64", "max_num_inp_token_per_rank": "8",
                             "num_experts_per_rank": "4", "num_experts_per_token": "2", "data_type": "fp8"})
    base = {"world_size": "2", "hidden_dim": "64", "max_num_inp_token_per_rank": "8", "num_experts_per_rank": "4",
            "num_experts_per_token": "2"}
    assert config_from_strings({**base, "combine_low_latency": "off"})[0].combine_low_latency is False
    assert config_from_strings({**base, "combine_low_latency": "ON"})[0].combine_low_latency is True
    with pytest.raises(ConfigError, match="combine_low_latency='maybe'.*expected one of true, on"):
        config_from_strings({**base, "combine_low_latency": "maybe"})


_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (FP8, torch.bfloat16),
          (FP4, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("arch,compiler", [("sm_90a", "nvcc"), ("gfx90a", "hipcc")])
def test_real_compilers_build_every_ep_kernel(arch, compiler):
    tc = toolchain_or_skip(arch)
    built = set()
    for disp, comb in _PAIRS:
        cfg = EpDispatchCombineConfig(rank=0, world_size=8, hidden_dim=7168, max_num_inp_token_per_rank=128,
                                      num_experts_per_rank=32, num_experts_per_token=8,
                                      dispatch_data_type=disp, combine_data_type=comb)
        for spec, c in plan_requests(cfg, arch, 104):
            e = build(spec, c, tc)
            data = e.binary.read_bytes()
            assert spec.entry_name(c).encode() in data, f"{spec.entry_name(c)} not in {e.binary}"
            built.add(spec.entry_name(c))
    # 4 dispatch dtypes + 2 combine dtypes at the default geometry
    assert len(built) == 6, sorted(built)


@pytest.mark.parametrize("arch,compiler", [("sm_90a", "nvcc"), ("gfx90a", "hipcc")])
def test_real_compilers_build_combine_at_edge_geometries(arch, compiler):
    """The combine's sender splits a task over a pass count and a weights-per-thread count derived
    from the block size: one wave (7 passes at hidden 7168), four waves (2 passes), and topk 32 on
    one wave (two weights per thread) are paths the default geometries never instantiate; each in
    both protocols (range flags, low latency), and low latency with one-token ranges."""
    import dataclasses

    from mori_jit.ops.ep.backends.hip.intranode.cfg import EpRangeTok

    tc = toolchain_or_skip(arch)
    built = set()
    for k, warps in ((8, 1), (8, 4), (32, 1)):
        cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=64,
                                      num_experts_per_rank=32, num_experts_per_token=k, data_type=torch.bfloat16)
        for spec, c in plan_requests(cfg, arch, 104):
            if "combine" not in spec.entry_name(c):
                continue
            # both protocols (the default differs by arch); low latency with two-token ranges (its
            # 64 tasks exceed 8 blocks) and with one-token ranges (they fit 64)
            for low, blocks, range_tok in ((False, 8, 2), (True, 8, 2), (True, 64, 1)):
                c = dataclasses.replace(c, blockNum=blocks, warpPerBlock=warps, lowLatency=low)
                assert EpRangeTok(c) == range_tok
                e = build(spec, c, tc)
                assert spec.entry_name(c).encode() in e.binary.read_bytes()
                built.add(spec.entry_name(c))
    assert len(built) == 9, sorted(built)


def _combine_ptx(tmp_path_factory, low_latency) -> str:
    """nvcc's PTX of the EP2 bf16 combine as the op renders it (sm_90a, the 128-token variant)."""
    from jit_helpers import nvcc_ptx
    from mori_jit.jit.paths import kernels_dir

    tc = toolchain_or_skip("sm_90a")
    cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=128,
                                  num_experts_per_rank=128, num_experts_per_token=8, data_type=torch.bfloat16,
                                  combine_low_latency=low_latency)
    spec, c = next((s, c) for s, c in plan_requests(cfg, "sm_90a", 132) if "combine" in s.entry_name(c))
    tmp = tmp_path_factory.mktemp("combine_ptx")
    src = tmp / "combine.cu"
    src.write_text(spec.render_source(c, tc))
    return nvcc_ptx(tc, src, tmp / "combine.ptx", [kernels_dir()])


@pytest.fixture(scope="module")
def combine_ptx(tmp_path_factory) -> str:
    """The range-flag combine (low latency off)."""
    return _combine_ptx(tmp_path_factory, False)


@pytest.fixture(scope="module")
def combine_ptx_low(tmp_path_factory) -> str:
    """The op's default combine at M = 128: low latency."""
    return _combine_ptx(tmp_path_factory, None)


def test_nvcc_low_latency_rows_are_word_atomic_and_absent_when_off(combine_ptx, combine_ptx_low):
    """Low-latency rows rely on every 32-bit word being single-copy atomic: pushed, polled and set
    back to empty as relaxed system-scope accesses (`.v4.b32`: PTX performs a vector access as its
    elements' accesses; every lane polls its own vectors). The range-flag binary carries none of that
    code, and the low-latency one no range flag (no acquire poll but the sender's combine-done wait,
    no release store)."""
    import re

    for op in ("st", "ld"):
        assert re.search(rf"{op}\.relaxed\.sys\.global\.v4\.b32", combine_ptx_low), op
        assert not re.search(rf"{op}\.relaxed\.sys\.global\.v4\.b32", combine_ptx), op
    # no one-word poll before the loads: every lane polls its own vectors (docs/performance.md)
    assert not re.search(r"ld\.relaxed\.sys\.global\.b32", combine_ptx_low)
    assert not re.search(r"st\.release\.sys", combine_ptx_low) and re.search(r"st\.release\.sys", combine_ptx)


def test_nvcc_combine_phase_stamps_are_fire_and_forget(combine_ptx):
    """The combine's phase stamps are `red` reductions (docs/performance.md): an `atomicMax` on a
    generic pointer compiled to an `atom` whose result the thread waited for, which held each
    summing block's first wave ~1.2 us before its last output stores."""
    import re

    assert len(re.findall(r"red\.relaxed\.gpu\.global\.max\.u64", combine_ptx)) == 5  # sent; flags seen, summed, end
    # (where a block ends after its sums), and end again (where it summed nothing)
    assert not re.search(r"atom(\.[a-z:]+)*\.max", combine_ptx), "a returning atomic max is back in the combine"


def test_nvcc_combine_hints_own_row_into_l2_before_the_flag_wait(combine_ptx):
    """A summing wave hints its lanes' vectors of the own row into L2 (one `prefetch.global.L2` per
    unroll slot, 4 at this Cfg) before it polls the range flags (docs/performance.md). The
    hints come before the last acquire poll in the text (the range-flag wait; the sender's
    combine-done wait comes earlier)."""
    import re

    hints = [m.start() for m in re.finditer(r"prefetch\.global\.L2 ", combine_ptx)]
    polls = [m.start() for m in re.finditer(r"ld\.acquire\.sys\.global\.u64", combine_ptx)]
    assert len(hints) == 4, len(hints)
    assert polls and max(hints) < max(polls), "the own-row L2 hints no longer precede the range-flag wait"


def test_nvcc_bulk_copy_dispatch_builds_for_every_dtype_and_moves_rows_through_the_unit(tmp_path):
    """A dispatch bucket whose blocks own many tokens (4096 tokens on 132 SMs) builds the bulk-copy
    path for every dispatch dtype (fp32 rows: four 28 KB stages); its PTX loads rows into shared
    memory on an mbarrier and stores them from there with `cp.async.bulk` (one bulk group per row),
    and waits for the stores and fences the async proxy before the block's done count. The 128-token
    op's dispatch has none of it."""
    import re

    from jit_helpers import nvcc_ptx
    from mori_jit.jit.paths import kernels_dir

    tc = toolchain_or_skip("sm_90a")

    def dispatch(m, disp, comb):
        cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=7168, max_num_inp_token_per_rank=m,
                                      num_experts_per_rank=128, num_experts_per_token=8,
                                      dispatch_data_type=disp, combine_data_type=comb)
        return [(s, c) for s, c in plan_requests(cfg, "sm_90a", 132) if "dispatch" in s.entry_name(c)]

    built = set()
    for disp, comb in _PAIRS:
        bulk = [(s, c) for s, c in dispatch(4096, disp, comb) if c.bulkMinTokens]
        assert len(bulk) == 1, [s.entry_name(c) for s, c in dispatch(4096, disp, comb)]
        spec, c = bulk[0]
        e = build(spec, c, tc)
        assert spec.entry_name(c).encode() in e.binary.read_bytes()
        built.add(spec.entry_name(c))
    assert len(built) == 4, sorted(built)  # four dispatch dtypes

    def ptx(spec, c, name):
        src = tmp_path / f"{name}.cu"
        src.write_text(spec.render_source(c, tc))
        return nvcc_ptx(tc, src, tmp_path / f"{name}.ptx", [kernels_dir()])

    spec, c = next((s, c) for s, c in dispatch(4096, torch.bfloat16, torch.bfloat16) if c.bulkMinTokens)
    text = ptx(spec, c, "bulk")
    assert re.search(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes", text)
    assert re.search(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group", text)
    wait = [m.start() for m in re.finditer(r"cp\.async\.bulk\.wait_group 0", text)]
    assert wait and re.search(r"fence\.proxy\.async\.global", text[wait[-1]:]), "no proxy fence after the last wait"
    assert re.search(r"red\.relaxed\.sys\.global\.add\.u64", text[wait[-1]:]), "the done count precedes the wait"
    plain = ptx(*dispatch(128, torch.bfloat16, torch.bfloat16)[0], "plain")
    assert "cp.async.bulk" not in plain and "mbarrier" not in plain
