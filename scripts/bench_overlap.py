"""The split legs against the whole ones, with a MoE layer's grouped GEMM between a send and its
receive (issue 45): does the step cost max(GEMM, leg) or their sum? The ``hip`` backend, graph mode.

Per world size (one process per rank; ranks share a GPU under CUDA MPS where there are fewer GPUs,
``mori_jit/testing/gpu_world.py``: such figures describe the protocol, not a link) and token count,
median device µs of back-to-back graph replays behind a GPU sleep, each replay between two events
(rank 0's; every rank's beside it):

* ``gemm``            the grouped GEMM alone: ``bmm([E, m, H] x [E, H, N])``, bf16, m = tokens * k /
                      (the rank's experts) rows per expert (the pairs a rank receives on average), E
                      ``--gemm-experts`` of them (default: the rank's experts, at most 32; every
                      expert of a layer at world size 1 is 15 GB of weights at N = 4096);
* ``leg``             the whole leg (dispatch, or combine of the received rows);
* ``leg_then_gemm``   the whole leg, then the GEMM;
* ``split_gemm``      the leg's send, the GEMM, the leg's receive;
* ``send``/``recv``   each half alone (a send kernel's duration is how long it holds its SMs;
                      ``send_blocks`` how many it holds);
* ``*_eager``         ``leg_then_gemm`` and ``split_gemm`` launched from the host, where the send
                      runs on the op's side stream beside the GEMM (in a graph it runs on the
                      capturing stream: ``SendStream`` in ``backends/hip/common/host.py``).

``target_us`` = max(gemm, leg) and ``within_10pct``: the issue's bar for ``split_gemm``. Every point is
first gated by the golden check of the split legs on fresh data (exit 1 on failure).

    python3 scripts/bench_overlap.py [--world-sizes 1 2 4] [--tokens 128 512] [--out bench_overlap.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist

from mori_jit.testing.cuda_graph import QUEUE_AHEAD_CYCLES, capture



def _replays_us(graphs, iters: int) -> list[float]:
    """Median µs of each graph of ``graphs``, replayed in turn ``iters`` times, each between events."""
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)] for _ in range(iters)]
    torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
    for i in range(iters):
        ev[i][0].record()
        for j, g in enumerate(graphs):
            g.replay()
            ev[i][j + 1].record()
    torch.cuda.synchronize()
    return [statistics.median(e[j].elapsed_time(e[j + 1]) * 1e3 for e in ev) for j in range(len(graphs))]


def _eager_us(step, iters: int) -> float:
    """Median µs of ``step`` run eagerly (launched from the host, the send on the op's side stream),
    each run between two events on the current stream."""
    step()  # (warm: the side stream and the allocations exist)
    torch.cuda.synchronize()
    dist.barrier()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
    for a, b in ev:
        a.record()
        step()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def _graph(step):
    torch.cuda.synchronize()
    dist.barrier()
    return capture(step)[0]


def _graph_halves(send, recv):
    """A graph of ``send`` and one of ``recv``, each warmed up once outside capture (in that order:
    the op refuses a second send before the receive)."""
    torch.cuda.synchronize()
    dist.barrier()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        send(), recv()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for half in (send, recv):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            half()
        graphs.append(g)
    return graphs


def _point(op, rank, ws, n, args, gen) -> dict:
    from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, DISPATCH, EpPhase
    from mori_jit.testing.golden import golden_check, make_inputs

    cfg, dev = op.cfg, op.device
    x, w, idx = make_inputs(rank, n, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts, torch.bfloat16,
                            dev, gen)
    # the gate: the split legs on these inputs, against the golden check
    res = op.dispatch_send(x, w, None, idx, return_result=True)
    op.dispatch_recv()
    y, y_w = op.combine_send(res.out, weights=res.out_weights, routing=res.routing)
    op.combine_recv()
    golden_check(op.group, rank, ws, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank, x, w, idx, res.out,
                 res.out_weights, res.out_indices, res.total_recv, res.routing.recv_src, y, y_w)
    m = max(1, -(-n * cfg.num_experts_per_token // cfg.num_experts_per_rank))
    E = args.gemm_experts or min(cfg.num_experts_per_rank, 32)
    a = torch.randn(E, m, cfg.hidden_dim, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E, cfg.hidden_dim, args.inter, device=dev, dtype=torch.bfloat16) * 0.02
    c = torch.empty(E, m, args.inter, device=dev, dtype=torch.bfloat16)

    def gemm():
        torch.bmm(a, b, out=c)

    cur = {}  # the latest dispatch's result: the combines below combine its rows

    def combine(send: bool):
        r = cur["res"]
        call = op.combine_send if send else op.combine
        return call(r.out, weights=r.out_weights, routing=r.routing, out=y, out_weights=y_w)

    legs = {"dispatch": (lambda: op.dispatch(x, w, None, idx), lambda: op.dispatch_send(x, w, None, idx),
                         op.dispatch_recv),
            "combine": (lambda: combine(False), lambda: combine(True), op.combine_recv)}
    row = {"world_size": ws, "tokens": n, "gemm_shape": [E, m, cfg.hidden_dim, args.inter]}
    g_gemm = _graph(gemm)
    for leg, (whole, send, recv) in legs.items():
        cur["res"] = op.dispatch(x, w, None, idx, return_result=True)
        g_leg = _graph(whole)
        g_then = _graph(lambda: (whole(), gemm()))
        g_split = _graph(lambda: (send(), gemm(), recv()))
        g_send, g_recv = _graph_halves(send, recv)
        times = {}
        for name, g in (("gemm", g_gemm), ("leg", g_leg), ("leg_then_gemm", g_then), ("split_gemm", g_split)):
            dist.barrier()
            times[name] = _replays_us([g], args.iters)[0]
        dist.barrier()
        times["send"], times["recv"] = _replays_us([g_send, g_recv], args.iters)
        times["leg_then_gemm_eager"] = _eager_us(lambda: (whole(), gemm()), args.iters)
        times["split_gemm_eager"] = _eager_us(lambda: (send(), gemm(), recv()), args.iters)
        every = [None] * ws
        dist.all_gather_object(every, times)
        target = max(times["gemm"], times["leg"])
        kind = DISPATCH if leg == "dispatch" else COMBINE
        var = getattr(op, "_variants", None)  # (the hip backend's variant walk: each half's grid)
        grids = {ph: _blocks(var, kind, ph, op._pick(n)) for ph in (EpPhase.Send, EpPhase.Recv)}
        row[leg] = {**{f"{k}_us": v for k, v in times.items()}, "target_us": target,
                    "within_10pct": times["split_gemm"] <= 1.1 * target,
                    "within_10pct_eager": times["split_gemm_eager"] <= 1.1 * target,
                    # (no send kernel: 0 blocks; the dispatch's receive is one block)
                    "send_blocks": grids[EpPhase.Send],
                    "recv_blocks": 1 if kind == DISPATCH and var is not None else grids[EpPhase.Recv],
                    "per_rank": every}
        if rank == 0:
            t = row[leg]
            print(f"ws {ws} tokens {n:5d} {leg:8s}: gemm {t['gemm_us']:7.1f}  {leg} {t['leg_us']:7.1f}  "
                  f"{leg}+gemm {t['leg_then_gemm_us']:7.1f}  send+gemm+recv {t['split_gemm_us']:7.1f}  "
                  f"(target {target:7.1f}: {'ok' if t['within_10pct'] else 'over'})  send {t['send_us']:6.1f} on "
                  f"{t['send_blocks']} blocks, recv {t['recv_us']:6.1f}; eager: {leg}+gemm "
                  f"{t['leg_then_gemm_eager_us']:7.1f}  send+gemm+recv {t['split_gemm_eager_us']:7.1f} "
                  f"({'ok' if t['within_10pct_eager'] else 'over'})", flush=True)
    op.check()
    return row


def _blocks(var, kind, phase, bucket):
    """The grid in blocks of bucket ``bucket``'s ``phase`` half of leg ``kind``: None without the hip
    backend's variants (``var``), 0 where the half has no kernel (the combine's send at one rank)."""
    if var is None:
        return None
    half = var.half(kind, phase)
    return half[bucket].blockNum if half else 0


def _job(rank, ws, args, out_path):
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

    gen = torch.Generator().manual_seed(45 + rank)
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=args.hidden,
                                  max_num_inp_token_per_rank=max(args.tokens),
                                  num_experts_per_rank=args.experts // ws, num_experts_per_token=args.k,
                                  split_send_recv=True, kernel_backend="hip")
    rows = []
    with EpDispatchCombineOp(cfg) as op:
        for n in args.tokens:
            rows.append(_point(op, rank, ws, n, args, gen))
            torch.cuda.synchronize()
            dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def main(argv=None) -> int:
    """Run every world size; write the JSON (``--out``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256, help="experts over all ranks")
    ap.add_argument("--inter", type=int, default=4096, help="the GEMM's N (a gate+up projection: 2 x 2048)")
    ap.add_argument("--gemm-experts", type=int, default=0, help="the GEMM's E (0: the rank's experts, at most 32)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="bench_overlap.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overlap: needs a GPU", file=sys.stderr)
        return 2
    from mori_jit.testing.gpu_world import GpuWorldUnavailable, run_gpu_job

    results, skipped = [], {}
    for ws in args.world_sizes:
        part = f"{args.out}.ws{ws}.part"
        try:
            run_gpu_job(_job, ws, args, part, timeout=1200)
        except GpuWorldUnavailable as e:  # (ranks sharing a GPU without MPS)
            skipped[ws] = str(e)
            print(f"world size {ws} skipped: {e}", file=sys.stderr)
            continue
        with open(part) as f:
            results.extend(json.load(f))
    meta = {k: getattr(args, k) for k in ("hidden", "k", "experts", "inter", "gemm_experts", "iters", "tokens")}
    meta["device"] = torch.cuda.get_device_name(0)
    meta["gpus"] = torch.cuda.device_count()
    with open(args.out, "w") as f:
        json.dump({"config": meta, "skipped": skipped, "results": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
