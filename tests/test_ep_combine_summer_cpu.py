"""nvcc's PTX of the combine's summer (kernels/ep/ep_combine_summer.hpp): at one rank, with no peer
flags to wait for and ranges taken at the grid's stride (kSolo), it keeps no block barrier per range;
the receive half of a two-rank combine, which has no senders either, keeps the one after its poll.
And the one-rank combine's grid, which need not be resident at once: two blocks per SM, their
registers capped by the launch bound; every other combine keeps one block per SM of its share.
Its blocks end with no fence (nothing reads the rank's memory before the kernel's end); and every
summer writes bf16 through the packed hardware conversion, two values an instruction."""
from __future__ import annotations

import re

import pytest

from mori_jit.ops.ep.backends.hip.intranode.cfg import EpCfg
from mori_jit.ops.ep.errors import EpConfigError
from mori_jit.jit.fields import ConfigError

from jit_helpers import nvcc_ptx, toolchain_or_skip
from mori_jit.jit.paths import kernels_dir
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, EpPhase
from mori_jit.ops.ep.backends.hip.intranode.specs import EP_COMBINE
from mori_jit.ops.ep.backends.hip.variants import ep_variants

SHAPE = dict(rank=0, hidden_dim=7168, max_num_inp_token_per_rank=4096, num_experts_per_token=8)


def _combine(ws: int, **fields) -> EpCfg:
    cfg = EpDispatchCombineConfig(world_size=ws, num_experts_per_rank=256 // ws, **{**SHAPE, **fields})
    return ep_variants(cfg, "sm_90a", 132).combine[-1]


def _combine_ptx(tmp_path, c: EpCfg, tc) -> str:
    src = tmp_path / f"{EP_COMBINE.entry_name(c)}.cu"
    src.write_text(EP_COMBINE.render_source(c, tc))
    return nvcc_ptx(tc, src, src.with_suffix(".ptx"), [kernels_dir()])


def test_the_one_rank_summer_has_no_barrier_per_range(tmp_path):
    tc = toolchain_or_skip("sm_90a")

    def barriers(ws: int) -> int:
        cfg = EpDispatchCombineConfig(rank=0, world_size=ws, hidden_dim=7168, max_num_inp_token_per_rank=4096,
                                      num_experts_per_rank=8, num_experts_per_token=8, split_send_recv=True)
        c = ep_variants(cfg, "sm_90a", 132).half(COMBINE, EpPhase.Recv)[-1]
        assert c.worldSize == ws and c.phase == EpPhase.Recv and not c.lowLatency
        return len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", _combine_ptx(tmp_path, c, tc)))

    one, two = barriers(1), barriers(2)
    assert 0 < one < two, (one, two)


def test_a_one_rank_combine_holds_two_blocks_per_sm(tmp_path):
    tc = toolchain_or_skip("sm_90a")
    one, two = _combine(1), _combine(2)
    assert (one.blockNum, one.warpPerBlock, one.blocksPerSm) == (264, 14, 2)
    assert two.blockNum <= 132 and two.blocksPerSm == 1
    assert EP_COMBINE.entry_name(one).endswith("_264x14_m2") and "_m" not in EP_COMBINE.entry_name(two)[-4:]

    def bound(c: EpCfg) -> list[str]:
        return re.findall(r"\.minnctapersm\s+(\d+)", _combine_ptx(tmp_path, c, tc))

    assert bound(one) == ["2"] and bound(two) == []  # (a minimum of 1 is not rendered: the kernel as before)
    # hip's second argument is not blocks per CU: an AMD build gets the threads only
    amd = toolchain_or_skip("gfx90a")
    assert "__launch_bounds__(EpBlockThreads(kCfg))\n" in EP_COMBINE.render_source(one, amd)


def test_only_a_one_rank_combine_grid_may_exceed_the_sms():
    assert _combine(1, combine_block_num=264).blockNum == 264
    with pytest.raises(EpConfigError, match=r"combine_block_num=265 exceeds 264: a one-rank combine waits for no block"):
        _combine(1, combine_block_num=265)
    with pytest.raises(EpConfigError, match=r"combine_block_num=133 exceeds 132.*every block of every rank must be "
                                            r"resident"):
        _combine(2, combine_block_num=133)
    with pytest.raises(EpConfigError, match=r"dispatch_block_num=133 exceeds 132"):
        _combine(1, dispatch_block_num=133)
    with pytest.raises(ConfigError, match=r"blocksPerSm must be >= 1, and blocksPerSm\*warpPerBlock\*waveSize <= 2048"):
        EpCfg(worldSize=1, warpPerBlock=32, waveSize=32, blocksPerSm=3)


def test_a_one_rank_summer_ends_without_a_fence(tmp_path):
    tc = toolchain_or_skip("sm_90a")
    fences = {ws: len(re.findall(r"\bfence\.acq_rel\.gpu\b", _combine_ptx(tmp_path, _combine(ws), tc))) for ws in (1, 2)}
    assert fences[1] == 0 and fences[2] > 0, fences


@pytest.mark.parametrize("ws", [1, 2])
def test_the_summer_packs_bf16_in_hardware(tmp_path, ws):
    tc = toolchain_or_skip("sm_90a")
    c = _combine(ws)
    # one conversion per output word: four per 16-byte vector, vecUnroll vectors per lane
    assert len(re.findall(r"\bcvt\.rn\.bf16x2\.f32\b", _combine_ptx(tmp_path, c, tc))) >= 4 * c.vecUnroll
