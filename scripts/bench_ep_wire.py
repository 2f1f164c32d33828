"""The combine's fp8 wire (``quant_type``) against the bf16 combine on one GPU (world size 1), beside
the device's own copy of the same bytes, in one run (``scripts/bench_ep.py --wire`` runs it).

At one rank the combine reads each token's expert row (bf16) and writes its sum (bf16): no row
crosses a link, so the fp8 wire cannot save bytes here; what this measures is what the cast and the
decode cost on the summing path (every row is cast, the home rank's own too). The saving is on the
peers' rows: run ``bench_ep.py`` at several ranks for that.

Device time, graph mode (one graph per call, replayed back to back behind a GPU sleep, each replay
between two events; median of ``--iters``), hidden 7168, top-k 8, 256 experts. Each variant's
output is first checked bit for bit against the torch reference of the wire (``quant.py``).

    python3 scripts/bench_ep_wire.py [--tokens 128 512 1024 2048 4096 8192] [--iters 50]
"""
from __future__ import annotations

import argparse
import sys

import torch

from mori_jit.ops.ep.quant import combine_wire_decode, combine_wire_encode
from mori_jit.testing.cuda_graph import graph_us

HIDDEN, K, EXPERTS = 7168, 8, 256
#: (name, quant_type, combine_scale_type_size)
WIRES = (("bf16", "none", 4), ("fp8 direct", "fp8_direct_cast", 4), ("fp8 block f32", "fp8_blockwise", 4),
         ("fp8 block ue8m0", "fp8_blockwise", 1))


def _job(rank, ws, tokens, iters):
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(7)
    rows = {}
    for n in tokens:
        x = torch.randn(n, HIDDEN, generator=gen).bfloat16().to(dev)
        idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(n)]).int().to(dev)
        src, dst = torch.empty_like(x), torch.empty_like(x)
        rows.setdefault(n, {})["copy"] = graph_us(lambda: dst.copy_(src), iters)
        for name, quant, sb in WIRES:
            cfg = EpDispatchCombineConfig(rank=0, world_size=1, hidden_dim=HIDDEN, max_num_inp_token_per_rank=n,
                                          num_experts_per_rank=EXPERTS, num_experts_per_token=K, quant_type=quant,
                                          combine_scale_type_size=sb)
            with EpDispatchCombineOp(cfg) as op:
                res = op.dispatch(x, None, None, idx, return_result=True)
                inp = op.get_combine_input_buffer()
                inp.copy_(res.out)
                y, _ = op.combine(inp, routing=res.routing)
                want = (torch.zeros(n, HIDDEN, device=dev)
                        + combine_wire_decode(combine_wire_encode(x, quant, sb), quant, sb, x.dtype, HIDDEN))
                assert torch.equal(y.view(torch.int16), want.bfloat16().view(torch.int16)), f"{name}: golden"
                rows[n][name] = graph_us(lambda: op.combine(inp, routing=res.routing), iters)
                print(f"{name:16s} {n:5d} tokens: {rows[n][name]:8.2f} us (golden ok)", flush=True)
    names = ["copy"] + [w[0] for w in WIRES]
    print("\n| tokens | " + " | ".join(f"{v} µs" for v in names) + " | fp8 direct vs bf16 |")
    print("|---" * (len(names) + 2) + "|")
    for n, r in rows.items():
        print(f"| {n} | " + " | ".join(f"{r[v]:.1f}" for v in names) + f" | {r['bf16'] / r['fp8 direct']:.2f}× |")


def main(argv=None) -> int:
    """Run the benchmark on one GPU; print the results as a Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ep_wire: needs a GPU", file=sys.stderr)
        return 2
    from mori_jit.testing.distributed import run_distributed
    run_distributed(_job, 1, a.tokens, a.iters, timeout=500, backend="nccl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
