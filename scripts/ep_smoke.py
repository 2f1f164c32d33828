"""Quick EP smoke test on all visible GPUs with step-by-step progress (debugging aid).

    PYTHONPATH=. python3 scripts/ep_smoke.py [--hidden 2048] [--k 8] [--m 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import faulthandler
import os

import torch

from ep_smoke_rounds import log, smoke_rounds
from mori_jit.testing.distributed import run_distributed


def _job(rank, ws, hidden, k, m, rounds):
    faulthandler.dump_traceback_later(60, exit=False)
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=m,
                                  num_experts_per_rank=max(1, 16 // ws), num_experts_per_token=k)
    log(rank, "constructing op")
    op = EpDispatchCombineOp(cfg)
    log(rank, f"op ready: peers {[hex(p) for p in op.arena.peer_bases]} size {op.arena.tensor.numel()}")
    smoke_rounds(op, rounds, torch.device("cuda", rank))
    op.close()
    faulthandler.cancel_dump_traceback_later()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("MORI_EP_TIMEOUT_S", "5")
    run_distributed(_job, torch.cuda.device_count(), a.hidden, a.k, a.m, a.rounds, timeout=150, backend="nccl")
    print("SMOKE OK")


if __name__ == "__main__":
    main()
