"""Where the host time of the EP op's ``dispatch()``/``combine()`` goes (one GPU, world size 1).

Times each piece of the Python launch path on its own, median and 10th percentile of ``--reps``
calls (the GPU is synced every 64 calls, so the launch queue never fills): tensor allocation
(``torch.empty``, ``new_empty``, the op's :class:`CombineOutputs`), argument validation, the
backend's launch (``op.kernels``: args struct + driver call), the driver's ``cuLaunchKernel`` alone
(cuda-bindings and ctypes), and the whole ``op.dispatch``/``op.combine`` calls. Two rounds, as a
host's speed can drift between two levels (``docs/performance.md``, "Machine").

    CUDA_VISIBLE_DEVICES=0 python3 scripts/profile_ep_host.py [--tokens 128] [--reps 3000]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from mori_jit.testing.distributed import run_distributed


def host_us(fn, reps: int) -> tuple[float, float]:
    """Median and 10th percentile µs of the host time of ``reps`` calls of ``fn`` (the GPU is
    synced every 64 calls, so the launch queue never fills)."""
    xs = []
    for i in range(reps):
        if i % 64 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    xs.sort()
    return statistics.median(xs) * 1e6, xs[reps // 10] * 1e6


def _timer(reps: int):
    def t(name, fn):
        med, p10 = host_us(fn, reps)
        print(f"{name:32s} median {med:6.2f} us  p10 {p10:6.2f}", flush=True)
    return t


def _job(rank, ws, n, reps):
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
    from mori_jit.ops.ep.core.arguments import expect_tensor
    from mori_jit.ops.ep.backends.hip.backend import CombineOutputs
    from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE

    dev = torch.device("cuda", 0)
    hidden, k = 7168, 8
    cfg = EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=hidden, max_num_inp_token_per_rank=n,
                                  num_experts_per_rank=256, num_experts_per_token=k, data_type=torch.bfloat16)
    with EpDispatchCombineOp(cfg) as op:
        x = torch.randn(n, hidden, device=dev).bfloat16()
        w = torch.rand(n, k, device=dev)
        idx = torch.stack([torch.randperm(256)[:k] for _ in range(n)]).int().to(dev)
        r = op.dispatch(x, w, None, idx, return_routing=True)
        inp = op.get_combine_input_buffer()
        y = torch.empty(n, hidden, dtype=torch.bfloat16, device=dev)
        yw = torch.empty(n, k, device=dev)
        ks, v = op.kernels, op._pick(n)
        fresh = CombineOutputs(torch.bfloat16, hidden, k, dev)
        op.combine(inp, weights=r[1], routing=r[5], out=y, out_weights=yw)  # fills the combine's args struct,
        torch.cuda.synchronize()  # which the bare driver launches below reuse
        op.check()
        # this bucket's bound combine launch, and what it hands the driver
        bound = ks.bound_launches[COMBINE][v]
        plan = bound.plan
        kp_addr = ctypes.addressof(bound.params)
        from cuda.bindings import driver as drv
        st = plan.runtime.current_stream(plan.device)
        cs, fn = drv.CUstream(st), plan.function
        cl = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        cl.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        cl.restype = ctypes.c_int
        fint, gx, bx, shm = int(fn), plan.grid[0], plan.block[0], plan.shared_bytes
        t = _timer(reps)
        for rnd in range(2):
            print(f"--- round {rnd}")
            r = op.dispatch(x, w, None, idx, return_routing=True)  # (combine takes the latest dispatch's routing)
            t("torch.empty", lambda: torch.empty((n, hidden), dtype=torch.bfloat16, device=dev))
            t("new_empty", lambda: y.new_empty((n, hidden)))
            t("CombineOutputs.y", lambda: fresh.y(n))
            t("expect_tensor (one tensor)", lambda: expect_tensor("input", inp, torch.bfloat16, (inp.shape[0], hidden), dev))
            t("driver launch (cuda-bindings)", lambda: drv.cuLaunchKernel(fn, gx, 1, 1, bx, 1, 1, shm, cs, kp_addr, 0))
            t("driver launch (ctypes)", lambda: cl(fint, gx, 1, 1, bx, 1, 1, shm, st, kp_addr, None))
            t("bound launch", bound)
            t("kernels.combine (out=)", lambda: ks.combine(v, inp, r[1], r[5], y, yw))
            t("op.combine (out=)", lambda: op.combine(inp, weights=r[1], routing=r[5], out=y, out_weights=yw))
            t("op.combine (allocating)", lambda: op.combine(inp, weights=r[1], routing=r[5]))
            t("kernels.dispatch", lambda: ks.dispatch(v, x, w, None, idx))
            t("op.dispatch", lambda: op.dispatch(x, w, None, idx, return_routing=True))
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3000)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_ep_host: needs a GPU", file=sys.stderr)
        return 2
    run_distributed(_job, 1, args.tokens, args.reps, timeout=300, backend="nccl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
