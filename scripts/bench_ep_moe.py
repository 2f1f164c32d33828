"""The MoE options of the ``hip`` backend on one GPU (world size 1): what an fp8 wire costs and saves,
and what each option adds to the Python side of a call.

Device time, graph mode (one graph per call, replayed back to back behind a GPU sleep, each replay
between two events; median of ``--iters``), hidden 7168, top-k 8, 256 experts, bf16 tokens in:

* ``bf16``            bf16 dispatch (the baseline);
* ``fp8+scales``      an fp8 dispatch of rows the caller already cast, with their fp32 block scales;
* ``cast, fp8``       the same, after a separate cast (``quant.quantize``: torch ops) in the graph;
* ``in-kernel cast``  ``dispatch_quant_type="fp8_e4m3_block128"``: bf16 in, the dispatch casts on the way;
* ``…, 64 blocks``    the same with the dispatch pinned to 64 blocks (the table's choice to 128
  tokens; ``tuning.py`` ships 132 beyond).

Every variant's received rows are first checked against the golden quantization (DeepGEMM's
``per_token_cast_to_fp8`` written out) on fresh data. Host time: median and 10th percentile of
``--reps`` eager ``op.dispatch`` calls per option (the GPU is synced every 64 calls).

    python3 scripts/bench_ep_moe.py [--tokens 128 512 1024 4096] [--iters 50] [--reps 2000]
"""
from __future__ import annotations

import argparse
import sys

import torch

from mori_jit.ops.ep.quant import quant_spec, quantize
from mori_jit.testing.cuda_graph import graph_us
from profile_ep_host import host_us

HIDDEN, K, EXPERTS = 7168, 8, 256
FP8 = torch.float8_e4m3fn
SPEC = quant_spec("fp8_e4m3_block128")
#: device-time variants: (name, config fields, the caller casts first)
_FP8_SCALES = dict(dispatch_data_type=FP8, combine_data_type=torch.bfloat16, scale_dim=HIDDEN // 128, scale_type_size=4)
_CAST = dict(_FP8_SCALES, dispatch_quant_type="fp8_e4m3_block128")
VARIANTS = (
    ("bf16", dict(), False),
    ("fp8+scales", _FP8_SCALES, False),
    ("fp8+scales, 64 blocks", dict(_FP8_SCALES, dispatch_block_num=64), False),
    ("cast, fp8", _FP8_SCALES, True),
    ("in-kernel cast", _CAST, False),
    ("in-kernel cast, 64 blocks", dict(_CAST, dispatch_block_num=64), False),
)
#: host-time options: (name, config fields, dispatch as a routing replay)
HOST_OPTIONS = (
    ("none", dict(), False),
    ("int64 ids", dict(index_dtype=torch.int64), False),
    ("fp8 + fp32 scales", _FP8_SCALES, False),
    ("expert counts", dict(expert_counts=True), False),
    ("expert-major layout", dict(expert_counts=True, expert_capacity=1024), False),
    ("routing replay (the replay)", dict(routing_replay=True), True),
    ("in-kernel cast", _CAST, False),
)


def _cfg(m, fields):
    from mori_jit.ops.ep import EpDispatchCombineConfig

    return EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=HIDDEN, max_num_inp_token_per_rank=m,
                                   num_experts_per_rank=EXPERTS, num_experts_per_token=K, data_type=torch.bfloat16,
                                   **fields)


def _inputs(n, dev, gen, index_dtype=torch.int32):
    x = torch.randn(n, HIDDEN, generator=gen).bfloat16().to(dev)
    w = torch.rand(n, K, generator=gen).to(dev)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(n)]).to(index_dtype).to(dev)
    return x, w, idx


def _check_received(res, x, quantized):
    """Rows received at world size 1 are the input rows (each token once), cast as the golden cast does."""
    from mori_jit.testing.golden_moe import golden_quantize

    total = int(res.total_recv.item())
    assert total == x.shape[0], f"total_recv {total} != {x.shape[0]}"
    src = res.routing.recv_src[:total].long()
    if quantized:
        q, s = golden_quantize(x, 4)
        assert torch.equal(res.out[:total].view(torch.uint8), q[src].view(torch.uint8)), "fp8 rows differ"
        assert torch.equal(res.out_scales[:total], s[src]), "scales differ"
    else:
        assert torch.equal(res.out[:total], x[src]), "rows differ"


def _device_times(tokens, iters, dev, gen):
    from mori_jit.ops.ep import EpDispatchCombineOp

    rows = {}
    for name, fields, cast_first in VARIANTS:
        with EpDispatchCombineOp(_cfg(max(tokens), fields)) as op:
            for n in tokens:
                x, w, idx = _inputs(n, dev, gen)
                fp8_in = bool(fields.get("scale_dim")) and not fields.get("dispatch_quant_type")
                pre = quantize(x, SPEC, 4) if fp8_in and not cast_first else None

                def call(x=x, w=w, idx=idx, fp8_in=fp8_in, pre=pre):
                    if pre is not None:
                        return op.dispatch(pre[0], w, pre[1], idx, return_result=True)
                    if fp8_in:  # the separate cast, inside the timed graph
                        q, s = quantize(x, SPEC, 4)
                        return op.dispatch(q, w, s, idx, return_result=True)
                    return op.dispatch(x, w, None, idx, return_result=True)
                res = call()
                _check_received(res, x, bool(fields.get("scale_dim")))
                us = graph_us(call, iters)
                rows.setdefault(n, {})[name] = us
                print(f"{name:28s} {n:5d} tokens: {us:8.2f} us (golden ok)", flush=True)
    return rows


def _host_times(n, reps, dev, gen):
    from mori_jit.ops.ep import EpDispatchCombineOp

    out = {}
    for name, fields, replay in HOST_OPTIONS:
        with EpDispatchCombineOp(_cfg(n, fields)) as op:
            x, w, idx = _inputs(n, dev, gen, fields.get("index_dtype", torch.int32))
            s = None
            if fields.get("scale_dim") and not fields.get("dispatch_quant_type"):
                x, s = quantize(x, SPEC, 4)
            first = op.dispatch(x, w, s, idx, return_result=True)
            if replay:
                def call():
                    op.dispatch(x, w, s, None, routing=first.routing)
            else:
                def call():
                    op.dispatch(x, w, s, idx)
            out[name] = host_us(call, reps)
            torch.cuda.synchronize()
            op.check()
            print(f"host {name:28s} median {out[name][0]:6.2f} us  p10 {out[name][1]:6.2f}", flush=True)
    return out


def _job(rank, ws, tokens, iters, reps):
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(2024)
    rows = _device_times(tokens, iters, dev, gen)
    names = [v[0] for v in VARIANTS]
    print("\n| tokens | " + " | ".join(f"{n} µs" for n in names) + " | in-kernel cast vs cast, fp8 |")
    print("|---" * (len(names) + 2) + "|")
    for n, r in rows.items():
        print(f"| {n} | " + " | ".join(f"{r[v]:.1f}" for v in names)
              + f" | {r['cast, fp8'] / r['in-kernel cast']:.2f}× |")
    host = _host_times(128, reps, dev, gen)
    print("\n| option (dispatch, 128 tokens) | host µs median | p10 |\n|---|---|---|")
    for name, (med, p10) in host.items():
        print(f"| {name} | {med:.1f} | {p10:.1f} |")


def main(argv=None) -> int:
    """Run the benchmark on one GPU; print the results as Markdown tables."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024, 4096])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ep_moe: needs a GPU", file=sys.stderr)
        return 2
    from mori_jit.testing.distributed import run_distributed
    run_distributed(_job, 1, a.tokens, a.iters, a.reps, timeout=500, backend="nccl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
