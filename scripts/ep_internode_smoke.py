"""Internode dispatch + combine rounds (NVSHMEM) with step-by-step progress; prints PASS, FAIL or SKIP.

    PYTHONPATH=. python3 scripts/ep_internode_smoke.py [--family v2_ll|v2|auto] [--ws 2] [--gpu-per-node 1]
        [--hidden 2048] [--k 4] [--m 32] [--rounds 3] [--host-reps 0]

Ranks go round-robin over the visible GPUs (``mori_jit/testing/gpu_world.py``); ranks that share a
GPU run under CUDA MPS (started here when none runs and this is root) with each rank's
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set, as NVSHMEM needs. Each rank prints which peers its
arena reaches with loads and stores (NVSHMEM's P2P transport) and which only through puts.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import traceback

import torch

from ep_smoke_rounds import log, smoke_rounds

def _host_us(rank, op, m, reps):
    """Median and 10th percentile µs of the Python side of ``reps`` dispatch and combine calls, every
    other combine into given outputs (``out=``) and the rest allocating them (every rank makes the
    same calls; the GPU is synced every 32 rounds, so launches never queue up)."""
    import statistics
    import time

    from mori_jit.testing.golden import make_inputs

    cfg = op.cfg
    x, w, idx = make_inputs(rank, m, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts, torch.bfloat16,
                            _device(), torch.Generator().manual_seed(rank))
    out, out_w, *_, routing = op.dispatch(x, w, None, idx, return_routing=True)
    y, y_w = op.combine(out, weights=out_w, routing=routing)
    times = {"dispatch": [], "combine": [], "combine (out=)": []}
    for i in range(reps):
        if i % 32 == 0:
            torch.cuda.synchronize()
            torch.distributed.barrier()
        given = i % 2 == 1  # (every rank alternates alike: the legs stay collective)
        t0 = time.perf_counter()
        out, out_w, *_, routing = op.dispatch(x, w, None, idx, return_routing=True)
        t1 = time.perf_counter()
        if given:
            op.combine(out, weights=out_w, routing=routing, out=y, out_weights=y_w)
        else:
            op.combine(out, weights=out_w, routing=routing)
        times["dispatch"].append(t1 - t0), times["combine (out=)" if given else "combine"].append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    op.check()
    for name, xs in times.items():
        xs.sort()
        log(rank, f"host {name}: median {statistics.median(xs) * 1e6:.2f} us, p10 {xs[len(xs) // 10] * 1e6:.2f} us "
                  f"({len(xs)} calls, {m} tokens)")


def _device() -> torch.device:
    """This rank's GPU."""
    return torch.device("cuda", torch.cuda.current_device())


def _job(rank, ws, gpn, hidden, k, m, rounds, family, host_reps=0):
    faulthandler.dump_traceback_later(90, exit=False)
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, gpu_per_node=gpn, hidden_dim=hidden,
                                  max_num_inp_token_per_rank=m, num_experts_per_rank=max(1, 16 // ws),
                                  num_experts_per_token=k, internode_kernel=family)
    log(rank, f"constructing op (MPS thread percentage {os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')})")
    with EpDispatchCombineOp(cfg) as op:
        p2p = [pe for pe, p in enumerate(op.arena.peer_bases) if p]
        log(rank, f"op ready ({family}, buckets {op.kernels.schedule.edges}): memory {op.memory_kind}, "
                  f"{op.arena.tensor.numel()} bytes; peers reached by loads/stores (P2P) {p2p}, by puts only "
                  f"{sorted(set(range(ws)) - set(p2p))}; "
                  f"same node as this rank {[pe for pe in range(ws) if pe // gpn == rank // gpn]}")
        grids = {leg: [launch.plan.grid[0] for launch in launches] for leg, launches in op.kernels.bound_launches.items()}
        sms = torch.cuda.get_device_properties(_device()).multi_processor_count
        log(rank, f"blocks per bucket {grids}; SMs this process sees: {sms}; ranks on this GPU: {op.ranks_per_device}")
        smoke_rounds(op, rounds, _device())
        if host_reps:
            _host_us(rank, op, m, host_reps)
    faulthandler.cancel_dump_traceback_later()


def main() -> int:
    """Run the job; print PASS, FAIL (with the error) or SKIP (why it cannot run here)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("v2_ll", "v2", "auto"), default="v2_ll")
    ap.add_argument("--ws", type=int, default=2)
    ap.add_argument("--gpu-per-node", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host-reps", type=int, default=0,
                    help="then time the Python side of this many dispatch + combine calls")
    a = ap.parse_args()
    os.environ.setdefault("MORI_EP_TIMEOUT_S", "10")
    from _pytest.outcomes import Skipped

    from mori_jit.testing.gpu_world import stop_mps
    from mori_jit.testing.gpu_world_shmem import run_shmem_job
    try:
        run_shmem_job(_job, a.ws, a.gpu_per_node, a.hidden, a.k, a.m, a.rounds, a.family, a.host_reps, timeout=300)
    except Skipped as e:
        print(f"SKIP: {e}")
        return 2
    except BaseException:  # noqa: BLE001 - the report is the point
        traceback.print_exc()
        print("FAIL")
        return 1
    finally:
        stop_mps()
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
