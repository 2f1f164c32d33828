"""CPU test of scripts/bench_ep.py's report (scripts/bench_ep_report.py): the derived columns are
computed from the raw times."""
from __future__ import annotations

import importlib.util
import json
import sys

from conftest import REPO
from mori_jit.testing.distributed import run_distributed


def _bench_module(name="bench_ep"):
    """``scripts/<name>.py``, loaded as the script runs (its sibling modules importable)."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_derives_bandwidth_link_share_and_ratios(tmp_path):
    hidden, rows, remote = 7168, 1000, 400
    point = {"leg": "bf16", "tokens": 512, "ws": 2, "recv_rows": rows, "remote_rows": remote,
             "bytes": {"dispatch_remote": remote * hidden * 2, "combine_remote": remote * hidden * 2,
                       "dispatch_algo": rows * hidden * 2, "combine_algo": rows * hidden * 2},
             "hip_graph": {"dispatch_us": 20.0, "combine_us": 25.0, "per_rank_us": [[20.0, 25.0], [21.5, 24.0]]},
             "torch_eager": {"dispatch_us": 200.0, "combine_us": 100.0},
             "nccl_a2a": {"dispatch_us": 30.0, "combine_us": 50.0},
             "graph_floor_us": 4.5, "host_overhead_us": {"dispatch": 9.0, "combine": 14.0, "combine_out": 8.5,
                                                           "torch_empty": 3.0}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"link_ceiling_gbps": 400.0, "link_ceiling_reps_gbps": [399.2, 400.0, 401.4],
                                "sm_link_rates": {"sm_pull_both_gbps": 370.0},
                                "results": [point]}))
    md = _bench_module("bench_ep_report").report(str(path))
    row = next(ln for ln in md.splitlines() if "| hip_graph |" in ln)
    cells = [c.strip() for c in row.strip("|").split("|")]
    algo = rows * hidden * 2 / 20.0 / 1e3            # GB/s
    link = 100 * remote * hidden * 2 / 20.0 / 1e3 / 400.0
    assert cells[5] == f"{algo:.0f}" and cells[6] == f"{link:.0f}"
    assert cells[8:12] == ["10.00", "4.00", "1.50", "2.00"]  # torch / hip and a2a / hip
    assert "pull_both 370" in md and "floor: 1-kernel graph | 4.5" in md
    assert "**400 GB/s** (median of 3 event-timed copies, 399-401)" in md
    assert "host overhead | 9.0 | 14.0 | (out=: 8.5)" in md
    assert "| bf16 | 512 | hip_graph dispatch + combine | 45.0 |" in md  # the legs trade time; their sum holds
    assert "hip_graph, every rank's medians (dispatch / combine) | rank 0 20.0 / 25.0; rank 1 21.5 / 24.0 |" in md
    assert (tmp_path / "r.md").read_text().strip() == md.strip()


def test_gpu_scripts_import_and_refuse_cleanly_without_enough_gpus(capsys):
    """The device-only scripts load (imports, argument parsing) on a CPU machine and exit 2 with a
    one-line reason instead of a traceback."""
    import pytest
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs: the scripts would run for real")
    for path, args in (("profile_ep_host", ["--tokens", "8", "--reps", "10"]),
                       ("probes/probe_link_rates", ["--mib", "1"])):
        name = path.rsplit("/", 1)[-1]
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{path}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        if name == "profile_ep_host" and torch.cuda.is_available():
            continue  # one GPU: this one would run
        assert mod.main(args) == 2
        assert f"{name}: needs" in capsys.readouterr().err


def test_phase_times_are_medians_and_skip_stamps_never_written():
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EP_STAMP_WORDS, Stamp

    bench = _bench_module()
    rows = []
    for k in range(3):  # ns; the combine's senders never ran (their stamp stays 0)
        r = [0] * EP_STAMP_WORDS
        r[Stamp.kStDispStart], r[Stamp.kStDispEnd] = 1_000_000, 1_000_000 + 5_000 + 1_000 * k
        r[Stamp.kStCombStart], r[Stamp.kStCombEnd] = 2_000_000, 2_000_000 + 7_500
        rows.append(r)
    got = bench.phase_times(rows)
    assert got["disp: end"] == 6.0 and got["comb: last block's done counts sent"] == 7.5
    assert got["gap: disp end -> comb start"] == 2_000_000 / 1e3 - 1_000_000 / 1e3 - 6.0
    assert "comb: last sender done" not in got and "disp: block 0 claimed its slots" not in got


def _timed_job(rank, ws):
    got = _bench_module()._timed(10.0 + rank, 20.0 - rank)
    assert got["dispatch_us"] == 10.0 + rank and got["combine_us"] == 20.0 - rank
    assert got["per_rank_us"] == [[10.0 + r, 20.0 - r] for r in range(ws)], got


def test_timed_gathers_every_ranks_medians():
    run_distributed(_timed_job, 2, timeout=60)
