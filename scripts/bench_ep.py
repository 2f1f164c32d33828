"""EP dispatch/combine benchmark: the ``hip`` backend (eager and graph) beside the ``torch`` backend
(NCCL) and the measured link ceiling, in one run. One process per GPU (spawned here; NCCL).

    PYTHONPATH=. python3 scripts/bench_ep.py --out results/   # JSON + Markdown + PNG
    PYTHONPATH=. python3 scripts/bench_ep.py --sweep --tokens 128 4096   # blocks x warps sweep
    PYTHONPATH=. python3 scripts/bench_ep.py --wire [--tokens ...]   # fp8 vs bf16 combine, one GPU

Workload (defaults): hidden 7168, topk 8, 256 experts in total, tokens per rank 128/512/1024/4096,
routing = a random permutation of experts per token, first k; bf16/bf16 and fp8/bf16 legs.
Every timed point is first gated by the golden check (exit 1 on failure). Timing: warm-up, a GPU
sleep so the host queues the loop ahead of the GPU, CUDA
events, 4 rotating input sets, median of ``--iters`` (rank 0's, with every rank's kept beside it as
``per_rank_us``); dispatch and combine timed separately;
combine both from a fresh expert-output tensor ("hip_graph") and with the expert writing into the
op's combine input buffer ("_buffer"); with the push combine the two are read alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from mori_jit.ops.ep.backends.hip.intranode.cfg import EP_STAMP_WORDS, Stamp
from mori_jit.testing.cuda_graph import QUEUE_AHEAD_CYCLES
from mori_jit.testing.distributed import run_distributed

from bench_ep_report import report
from bench_link import link_ceiling, link_ceiling_reps_gbps, sm_link_rates

FP8 = torch.float8_e4m3fn
LEGS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp8": (FP8, torch.bfloat16)}


def _inputs(rank, ws, n, hidden, k, experts, dtype, dev, gen):
    x = (torch.randn(n, hidden, generator=gen) * 2).to(dtype).to(dev)
    w = (torch.rand(n, k, generator=gen) + 0.05).to(dev)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)]).to(torch.int32).to(dev)
    return x, w, idx


def _remote_rows(idx, rank, ws, epr):
    dest = (idx.long() // epr)
    hit = torch.zeros(idx.shape[0], ws, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, dest, True)
    hit[:, rank] = False
    return int(hit.sum())


def _time_pairs(fn_a, fn_b, iters, rotate):
    """Median µs of fn_a and fn_b, timed separately with events, over ``iters`` rotating inputs.

    A GPU sleep first lets the host queue every iteration ahead of the GPU: otherwise, at small
    sizes, the events time the host's launch latency (a 1-kernel graph reads 11-17 µs, not 4.7)."""
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
    for i in range(iters):
        rotate(i)
        ev[i][0].record()
        fn_a(i)
        ev[i][1].record()
        fn_b(i)
        ev[i][2].record()
    torch.cuda.synchronize()
    a = [e[0].elapsed_time(e[1]) * 1e3 for e in ev]
    b = [e[1].elapsed_time(e[2]) * 1e3 for e in ev]
    return statistics.median(a), statistics.median(b)


def _timed(d_us: float, c_us: float) -> dict:
    """This rank's medians, with every rank's (``per_rank_us``: [dispatch, combine] by rank; the headline
    figures are rank 0's, as every rank's events time the same lockstep loop). Collective."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [d_us, c_us])
    return {"dispatch_us": d_us, "combine_us": c_us, "per_rank_us": every}


def _bare_a2a(rank, ws, idx, n, hidden, epr, disp_t, comb_t, dev, iters):
    """The floor users would otherwise write: NCCL ``all_to_all_single`` of exactly the rows this
    routing sends (one copy per destination rank), forward in the dispatch dtype and back in the
    combine dtype. No packing, no permutation: pure data movement, so a generous baseline."""
    hit = torch.zeros(n, ws, dtype=torch.bool, device=dev)
    hit.scatter_(1, (idx.long() // epr).clamp(0, ws - 1), True)
    counts = hit.sum(0).to(torch.int64)
    all_counts = [torch.empty_like(counts) for _ in range(ws)]
    dist.all_gather(all_counts, counts)
    in_splits, out_splits = counts.tolist(), [int(c[rank]) for c in all_counts]
    ebd = torch.empty((), dtype=disp_t).element_size()
    # NCCL has no fp8 type: move bytes, as the op does
    fwd_in = torch.randint(0, 255, (sum(in_splits), hidden * ebd), dtype=torch.uint8, device=dev)
    fwd_out = torch.empty(sum(out_splits), hidden * ebd, dtype=torch.uint8, device=dev)
    back_in = torch.randn(sum(out_splits), hidden, device=dev).to(comb_t)
    back_out = torch.empty(sum(in_splits), hidden, dtype=comb_t, device=dev)
    fwd = lambda i: dist.all_to_all_single(fwd_out, fwd_in, out_splits, in_splits)  # noqa: E731
    back = lambda i: dist.all_to_all_single(back_out, back_in, in_splits, out_splits)  # noqa: E731
    for _ in range(3):
        fwd(0), back(0)
    dist.barrier()
    return _timed(*_time_pairs(fwd, back, iters, lambda i: None))


#: Phase stamps written by the kernels (``Stamp``, declared in
#: mori_jit/ops/ep/backends/hip/common/consts.py), as µs since the kernel's start: (label, stamp,
#: start stamp).
PHASES = [("disp: block 0 claimed its slots", Stamp.kStDispClaimed, Stamp.kStDispStart),
          ("disp: block 0 copies done", Stamp.kStDispLoopDone, Stamp.kStDispStart),
          ("disp: last block's done count sent", Stamp.kStDispCounted, Stamp.kStDispStart),
          ("disp: peers' done flags seen", Stamp.kStDispPeersDone, Stamp.kStDispStart),
          ("disp: end", Stamp.kStDispEnd, Stamp.kStDispStart),
          ("gap: disp end -> comb start", Stamp.kStCombStart, Stamp.kStDispEnd),
          ("comb: block 0 may push", Stamp.kStCombFirstStore, Stamp.kStCombStart),
          ("comb: first range's rows all here", Stamp.kStCombFirstRange, Stamp.kStCombStart),
          ("comb: last sender done", Stamp.kStCombSent, Stamp.kStCombStart),
          ("comb: last summer saw its flags (low latency: rows)", Stamp.kStCombFlagsSeen, Stamp.kStCombStart),
          ("comb: last summer done", Stamp.kStCombSummed, Stamp.kStCombStart),
          ("comb: last block's done counts sent", Stamp.kStCombEnd, Stamp.kStCombStart)]


def _phase_profile(op, g_disp, g_comb, reps: int = 15, queued: bool = False) -> dict:
    """Median phase times from the kernels' globaltimer stamps: of single replays after a barrier
    (each rank's start skewed by its host's launch), or, ``queued``, of the last of 8 back-to-back
    pairs queued behind a GPU sleep (the ranks in the lockstep the timed loops run in)."""
    a = op.arena
    stamps = a.tensor[a.offsets["stamps"]:a.offsets["stamps"] + EP_STAMP_WORDS * 8].view(torch.int64)
    rows = []
    for _ in range(reps):
        dist.barrier()
        if queued:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        for _ in range(8 if queued else 1):
            g_disp.replay(), g_comb.replay()
        torch.cuda.synchronize()
        rows.append(stamps.tolist())
    return phase_times(rows)


def phase_times(rows: list[list[int]]) -> dict:
    """Median µs of each PHASES entry over stamp-region snapshots (ns). A phase whose stamp was
    never written (0: e.g. no combine senders on one rank) is left out rather than reported as a
    difference from zero."""
    return {label: statistics.median((r[i] - r[j]) / 1e3 for r in rows)
            for label, i, j in PHASES if all(r[i] and r[j] for r in rows)}


def _bench_point(rank, ws, leg, n, args, ceiling, schedule=None):
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
    from mori_jit.testing.golden import golden_check

    disp_t, comb_t = LEGS[leg]
    dev = torch.device("cuda", rank)
    gen = torch.Generator().manual_seed(1000 * rank + n)
    epr = args.experts // ws
    res = {"leg": leg, "tokens": n, "ws": ws}

    def cfg(backend):
        return EpDispatchCombineConfig(
            rank=rank, world_size=ws, hidden_dim=args.hidden, max_num_inp_token_per_rank=n,
            num_experts_per_rank=epr, num_experts_per_token=args.k, data_type=comb_t,
            dispatch_data_type=None if disp_t == comb_t else disp_t,
            combine_data_type=None if disp_t == comb_t else comb_t, kernel_backend=backend, schedule=schedule,
            combine_low_latency={"auto": None, "on": True, "off": False}[args.low_latency])

    sets = [_inputs(rank, ws, n, args.hidden, args.k, args.experts, disp_t, dev, gen) for _ in range(4)]
    remote = statistics.mean(_remote_rows(s[2], rank, ws, epr) for s in sets)
    ebytes_d, ebytes_c = torch.empty((), dtype=disp_t).element_size(), torch.empty((), dtype=comb_t).element_size()
    backends = ("hip",) if schedule is not None else ("hip", "torch")
    for backend in backends:
        with EpDispatchCombineOp(cfg(backend)) as op:
            cur = list(sets[0])
            sx, sw, sidx = (t.clone() for t in sets[0])

            def rotate(i):
                s = sets[i % 4]
                sx.copy_(s[0]), sw.copy_(s[1]), sidx.copy_(s[2])

            # golden gate (fresh data, identity expert)
            out, out_w, _, out_idx, total, routing = op.dispatch(*cur[:2], None, cur[2], return_routing=True)
            exp = out.to(comb_t) if out.element_size() != 1 else out.float().to(comb_t)
            y, y_w = op.combine(exp, weights=out_w, routing=routing)
            if disp_t == comb_t:
                golden_check(op.group, rank, ws, n, epr, cur[0], cur[1], cur[2], out, out_w, out_idx, total,
                             routing.recv_src, y, y_w)
            else:
                golden_check(op.group, rank, ws, n, epr, cur[0], cur[1], cur[2], out, out_w, out_idx, total,
                             routing.recv_src, None, None)
            recv = total.item()
            dist.barrier()
            st = {}

            def disp(i):
                st["r"] = op.dispatch(sx, sw, None, sidx, return_routing=True)

            def comb_copy(i):
                # the expert output is a fresh tensor, as a real expert's GEMM writes
                o = st["r"]
                op.combine(staging_src, weights=o[1], routing=o[5])

            staging_src = torch.randn(op.cfg.recv_capacity, args.hidden, generator=gen).to(comb_t).to(dev)
            mode_fns = {"eager": (disp, comb_copy)}
            if backend == "hip":
                stage = op.get_combine_input_buffer()
                stage.copy_(staging_src)

                def comb_buffer(i):
                    o = st["r"]
                    op.combine(stage, weights=o[1], routing=o[5])
                mode_fns["eager_buffer"] = (disp, comb_buffer)
            for _ in range(args.warmup):
                disp(0), comb_copy(0)
            for mode, (fa, fb) in mode_fns.items():
                dist.barrier()
                res[f"{backend}_{mode}"] = _timed(*_time_pairs(fa, fb, args.iters, rotate))
            if backend == "hip":
                # graph mode: capture dispatch and combine separately, replay with rotated inputs
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    disp(0), comb_copy(0)
                torch.cuda.current_stream().wait_stream(s)
                gd, gc, gz = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(gd):
                    disp(0)
                with torch.cuda.graph(gc):
                    comb_copy(0)
                with torch.cuda.graph(gz):
                    mode_fns["eager_buffer"][1](0)
                dist.barrier()
                res["hip_graph"] = _timed(*_time_pairs(lambda i: gd.replay(), lambda i: gc.replay(), args.iters, rotate))
                dist.barrier()
                res["hip_graph_buffer"] = _timed(*_time_pairs(lambda i: gd.replay(), lambda i: gz.replay(), args.iters,
                                                              rotate))
                res["phases_us"] = _phase_profile(op, gd, gz)
                res["phases_queued_us"] = _phase_profile(op, gd, gz, queued=True)
                # the method's floor: a one-kernel graph (1-element add) timed the same way
                z = torch.zeros(1, device=dev)
                g0 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g0):
                    z.add_(1)
                f_us, _ = _time_pairs(lambda i: g0.replay(), lambda i: None, args.iters, rotate)
                res["graph_floor_us"] = f_us
                # host overhead of the Python calls (GPU work queued asynchronously)
                dist.barrier()
                # ha: one torch.empty of an output's size (combine makes two, y and y_w), the phase's
                # reference: a host's speed can drift by up to 2x over seconds (docs/performance.md,
                # "Machine"), so it is timed in short blocks between the calls' blocks
                # (milliseconds apart), not inside their iterations (which it would perturb)
                hd, hc, ho, ha = [], [], [], []
                y_out = torch.empty(n, args.hidden, dtype=comb_t, device=dev)
                y_w_out = torch.empty(n, args.k, dtype=torch.float32, device=dev)
                for i in range(400):  # alternate: combine allocating its outputs / into the caller's (out=)
                    t0 = time.perf_counter()
                    r = op.dispatch(sx, sw, None, sidx, return_routing=True)
                    t1 = time.perf_counter()
                    if i % 2:
                        op.combine(staging_src, weights=r[1], routing=r[5], out=y_out, out_weights=y_w_out)
                    else:
                        op.combine(staging_src, weights=r[1], routing=r[5])
                    t2 = time.perf_counter()
                    hd.append((t1 - t0) * 1e6), (ho if i % 2 else hc).append((t2 - t1) * 1e6)
                    if i % 50 == 49:
                        for _ in range(25):
                            t0 = time.perf_counter()
                            torch.empty((n, args.hidden), dtype=comb_t, device=dev)
                            ha.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
                res["host_overhead_us"] = {"dispatch": statistics.median(hd), "combine": statistics.median(hc),
                                           "combine_out": statistics.median(ho),
                                           "torch_empty": statistics.median(ha)}
                op.check()
            dist.barrier()
    if schedule is None and ws > 1:
        res["nccl_a2a"] = _bare_a2a(rank, ws, sets[0][2], n, args.hidden, epr, disp_t, comb_t, dev, args.iters)
    res["recv_rows"] = recv
    res["remote_rows"] = remote
    res["bytes"] = {"dispatch_remote": remote * args.hidden * ebytes_d, "combine_remote": remote * args.hidden * ebytes_c,
                    "dispatch_algo": recv * args.hidden * ebytes_d, "combine_algo": recv * args.hidden * ebytes_c}
    res["link_ceiling_gbps"] = ceiling
    return res


def _job(rank, ws, args, ceiling_reps, out_path):
    ceiling = link_ceiling(ceiling_reps)
    from mori_jit.jit.toolchain import get_toolchain
    get_toolchain()
    sm_rates = sm_link_rates(rank, ws)
    if rank == 0 and sm_rates:
        print("SM peer rates (GB/s): " + ", ".join(f"{k} {v:.0f}" for k, v in sm_rates.items()), flush=True)
    results = []
    if args.sweep:
        for leg in args.legs:
            for n in args.tokens:
                for blocks in args.blocks:
                    for warps in args.warps:
                        # both kernels get the geometry; they are timed separately, so one point
                        # sweeps dispatch and combine independently
                        sched = [(None, blocks, warps, blocks, warps)]
                        r = _bench_point(rank, ws, leg, n, args, ceiling, schedule=sched)
                        r["geometry"] = {"blocks": blocks, "dispatch_warps": warps, "combine_warps": warps}
                        results.append(r)
                        if rank == 0:
                            print(f"sweep {leg} n={n} {blocks}x{warps}: disp {r['hip_graph']['dispatch_us']:.1f} "
                                  f"comb {r['hip_graph']['combine_us']:.1f} buf {r['hip_graph_buffer']['combine_us']:.1f} us",
                                  flush=True)
    else:
        for leg in args.legs:
            for n in args.tokens:
                r = _bench_point(rank, ws, leg, n, args, ceiling)
                results.append(r)
                if rank == 0:
                    print(f"{leg} n={n}: {json.dumps({k: v for k, v in r.items() if isinstance(v, dict)})}", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"args": vars(args), "link_ceiling_gbps": ceiling, "link_ceiling_reps_gbps": ceiling_reps,
                       "sm_link_rates": sm_rates, "results": results}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_ep.json", help="JSON path (Markdown and PNG are written beside it)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024, 4096])
    ap.add_argument("--legs", nargs="+", default=["bf16", "fp8"], choices=sorted(LEGS))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--low-latency", choices=("auto", "on", "off"), default="auto",
                    help="EpDispatchCombineConfig.combine_low_latency (auto: by the op's size, each point's tokens)")
    ap.add_argument("--sweep", action="store_true", help="sweep blocks x warps (hip graph mode only)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64, 132])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--report", metavar="JSON", help="only rebuild the Markdown/PNG from a results file")
    ap.add_argument("--wire", action="store_true",
                    help="the combine's fp8 wire against the bf16 combine and the device copy, world size 1 "
                         "(scripts/bench_ep_wire.py; takes --tokens and --iters)")
    args = ap.parse_args(argv)
    if args.wire:
        from bench_ep_wire import main as wire_main
        return wire_main(["--tokens", *map(str, args.tokens), "--iters", str(args.iters)])
    os.makedirs(os.path.dirname(os.path.abspath(args.report or args.out)), exist_ok=True)
    if args.report:
        print(report(args.report))
        return 0
    ws = torch.cuda.device_count()
    ceiling_reps = link_ceiling_reps_gbps()
    ceiling = link_ceiling(ceiling_reps)
    print(f"link ceiling {ceiling:.1f} GB/s on {ws} GPUs"
          + (f" (reps {min(ceiling_reps):.1f}-{max(ceiling_reps):.1f})" if ceiling_reps else ""), flush=True)
    try:
        run_distributed(_job, ws, args, ceiling_reps, args.out, timeout=540, backend="nccl")
    except (AssertionError, TimeoutError) as e:
        print(f"BENCH FAILED: {e}", file=sys.stderr)
        return 1
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
