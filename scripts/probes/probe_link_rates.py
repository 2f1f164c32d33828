"""Peer-link rates at a given transfer size: SM-driven pushes/pulls and the copy engine.

``scripts/bench_ep.py`` measures its ceilings on large transfers (a 1 GiB one-direction copy, 256
MiB SM traffic). The EP op moves less per call (58.5 MB each way at EP2, 4096 tokens, bf16), where
ramp-up and tail weigh more. This probe measures, for each ``--mib`` size:

* ``sm_{push,pull}_{one,both}_gbps``: torch's elementwise kernel writing (push) or reading (pull)
  the peer's symmetric buffer, rank 0 alone (``one``) or every rank at once (``both``, the op's
  pattern); back-to-back event timing (``bench_ep.sm_link_rates``);
* ``ce_both_gbps``: every rank's copy engine writing the peer's buffer at once (``copy_`` to a
  peer symmetric view), event-timed, median of 7 after one warm-up.

    PYTHONPATH=. python3 scripts/probes/probe_link_rates.py [--mib 58.5 256]

Needs two or more GPUs; prints one JSON line per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from mori_jit.testing.distributed import run_distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/: bench_ep's timers


def _ce_both_gbps(rank: int, ws: int, nbytes: int, reps: int = 8) -> float:
    import torch.distributed._symmetric_memory as symm_mem
    dev = torch.device("cuda", rank)
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = hdl.get_buffer((rank + 1) % ws, (nbytes,), torch.uint8)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    secs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        peer.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        secs.append(e0.elapsed_time(e1) * 1e-3)
    dist.barrier()
    del peer, hdl, buf
    return nbytes / statistics.median(secs[1:]) / 1e9


def _job(rank, ws, sizes_mib):
    import bench_ep
    res = {}
    for mib in sizes_mib:
        nbytes = int(mib * 2**20) // 16 * 16
        r = bench_ep.sm_link_rates(rank, ws, nbytes=nbytes, reps=10)
        r["ce_both_gbps"] = _ce_both_gbps(rank, ws, nbytes)
        res[f"{mib}MiB"] = r
    print(rank, json.dumps(res), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, nargs="+", default=[58.5, 256.0], help="transfer sizes (MiB)")
    args = ap.parse_args(argv)
    ws = torch.cuda.device_count()
    if ws < 2:
        print("probe_link_rates: needs two or more GPUs", file=sys.stderr)
        return 2
    run_distributed(_job, ws, args.mib, timeout=300, backend="nccl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
