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

import pytest
import torch

from ep_overlap_checks import split_job
from ep_overlap_gpu_jobs import graph_job, send_alone_job
from ep_overlap_jobs import micro_batches_job, misuse_job, router_dtype_job
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


def _graph_job(rank, ws):
    # low latency (the default at these sizes), then range flags
    graph_job(rank, ws, [dict(expert_counts=True, expert_capacity=-1, combine_low_latency=low) for low in (None, False)])


@_WS
def test_graph_capture_of_each_half_and_of_a_whole_step(ws):
    run_ep_job(_graph_job, ws)


def _send_alone_job(rank, ws):
    send_alone_job(rank, ws, [dict(combine_low_latency=low) for low in (None, False)])


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
            assert t["target_us"] == max(t["gemm_us"], t["leg_us"])
            # (one rank: the combine has no send kernel, docs/design.md §8)
            assert t["send_blocks"] >= 1 if leg == "dispatch" else t["send_blocks"] == 0
