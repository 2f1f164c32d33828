"""The rounds both EP smoke tools run (``ep_smoke.py``, ``ep_internode_smoke.py``): dispatch and
combine random tokens on a built op, check the device error words after each leg, compare with the
golden model, and log each step with the rank and the time."""
from __future__ import annotations

import time

import torch


def log(rank: int, msg: str) -> None:
    """Print ``msg`` prefixed by the rank and the wall-clock time (flushed: progress of a hang)."""
    print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def smoke_rounds(op, rounds: int, device: torch.device) -> None:
    """``rounds`` dispatch + combine rounds on ``op`` (bf16 tokens), each checked against the golden
    model; raises on a device error or a mismatch."""
    from mori_jit.testing.golden import golden_check, make_inputs

    cfg = op.cfg
    rank, ws, m, hidden, k = (cfg.rank, cfg.world_size, cfg.max_num_inp_token_per_rank, cfg.hidden_dim,
                              cfg.num_experts_per_token)
    gen = torch.Generator().manual_seed(rank)
    for r in range(rounds):
        x, w, idx = make_inputs(rank, m, hidden, k, cfg.num_experts, torch.bfloat16, device, gen)
        out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        torch.cuda.synchronize()
        op.check()
        log(rank, f"round {r}: dispatch done, total_recv={total.item()}")
        y, y_w = op.combine(out, weights=out_w, routing=routing)
        torch.cuda.synchronize()
        op.check()
        log(rank, f"round {r}: combine done")
        golden_check(op.group, rank, ws, m, cfg.num_experts_per_rank, x, w, idx, out, out_w, out_idx, total,
                     routing.recv_src, y, y_w)
        log(rank, f"round {r}: golden ok")
        torch.distributed.barrier()  # `out` is valid until any rank's next dispatch
