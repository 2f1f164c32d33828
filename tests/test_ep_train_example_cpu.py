"""The worked training example (``scripts/train_moe_ep.py``, ``mori_jit.examples.moe_transformer``)
and the training benchmark (``scripts/bench_ep_train.py``, a smoke run),
kept short: 20 steps on 2 ranks (torch backend, gloo); the EP loss curve equals the dense one within the
script's tolerance, and the loss falls. (The script's own run: 300 steps.)"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from mori_jit.examples.moe_transformer import TinyConfig, max_gap, train_dense

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_moe_ep.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_moe_ep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ep_training_follows_the_dense_loss_curve(capsys):
    assert _script().main(["--ws", "2", "--steps", "20", "--every", "5"]) == 0
    report = capsys.readouterr().out
    assert "largest gap" in report and "20 steps, 2 ranks" in report


def test_the_comparison_can_fail():
    """Two different models (seeds) are told apart: the gap measure is not blind."""
    a, b = train_dense(TinyConfig(seed=0), 3), train_dense(TinyConfig(seed=1), 3)
    assert max_gap(a, b) > 1e-2 and a[-1] < a[0] + 0.5


def test_training_benchmark_runs_on_the_reference_backend(capsys, monkeypatch):
    """scripts/bench_ep_train.py: a smoke run on the CPU (torch backend); refuses hip without a GPU."""
    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # (its ranks import the script's job by name)
    mod = importlib.import_module("bench_ep_train")
    if not torch.cuda.is_available():
        assert mod.main([]) == 2 and "bench_ep_train: needs a GPU" in capsys.readouterr().err
    assert mod.main(["--backend", "torch", "--tokens", "8", "--hidden", "128", "--k", "2", "--experts", "2",
                     "--iters", "1", "--warmup", "1"]) == 0


def test_the_example_on_hip_says_why_it_cannot_run_here(capsys, monkeypatch):
    """--backend hip on a machine that cannot host the ranks: exit 2 and the reason, nothing started."""
    import mori_jit.testing.gpu_world as gpu_world

    monkeypatch.setattr(gpu_world, "gpu_count", lambda: 0)
    assert _script().main(["--backend", "hip", "--ws", "2", "--steps", "3"]) == 2
    assert "--backend hip --ws 2: needs a CUDA/ROCm GPU" in capsys.readouterr().err
