#!/usr/bin/env python3
"""Benchmark of the JIT framework's host-side costs, in one run.

Measures, with ``example_axpy``:

* cold compile: ``prepare`` in a fresh cache directory (render + nvcc/hipcc + publish + load);
* fresh process, cached plan: a new interpreter, timed after its imports and after CUDA context
  creation (reported separately), until ``prepare`` returns a ready plan from the warm cache;
* in-process ``prepare`` hit (the memo);
* host overhead per launch: ``plan.launch(**fields)`` (int pointers and tensors),
  ``plan.launch_struct``, ``LaunchGroup.launch`` (2 plans), against raw ``cuLaunchKernel`` through
  cuda-bindings (same function, prebuilt args: the floor of our path), raw ``cuLaunchKernel``
  through ctypes, and a torch elementwise op (``y.add_(x, alpha=a)``) of the same size.

Launch overheads are timed with the host clock over batches of launches of a tiny kernel (one
block of 32 threads), synchronizing between batches so the launch queue never fills; CUDA
events around each batch give the GPU time per launch, reported next to it so one can see the
GPU is not the bottleneck (GPU µs/launch < host µs/launch means the host timing is host cost).

Usage: ``PYTHONPATH=. python3 scripts/bench_jit.py --out bench_jit.json``
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FRESH_PROCESS = r"""
import json, time, sys
t0 = time.perf_counter()
import torch
from mori_jit.jit.plan import prepare
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
import mori_jit.jit.runtime.cuda  # the vendor bindings are an import too
t1 = time.perf_counter()
torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
from mori_jit.jit.toolchain import get_toolchain
tc = get_toolchain()
t3 = time.perf_counter()
plan = prepare(AXPY, AxpyCfg())  # compiled by the cold step
t4 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "cuda_init_s": t2 - t1, "toolchain_s": t3 - t2,
                  "prepare_s": t4 - t3, "after_cuda_init_s": t4 - t2, "after_imports_s": t4 - t1,
                  "name": plan.name}))
"""


def _us(seconds: float) -> float:
    return seconds * 1e6


def _batched(fn, iters: int, batch: int):
    """Host µs/call (median over batches, and mean) and GPU µs/call, for ``iters`` calls of ``fn``."""
    import torch
    host, gpu = [], []
    done = 0
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pc = time.perf_counter
    while done < iters:
        k = min(batch, iters - done)
        torch.cuda.synchronize()
        ev0.record()
        t0 = pc()
        for _ in range(k):
            fn()
        t1 = pc()
        ev1.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) / k)
        gpu.append(ev0.elapsed_time(ev1) * 1e-3 / k)
        done += k
    return {"host_us_median": _us(statistics.median(host)), "host_us_mean": _us(sum(host) / len(host)),
            "host_us_min": _us(min(host)), "gpu_us_per_call": _us(statistics.median(gpu)), "calls": iters}


def _per_call(fn, iters: int, repeats: int = 5) -> dict:
    pc = time.perf_counter
    runs = []
    for _ in range(repeats):
        t0 = pc()
        for _ in range(iters):
            fn()
        runs.append((pc() - t0) / iters)
    return {"us_median": _us(statistics.median(runs)), "us_min": _us(min(runs)), "calls": iters * repeats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="path of the JSON results")
    ap.add_argument("--iters", type=int, default=10000, help="launches per measurement")
    ap.add_argument("--batch", type=int, default=500, help="launches between synchronizations")
    ap.add_argument("--n", type=int, default=32, help="elements of the tiny launch-overhead kernel")
    ap.add_argument("--fresh-runs", type=int, default=3, help="fresh-process measurements (median)")
    args = ap.parse_args()

    import torch
    from cuda.bindings import driver as drv

    from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType
    from mori_jit.jit import plan as plan_mod
    from mori_jit.jit.plan import LaunchGroup, prepare
    from mori_jit.jit.toolchain import get_toolchain

    cache = tempfile.mkdtemp(prefix="mori_jit_bench_")
    os.environ["MORI_JIT_CACHE_DIR"] = cache
    torch.cuda.init()
    torch.empty(1, device="cuda")
    tc = get_toolchain()
    res: dict = {"machine": {"gpu": torch.cuda.get_device_name(), "arch": tc.arch, "torch": torch.__version__,
                             "python": platform.python_version(), "compiler": tc.compiler,
                             "cpu_count": os.cpu_count()}, "cache_dir": cache}

    # ---- cold compile -----------------------------------------------------------------------------
    tiny = AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4, blockSize=32, blockNum=1)
    tiny2 = AxpyCfg(dtype=AxpyDType.Fp32, vecElems=2, blockSize=32, blockNum=1)
    default = AxpyCfg()
    cold = {}
    for label, cfg in (("bf16_default", default), ("fp32_tiny", tiny), ("fp32_tiny2", tiny2)):
        plan_mod.forget_plans()
        t0 = time.perf_counter()
        p = prepare(AXPY, cfg, tc)
        cold[label] = {"prepare_s": time.perf_counter() - t0, "compiler_s": p.entry.meta.get("compile_s")}
    res["cold_compile"] = cold

    # ---- fresh process, warm cache ----------------------------------------------------------------
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    fresh = []
    for _ in range(args.fresh_runs):
        out = subprocess.run([sys.executable, "-c", FRESH_PROCESS], env=env,
                             capture_output=True, text=True, check=True)
        fresh.append(json.loads(out.stdout.strip().splitlines()[-1]))
    res["fresh_process"] = {k: statistics.median(r[k] for r in fresh) for k in fresh[0] if k != "name"}
    res["fresh_process"]["runs"] = fresh

    # ---- in-process hit ---------------------------------------------------------------------------
    plan_mod.forget_plans()
    p_tiny = prepare(AXPY, tiny, tc)
    res["prepare_hit"] = {
        "default_args": _per_call(lambda: prepare(AXPY, tiny), 20000),
        "explicit_toolchain_device": _per_call(lambda: prepare(AXPY, tiny, tc, 0), 20000),
    }

    # ---- launch overhead --------------------------------------------------------------------------
    n = args.n
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    xp, yp = x.data_ptr(), y.data_ptr()
    p2 = prepare(AXPY, tiny2, tc)
    group = LaunchGroup([p_tiny, p2])
    s = p_tiny.args(x=xp, y=yp, a=1e-3, n=n)

    stream_raw = torch.cuda.current_stream().cuda_stream
    cu_stream = drv.CUstream(stream_raw)
    kp = (ctypes.c_void_p * 1)(ctypes.addressof(s))
    kp_addr = ctypes.addressof(kp)
    fn = p_tiny.function
    cu_launch = drv.cuLaunchKernel

    def raw_cuda_bindings():
        cu_launch(fn, 1, 1, 1, 32, 1, 1, 0, cu_stream, kp_addr, 0)

    libcuda = ctypes.CDLL("libcuda.so.1")
    c_launch = libcuda.cuLaunchKernel
    c_launch.restype = ctypes.c_int
    c_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn_int = int(fn)

    def raw_ctypes():
        c_launch(fn_int, 1, 1, 1, 32, 1, 1, 0, stream_raw, kp_addr, None)

    launch, launch_struct, glaunch = p_tiny.launch, p_tiny.launch_struct, group.launch
    cases = {
        "plan.launch(**fields) int ptrs": lambda: launch(x=xp, y=yp, a=1e-3, n=n),
        "plan.launch(**fields) tensors": lambda: launch(x=x, y=y, a=1e-3, n=n),
        "plan.launch_struct(s)": lambda: launch_struct(s),
        "LaunchGroup(2).launch(**fields)": lambda: glaunch(x=xp, y=yp, a=1e-3, n=n),
        "raw cuLaunchKernel (cuda-bindings)": raw_cuda_bindings,
        "raw cuLaunchKernel (ctypes)": raw_ctypes,
        "torch y.add_(x, alpha=a)": lambda: y.add_(x, alpha=1e-3),
    }
    for f in cases.values():  # warm-up
        for _ in range(200):
            f()
    torch.cuda.synchronize()
    launches = {}
    for _round in range(2):  # two rounds: the spread between them is the noise
        for name, f in cases.items():
            r = _batched(f, args.iters, args.batch)
            prev = launches.get(name)
            if prev is None:
                launches[name] = r
            else:
                launches[name] = {**r, "host_us_median_round1": prev["host_us_median"]}
    res["launch"] = launches
    res["launch"]["LaunchGroup(2).launch(**fields)"]["host_us_per_plan"] = \
        launches["LaunchGroup(2).launch(**fields)"]["host_us_median"] / 2
    torch.cuda.synchronize()  # raises if any timed launch faulted
    res["launch_outputs_finite"] = bool(torch.isfinite(y).all())

    # pieces of the launch path
    sg = p_tiny._stream
    fields = dict(x=xp, y=yp, a=1e-3, n=n)
    buf = p_tiny._buf
    res["pieces_us"] = {
        "stream getter": _per_call(sg, 100000)["us_median"],
        "pack 4 fields (ints)": _per_call(lambda: p_tiny._pack(buf, fields), 100000)["us_median"],
        "prepare hit": res["prepare_hit"]["default_args"]["us_median"],
    }

    targets = {"prepare_hit_us": 20.0, "fresh_process_after_imports_ms": 10.0, "launch_host_us": 3.0}
    res["targets"] = targets
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)

    # ---- table ------------------------------------------------------------------------------------
    fp = res["fresh_process"]
    print(f"\nmori-jit bench on {res['machine']['gpu']} ({tc.arch}), torch {torch.__version__}, "
          f"python {platform.python_version()}")
    print(f"{'measurement':44s} {'value':>12s}")
    for k, v in cold.items():
        print(f"{'cold prepare ' + k:44s} {v['prepare_s'] * 1e3:9.1f} ms  (compiler {v['compiler_s']} s)")
    print(f"{'fresh process: CUDA init (not counted)':44s} {fp['cuda_init_s'] * 1e3:9.2f} ms")
    print(f"{'fresh process: cached plan after CUDA init':44s} {fp['after_cuda_init_s'] * 1e3:9.2f} ms"
          f"  (toolchain {fp['toolchain_s'] * 1e3:.2f} + prepare {fp['prepare_s'] * 1e3:.2f}; target <= 10)")
    print(f"{'fresh process: after imports incl. CUDA init':44s} {fp['after_imports_s'] * 1e3:9.2f} ms")
    print(f"{'in-process prepare hit':44s} {res['prepare_hit']['default_args']['us_median']:9.2f} us  (target <= 20)")
    print(f"{'launch':44s} {'host us/call':>12s} {'(round 1)':>10s} {'GPU us/call':>12s}")
    for name, r in launches.items():
        print(f"{name:44s} {r['host_us_median']:12.2f} {r.get('host_us_median_round1', float('nan')):10.2f} "
              f"{r['gpu_us_per_call']:12.2f}")
    for k, v in res["pieces_us"].items():
        print(f"{'  piece: ' + k:44s} {v:9.3f} us")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
