"""nvcc's PTX of the combine's summer (kernels/ep/ep_combine_summer.hpp): at one rank, with no peer
flags to wait for and ranges taken at the grid's stride (kSolo), it keeps no block barrier per range;
the receive half of a two-rank combine, which has no senders either, keeps the one after its poll."""
from __future__ import annotations

import re

from jit_helpers import nvcc_ptx, toolchain_or_skip
from mori_jit.jit.paths import kernels_dir
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, EpPhase
from mori_jit.ops.ep.backends.hip.intranode.specs import EP_COMBINE
from mori_jit.ops.ep.backends.hip.variants import ep_variants


def test_the_one_rank_summer_has_no_barrier_per_range(tmp_path):
    tc = toolchain_or_skip("sm_90a")

    def barriers(ws: int) -> int:
        cfg = EpDispatchCombineConfig(rank=0, world_size=ws, hidden_dim=7168, max_num_inp_token_per_rank=4096,
                                      num_experts_per_rank=8, num_experts_per_token=8, split_send_recv=True)
        c = ep_variants(cfg, "sm_90a", 132).half(COMBINE, EpPhase.Recv)[-1]
        assert c.worldSize == ws and c.phase == EpPhase.Recv and not c.lowLatency
        src = tmp_path / f"{EP_COMBINE.entry_name(c)}.cu"
        src.write_text(EP_COMBINE.render_source(c, tc))
        return len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", nvcc_ptx(tc, src, src.with_suffix(".ptx"),
                                                                         [kernels_dir()])))

    one, two = barriers(1), barriers(2)
    assert 0 < one < two, (one, two)
