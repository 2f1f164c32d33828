"""Probe: how fast can SMs pull a peer's rows, by access pattern (EP2, both GPUs at once).

A pull combine reads 2 KB chunks of randomly placed 14 KB rows from the peer's staging region while
reading the same amount locally (the op's combine pushes instead: docs/performance.md, "Push
combine"). This script times torch's own kernels on symmetric memory for the patterns in between,
to tell the link's limit for a pattern from the kernel's:
  contiguous  -- ``neg`` over a contiguous peer range (bf16; ``_f32``: the same bytes as float32,
                 the bench's "SM pull" kernel); ``copy``: ``copy_`` of it
  rows        -- ``index_select`` of randomly ordered 14 KB peer rows
  chunks      -- ``index_select`` of randomly ordered 2 KB peer chunks
Each reads ``--rows`` rows of ``--hidden`` bf16 (58.7 MB at the defaults) from the peer; GB/s is
that over the median event-timed time of ``--reps`` back-to-back repetitions (queued behind a GPU
sleep, as the bench times), both ranks running together.

    python3 scripts/probes/probe_peer_pull.py            # needs 2 GPUs
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from mori_jit.testing.distributed import run_distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/: the benchmark's timers
from bench_link import back_to_back_median_us, sm_link_rates  # noqa: E402


def _job(rank, ws, rows, hidden, reps):
    import torch.distributed._symmetric_memory as symm_mem
    dev = torch.device("cuda", rank)
    cap = 2 * rows
    buf = symm_mem.empty(cap * hidden, dtype=torch.bfloat16, device=dev)
    buf.normal_()
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = hdl.get_buffer((rank + 1) % ws, (cap, hidden), torch.bfloat16)
    out = torch.empty(rows, hidden, dtype=torch.bfloat16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(rank)
    row_idx = torch.randperm(cap, generator=gen, device=dev)[:rows]
    per_row = hidden * 2 // 2048
    chunk_idx = torch.randperm(cap * per_row, generator=gen, device=dev)[:rows * per_row]
    peer_chunks, out_chunks = peer.view(-1, 1024), out.view(-1, 1024)
    patterns = {
        "contiguous": lambda: torch.neg(peer[:rows], out=out),
        "contiguous_f32": lambda: torch.neg(peer[:rows].view(torch.float32), out=out.view(torch.float32)),
        "copy": lambda: out.copy_(peer[:rows]),
        "rows": lambda: torch.index_select(peer, 0, row_idx, out=out),
        "chunks": lambda: torch.index_select(peer_chunks, 0, chunk_idx, out=out_chunks),
    }
    res = {}
    for name, fn in patterns.items():
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        us = back_to_back_median_us(fn, reps)
        res[name] = (us, rows * hidden * 2 / us / 1e3)
    if os.environ.get("PROBE_BENCH_RATES"):
        rates = sm_link_rates(rank, ws)
        if rank == 0:
            print("bench_ep.sm_link_rates:", {k: round(v) for k, v in rates.items()}, flush=True)
    if rank == 0:
        for name, (us, gbps) in res.items():
            print(f"{name:>10}: {us:8.1f} us  {gbps:6.1f} GB/s", flush=True)
    dist.barrier()
    peer = hdl = buf = None  # release the symmetric buffer (the lambdas above hold `peer` until then)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    run_distributed(_job, 2, args.rows, args.hidden, args.reps, timeout=300, backend="nccl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
