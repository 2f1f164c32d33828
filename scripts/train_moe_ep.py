"""Train a small MoE transformer with expert parallelism on the EP op and compare its loss curve with
the same model trained densely on one process (``mori_jit.examples.moe_transformer``).

    PYTHONPATH=. python3 scripts/train_moe_ep.py [--ws 2] [--steps 300] [--layout packed] [--tol 1e-4]

The EP run uses ``--ws`` CPU processes on gloo with the torch backend (``--backend hip`` on GPUs: one
rank per GPU on NCCL, or several per GPU under CUDA MPS on gloo, as the GPU tests place them).
Prints both curves every ``--every`` steps and the largest gap; exits 1 when the gap exceeds
``--tol`` (absolute, in nats; the two runs differ only in the order of float32 sums: 300 steps on 2
ranks, layout packed, stay within 5e-7 of each other, the loss falling from 4.19 to 1.75).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from mori_jit.examples.moe_transformer import TinyConfig, max_gap, train_dense, train_ep_job
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.gpu_world import GpuWorldUnavailable, run_gpu_job


def compare(ws: int, steps: int, cfg: TinyConfig, backend: str = "torch") -> tuple[list[float], list[float]]:
    """``(ep_losses, dense_losses)``: the two runs of ``steps`` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "losses.json")
        if backend == "hip":  # (ranks round-robin over the GPUs; several per GPU under MPS)
            run_gpu_job(train_ep_job, ws, cfg, steps, out, backend, timeout=60 + 2 * steps)
        else:
            run_distributed(train_ep_job, ws, cfg, steps, out, backend, timeout=60 + 2 * steps)
        with open(out) as f:
            ep = json.load(f)
    return ep, train_dense(cfg, steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ws", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layout", choices=("packed", "rows", "expert_major"), default="packed")
    ap.add_argument("--backend", choices=("torch", "hip"), default="torch")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = TinyConfig(layout=args.layout, seed=args.seed)
    start = time.monotonic()
    try:
        ep, dense = compare(args.ws, args.steps, cfg, args.backend)
    except GpuWorldUnavailable as e:
        print(f"train_moe_ep: --backend hip --ws {args.ws}: {e}", file=sys.stderr)
        return 2
    print(f"{'step':>6} {'EP loss':>10} {'dense loss':>10} {'gap':>9}")
    for s in range(0, args.steps, args.every):
        print(f"{s:>6} {ep[s]:>10.5f} {dense[s]:>10.5f} {abs(ep[s] - dense[s]):>9.2e}")
    gap = max_gap(ep, dense)
    print(f"{args.steps} steps, {args.ws} ranks, layout {args.layout}, {time.monotonic() - start:.0f} s: "
          f"loss {ep[0]:.4f} -> {ep[-1]:.4f}, largest gap {gap:.2e} (tolerance {args.tol:.0e})")
    return 0 if gap <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
