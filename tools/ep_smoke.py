"""Quick EP smoke test on all visible GPUs with step-by-step progress (debugging aid).

    PYTHONPATH=. python3 tools/ep_smoke.py [--hidden 2048] [--k 8] [--m 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import time

import torch

from mori_jit.testing.distributed import run_distributed


def _log(rank, msg):
    print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _job(rank, ws, hidden, k, m, rounds):
    faulthandler.dump_traceback_later(60, exit=False)
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
    from mori_jit.ops.ep.golden import golden_check, make_inputs

    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=m,
                                  num_experts_per_rank=max(1, 16 // ws), num_experts_per_token=k)
    _log(rank, "constructing op")
    op = EpDispatchCombineOp(cfg)
    _log(rank, f"op ready: peers {[hex(p) for p in op.arena.peer_bases]} size {op.arena.tensor.numel()}")
    gen = torch.Generator().manual_seed(rank)
    dev = torch.device("cuda", rank)
    for r in range(rounds):
        x, w, idx = make_inputs(rank, m, hidden, k, cfg.num_experts, torch.bfloat16, dev, gen)
        out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        torch.cuda.synchronize()
        _log(rank, f"round {r}: dispatch done total={total.item()}")
        op.check()
        y, y_w = op.combine(out, weights=out_w, routing=routing)
        torch.cuda.synchronize()
        op.check()
        _log(rank, f"round {r}: combine done")
        golden_check(op.group, rank, ws, m, cfg.num_experts_per_rank, x, w, idx, out, out_w, out_idx, total,
                     routing.recv_src, y, y_w)
        _log(rank, f"round {r}: golden ok")
        torch.distributed.barrier()  # `out` is valid until any rank's next dispatch
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
