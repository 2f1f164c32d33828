"""A training step's EP time (forward + backward of dispatch and combine) beside forward-only, on one
device (one rank: the legs' own work, no link).

    PYTHONPATH=. python3 scripts/bench_ep_train.py [--tokens 4096] [--hidden 7168] [--k 8] [--experts 32]
                                                    [--backend hip] [--iters 20] [--warmup 5]

The experts are a copy (expert output = received row), so the times are the EP legs' and the
training layer's own. Each row is the mean wall time per step (the device synchronized around the
timed loop), bf16 legs, routing replay on:

    inference      op.dispatch + op.combine, no grad
    forward        the differentiable dispatch + combine (fresh outputs, the token)
    train          forward + backward (combine's backward replays, dispatch's combines)
    train_packed   the same through the packed layout (pack, unpack), alignment 128

``--backend torch`` runs the reference backend on the CPU (gloo), as a smoke test of the script.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from mori_jit.testing.distributed import run_distributed


def _job(rank, ws, args):
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, train

    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=args.hidden,
                                  max_num_inp_token_per_rank=args.tokens, num_experts_per_rank=args.experts,
                                  num_experts_per_token=args.k, data_type=torch.bfloat16, routing_replay=True,
                                  kernel_backend=args.backend, index_dtype=torch.int64)
    with EpDispatchCombineOp(cfg) as op:
        dev, h = op.device, train.register(op)
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.rand(args.tokens, args.k, device=dev, generator=g)
        ids = torch.rand(args.tokens, args.experts, device=dev, generator=g).topk(args.k, -1).indices
        cot = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16, generator=g)

        def inference():
            with torch.no_grad():
                out, _, _, _, _, routing = op.dispatch(x, w, None, ids, return_routing=True)
                op.combine(out, routing=routing)

        def forward(backward=False):
            xs, ws_ = x.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
            d = train.dispatch(h, xs, ws_, ids)
            y, _ = train.combine(h, d.out, d)
            if backward:
                (y * cot).sum().backward()

        def packed():
            xs, ws_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            d = train.dispatch(h, xs, ws_, ids)
            lay = train.pack(d, rank, args.experts, 128)
            y = train.combine_packed(h, lay.mask(lay.x) * lay.weights[:, None].to(lay.x.dtype), lay, d)
            (y * cot).sum().backward()

        rows = {"inference": inference, "forward": forward, "train": lambda: forward(True), "train_packed": packed}
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        for name, step in rows.items():
            for _ in range(args.warmup):
                step()
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                step()
            sync()
            us = (time.perf_counter() - start) / args.iters * 1e6
            if rank == 0:
                print(f"{name:>13} {us:>10.1f} us", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--backend", choices=("hip", "torch"), default="hip")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    if args.backend == "hip" and not torch.cuda.is_available():
        print("bench_ep_train: needs a GPU for --backend hip (--backend torch runs on the CPU)", file=sys.stderr)
        return 2
    print(f"{args.tokens} tokens, hidden {args.hidden}, top-{args.k} of {args.experts} experts, bf16, "
          f"backend {args.backend}, one rank")
    run_distributed(_job, 1, args, timeout=600, **(dict(backend="nccl", gpus=1) if args.backend == "hip" else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
