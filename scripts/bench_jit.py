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


FRESH_BREAKDOWN = r"""
import json, time
import torch
from mori_jit.jit import compile as C
from mori_jit.jit.runtime import get_runtime
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
import mori_jit.jit.runtime.cuda
torch.cuda.init(); torch.empty(1, device="cuda"); torch.cuda.synchronize()
pc = time.perf_counter
t = [pc()]
from mori_jit.jit.toolchain import get_toolchain
tc = get_toolchain(); t.append(pc())
cfg = AxpyCfg()
res = C.resolve(AXPY, cfg, tc); t.append(pc())          # render (jinja load+compile) + include hash + key
entry = C.build(AXPY, cfg, tc, resolved=res); t.append(pc())  # verify meta + sha256 of the binary
rt = get_runtime(tc.vendor); t.append(pc())              # CudaRuntime(): cuInit, torch.cuda.init
image = entry.binary.read_bytes(); t.append(pc())
mod = rt.load_module(image, 0); t.append(pc())            # cuModuleLoadData
fn = rt.get_function(mod, AXPY.entry_name(cfg)); t.append(pc())
names = ["toolchain", "resolve", "build_hit_verify", "runtime_init", "read_binary", "module_load", "get_function"]
print(json.dumps({k: t[i + 1] - t[i] for i, k in enumerate(names)}))
"""


def _us(seconds: float) -> float:
    return seconds * 1e6


def _interleaved(cases: dict, iters: int, batch: int, sleep_cycles: int) -> dict:
    """Host µs/call of each case, timed in interleaved batches while the GPU is kept busy.

    Before each batch a ``torch.cuda._sleep`` kernel occupies the GPU for longer than the batch
    takes to enqueue, so launches only queue up: the host timer sees pure submission cost, never
    back-pressure from a GPU that is still executing. Cases are interleaved batch by batch, so
    slow drifts of the machine hit every case alike; ``overhead_vs_raw_us`` is the median of the
    per-round differences to the raw ``cuLaunchKernel`` batch of the same round.
    """
    import torch
    pc = time.perf_counter
    per: dict[str, list[float]] = {k: [] for k in cases}
    rounds = max(1, iters // batch)
    for _ in range(rounds):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            t0 = pc()
            for _ in range(batch):
                fn()
            t1 = pc()
            per[name].append((t1 - t0) / batch)
    torch.cuda.synchronize()
    raw = per.get("raw cuLaunchKernel (cuda-bindings)")
    out = {}
    for name, xs in per.items():
        r = {"host_us_median": _us(statistics.median(xs)), "host_us_min": _us(min(xs)),
             "host_us_max": _us(max(xs)), "batches": len(xs), "calls": len(xs) * batch}
        if raw is not None:
            r["overhead_vs_raw_us"] = _us(statistics.median(x - y for x, y in zip(xs, raw)))
        out[name] = r
    return out


def _gpu_per_kernel(fn, count: int = 200, replays: int = 20) -> float:
    """GPU µs per call of ``fn`` when fed back to back: ``count`` calls captured in a graph, replayed."""
    import torch
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(count):
            fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (count * replays)


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
    ap.add_argument("--iters", type=int, default=10000, help="launches per case")
    ap.add_argument("--batch", type=int, default=500, help="launches between synchronizations")
    ap.add_argument("--n", type=int, default=32, help="elements of the tiny launch-overhead kernel")
    ap.add_argument("--sleep-cycles", type=int, default=60_000_000,
                    help="GPU clock cycles of the busy kernel before each batch (must outlast the batch)")
    ap.add_argument("--fresh-runs", type=int, default=3, help="fresh-process measurements (median)")
    args = ap.parse_args()

    import torch
    from cuda.bindings import driver as drv

    from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType
    from mori_jit.jit import plan as plan_mod
    from mori_jit.jit.launch_group import LaunchGroup
    from mori_jit.jit.plan import prepare
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
    parts = []
    for _ in range(args.fresh_runs):
        out = subprocess.run([sys.executable, "-c", FRESH_BREAKDOWN], env=env, capture_output=True, text=True,
                             check=True)
        parts.append(json.loads(out.stdout.strip().splitlines()[-1]))
    res["fresh_process_breakdown_ms"] = {k: 1e3 * statistics.median(r[k] for r in parts) for k in parts[0]}

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
    launches = _interleaved(cases, args.iters, args.batch, args.sleep_cycles)
    res["launch"] = launches
    res["launch"]["LaunchGroup(2).launch(**fields)"]["host_us_per_plan"] = \
        launches["LaunchGroup(2).launch(**fields)"]["host_us_median"] / 2
    res["gpu_us_per_kernel_back_to_back"] = {
        "axpy tiny (plan.launch_struct, in a graph)": _gpu_per_kernel(lambda: launch_struct(s)),
        "torch add_ (in a graph)": _gpu_per_kernel(lambda: y.add_(x, alpha=1e-3)),
    }
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
    print(f"{'fresh process breakdown (separate runs)':44s} " + ", ".join(
        f"{k} {v:.2f}" for k, v in res["fresh_process_breakdown_ms"].items()) + " ms")
    print(f"{'launch (GPU kept busy, interleaved batches)':44s} {'host us/call':>12s} {'min':>7s} {'max':>7s} "
          f"{'vs raw':>7s}")
    for name, r in launches.items():
        print(f"{name:44s} {r['host_us_median']:12.2f} {r['host_us_min']:7.2f} {r['host_us_max']:7.2f} "
              f"{r.get('overhead_vs_raw_us', float('nan')):+7.2f}")
    for k, v in res["gpu_us_per_kernel_back_to_back"].items():
        print(f"{'GPU per kernel: ' + k:44s} {v:9.2f} us")
    for k, v in res["pieces_us"].items():
        print(f"{'  piece: ' + k:44s} {v:9.3f} us")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
