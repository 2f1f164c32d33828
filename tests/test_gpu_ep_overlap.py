"""GPU tests of the split legs on the hip kernels (on a GPU machine: ``pytest -m gpu
tests/test_gpu_ep_overlap.py``), at world sizes 1, 2, 4 and 8 (``MORI_EP_TEST_WORLD_SIZES``; ranks
share a GPU under CUDA MPS where there are fewer GPUs, ``mori_jit/testing/gpu_world.py``).

* the split against the same op's unsplit legs and the golden checks, every config of
  ``ep_overlap_checks.CONFIGS`` (dtype pairs, both combine protocols, every MoE option, replay);
* every misuse refused before anything is launched, and two micro-batches in flight (one op each);
* graph capture of each half in its own graph, and of a whole step, replayed with other work
  between a send and its receive;
* a send kernel ends without any peer's rows (a rank that sends alone finishes within the wait
  bound, with no error), and a receive whose peer never sent gives up and reports it.
"""
from __future__ import annotations

import os
import time
from unittest import mock

import pytest
import torch

from ep_gpu_checks import identity_expert
from ep_overlap_checks import _golden, config, inputs, poison_arena, split_job
from ep_overlap_jobs import micro_batches_job, misuse_job, router_dtype_job
from mori_jit.testing.cuda_graph import capture
from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

_WS = pytest.mark.parametrize("ws", WORLD_SIZES)


@_WS
def test_split_legs_match_the_unsplit_legs_and_the_golden_checks(ws):
    run_ep_job(split_job, ws, "hip", timeout=900)


@_WS
def test_misuse_is_refused_before_anything_is_launched(ws):
    run_ep_job(misuse_job, ws, "hip")


@_WS
def test_a_split_dispatch_takes_a_bf16_or_fp16_router(ws):
    run_ep_job(router_dtype_job, ws, "hip")


@_WS
@pytest.mark.parametrize("schedule", ["interleaved", "dbo"])
def test_two_micro_batches_in_flight_one_op_each(ws, schedule):
    run_ep_job(micro_batches_job, ws, "hip", schedule)


def _other_work(x: torch.Tensor) -> None:
    """Stream work between a send and its receive (a micro-batch's GEMM)."""
    (x.float() @ x.float().t()).sum()


def _graph_job(rank, ws):
    """Each half in its own graph (replayed with other work between send and receive), then a whole
    step (the four halves) in one graph: every replay on fresh inputs, outputs poisoned, golden."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(61 + rank)
    for low in (None, False):  # low latency (the default at these sizes), then range flags
        fields = dict(expert_counts=True, expert_capacity=-1, combine_low_latency=low)
        with EpDispatchCombineOp(config(rank, ws, "hip", fields)) as op:
            cfg = op.cfg
            sx, sw, sidx = inputs(op, rank, ws, gen)
            y = torch.empty(sx.shape, dtype=cfg.combine_dtype, device=sx.device)
            y_w = torch.empty(sw.shape, dtype=torch.float32, device=sx.device)
            state = {}

            def d_send():
                state["res"] = op.dispatch_send(sx, sw, None, sidx, return_result=True)
                return state["res"]

            def c_send():
                res = state["res"]
                state["inp"] = identity_expert(res.out, cfg.combine_dtype)
                return op.combine_send(state["inp"], weights=res.out_weights, routing=res.routing, out=y,
                                       out_weights=y_w)

            side = torch.cuda.Stream()  # the warm-up: every half once, outside capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                d_send(), op.dispatch_recv(), c_send(), op.combine_recv()
            torch.cuda.current_stream().wait_stream(side)
            graphs = []
            for half in (d_send, op.dispatch_recv, c_send, op.combine_recv):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    half()
                graphs.append(g)

            def step():
                d_send(), op.dispatch_recv(), c_send(), op.combine_recv()
                return state["res"]

            whole, res = capture(step)
            for i in range(12):
                x, w, idx = make_inputs(rank, sx.shape[0], sx.shape[1], sw.shape[1], cfg.num_experts, sx.dtype,
                                        sx.device, gen)
                poison_arena(op)  # (after a barrier: no peer still checks the last replay)
                sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
                y.fill_(float("nan")), y_w.fill_(float("nan"))
                if i % 2:
                    whole.replay()
                else:
                    for g, work in zip(graphs, (sx, None, state["inp"], None)):
                        g.replay()
                        if work is not None:
                            _other_work(work)
                _golden(op, rank, ws, sx, sw, sidx, None, res, y, y_w)
            op.check()


@_WS
def test_graph_capture_of_each_half_and_of_a_whole_step(ws):
    run_ep_job(_graph_job, ws)


def _send_alone_job(rank, ws):
    """Rank 0 sends while its peers send nothing: its send kernels end at once (well within the
    wait bound, no error); its receive waits for the peers, gives up and reports them; reset."""
    from mori_jit.ops.ep import EpDeviceError, EpDispatchCombineOp

    gen = torch.Generator().manual_seed(83 + rank)
    with mock.patch.dict(os.environ, {"MORI_EP_TIMEOUT_S": "3"}):  # (read when the op is built)
        ops = [EpDispatchCombineOp(config(rank, ws, "hip", dict(combine_low_latency=low))) for low in (None, False)]
    for op in ops:
        x, w, idx = inputs(op, rank, ws, gen)
        res = op.dispatch(x, w, None, idx, return_result=True)  # (every rank: a dispatch to combine)
        torch.cuda.synchronize()
        torch.distributed.barrier()
        for leg in ("dispatch", "combine"):
            if rank == 0:
                t0 = time.monotonic()
                if leg == "dispatch":
                    op.dispatch_send(x, w, None, idx)
                else:
                    op.combine_send(identity_expert(res.out, op.cfg.combine_dtype), weights=res.out_weights,
                                    routing=res.routing)
                torch.cuda.synchronize()
                assert time.monotonic() - t0 < 1.5, f"the {leg} send kernel waited for the peers"
                op.check()  # no wait gave up
                (op.dispatch_recv if leg == "dispatch" else op.combine_recv)()
                torch.cuda.synchronize()
                with pytest.raises(EpDeviceError, match=rf"rank 0: {leg}[ :].* from rank [1-9][0-9]* timed out"):
                    op.check()
            op.reset()  # collective
            res = op.dispatch(x, w, None, idx, return_result=True)
            y, y_w = op.combine(identity_expert(res.out, op.cfg.combine_dtype), weights=res.out_weights,
                                routing=res.routing)
            _golden(op, rank, ws, x, w, idx, None, res, y, y_w)
            torch.cuda.synchronize()
            torch.distributed.barrier()
        op.close()


@_WS
def test_a_send_kernel_ends_without_peer_rows_and_a_receive_reports_them(ws):
    if ws < 2:
        pytest.skip("needs two ranks (one sends alone)")
    run_ep_job(_send_alone_job, ws, timeout=300)


def test_the_overlap_benchmark_runs_and_writes_its_json(tmp_path):
    """``scripts/bench_overlap.py`` at world size 1 on small shapes: every point gated by the golden
    check, every figure written."""
    import json
    import sys
    from pathlib import Path

    # (on sys.path while it runs: its spawned ranks take the parent's path to import it)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import bench_overlap

        out = tmp_path / "bench_overlap.json"
        rc = bench_overlap.main(["--world-sizes", "1", "--tokens", "16", "64", "--hidden", "1024", "--experts", "8",
                                 "--inter", "512", "--iters", "5", "--out", str(out)])
    finally:
        sys.path.pop(0)
    assert rc == 0
    got = json.loads(out.read_text())
    assert [r["tokens"] for r in got["results"]] == [16, 64] and not got["skipped"]
    for r in got["results"]:
        for leg in ("dispatch", "combine"):
            t = r[leg]
            assert all(t[f"{k}_us"] > 0 for k in ("gemm", "leg", "leg_then_gemm", "split_gemm", "send", "recv",
                                                  "leg_then_gemm_eager", "split_gemm_eager"))
            assert t["target_us"] == max(t["gemm_us"], t["leg_us"]) and t["send_blocks"] >= 1
