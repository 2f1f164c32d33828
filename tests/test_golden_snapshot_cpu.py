"""The golden check reads a dispatch's outputs as they were when it was called: they are views of
the op's receive buffers, valid until any rank's next dispatch, and a peer that finishes its check
first may dispatch again while this rank's check still runs (mori_jit/testing/golden.py)."""
from __future__ import annotations

import torch

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
from mori_jit.testing.distributed import run_distributed

M, H, K, EPR = 16, 64, 4, 4


def _overwritten_during_the_check_job(rank, ws):
    import mori_jit.testing.golden as golden

    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=EPR, num_experts_per_token=K, kernel_backend="torch")
    gen = torch.Generator().manual_seed(31 + rank)
    with EpDispatchCombineOp(cfg) as op:
        x, w, idx = golden.make_inputs(rank, M, H, K, cfg.num_experts, torch.bfloat16, torch.device("cpu"), gen,
                                       world_size=ws)
        out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        y, y_w = op.combine(out, weights=out_w, routing=routing)
        gather = golden._all_gather

        def a_peers_next_dispatch_lands(*args, **kwargs):  # (into this rank's buffers, mid-check)
            parts = gather(*args, **kwargs)
            for t, v in ((out, 7), (out_w, 0), (out_idx, -1), (routing.recv_src, 0), (total, 0)):
                t.fill_(v)
            return parts

        golden._all_gather = a_peers_next_dispatch_lands
        try:
            golden.golden_check(op.group, rank, ws, M, EPR, x, w, idx, out, out_w, out_idx, total,
                                routing.recv_src, y, y_w)
        finally:
            golden._all_gather = gather
        assert int(total.item()) == 0 and bool((out == 7).all())  # (the buffers were overwritten)


def test_the_golden_check_reads_the_outputs_it_was_given():
    run_distributed(_overwritten_during_the_check_job, 2, timeout=120)
