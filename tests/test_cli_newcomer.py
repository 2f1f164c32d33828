"""What a newcomer meets first in the ``mori-jit`` command: ``--version``, a description on every
verb's ``--help``, quiet exits into a closed pipe, archs and enum values checked with the allowed
ones named."""
from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pytest

from conftest import REPO
from mori_jit.cli import main, precompile_targets
from mori_jit.jit.registry import all_specs
from mori_jit.jit.toolchain import make_toolchain

VERBS = ("info", "render", "key", "describe", "compile", "precompile", "cache")


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_version(capsys):
    rc, out, err = run(capsys, "--version")
    assert (rc, err) == (0, "") and out == f"mori-jit {importlib.metadata.version('mori-jit')}\n"


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_help_has_a_description(capsys, verb):
    rc, out, _ = run(capsys, verb, "--help")
    assert rc == 0
    paragraphs = out.split("\n\n")
    assert paragraphs[0].startswith(f"usage: mori-jit {verb}")
    description = " ".join(paragraphs[1].split())
    assert not description.endswith(":") and re.fullmatch(r"[a-z].{20,}\.", description), out


def test_gitignore_lists_the_quick_starts_venv():
    # the README's quick start creates .venv/ inside the checkout
    assert ".venv/" in (REPO / ".gitignore").read_text().split()
    assert "python3 -m venv .venv" in (REPO / "README.md").read_text()


# -- a reader that leaves ---------------------------------------------------------------------------

def test_output_into_a_closed_pipe_exits_quietly(fake_cc):
    # (the read end is closed before the command writes, as `mori-jit info | head -1` leaves it once
    # head has its line: deterministic, where a real head races the writer)
    r, w = os.pipe()
    os.close(r)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run([sys.executable, "-m", "mori_jit", "info", "--arch", "sm_90a"], stdout=w,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (128 + signal.SIGPIPE, "")


# -- --arch: one the toolchain knows ----------------------------------------------------------------

@pytest.mark.parametrize("verb", ["precompile", "info", "render example_axpy", "compile example_axpy"])
@pytest.mark.parametrize("arch", ["", "sm_91"])
def test_an_empty_or_unknown_arch_is_refused_naming_the_known_ones(fake_cc, capsys, monkeypatch, verb, arch):
    monkeypatch.setenv("MORI_JIT_ARCH", "gfx90a")  # (an empty --arch never falls back to it)
    rc, out, err = run(capsys, *verb.split(), "--arch", arch)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert f"argument --arch: arch {arch!r} is not supported" in err and "sm_90a, " in err and "gfx942, " in err
    assert fake_cc.compiles() == []


# -- precompile says what it builds, and why ---------------------------------------------------------

def _plan_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("  ")]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_precompile_without_arguments_says_what_it_builds_and_why(no_compilers, fake_cc, capsys):
    rc, out, _ = run(capsys, "precompile")
    assert rc == 0
    tc = make_toolchain("sm_90a")
    per_spec = Counter(s.name for s, _ in precompile_targets(tc, {}))
    arch, kernels, *skipped = _plan_lines(out)
    assert arch == f"  arch sm_90a: from the nvcc at {fake_cc.nvcc}, as no GPU is visible (--arch chooses another)"
    assert kernels.startswith("  kernels: the configs each shipped spec names for precompiling, so that their first "
                              "use loads them from the cache instead of compiling (")
    assert ", ".join(f"{name} {k}" for name, k in sorted(per_spec.items())) in kernels
    idle = sorted(s.name for s in all_specs() if s.name not in per_spec)
    assert skipped == [f"  skipped {', '.join(idle)}: they have no default config: an op builds them for its own "
                       f"(--ep KEY=VALUE ...)"]


def test_precompile_without_nvshmem_reports_the_kernels_it_skips(fake_cc, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MORI_JIT_NVSHMEM_HOME", str(tmp_path / "no-nvshmem"))
    rc, out, _ = run(capsys, "precompile", "--arch", "sm_90a")
    assert rc == 0
    linked = sorted(s.name for s in all_specs() if s.device_libraries)
    built = precompile_targets(make_toolchain("sm_90a"), {})
    assert linked and not {s.name for s, _ in built} & set(linked)
    assert len([ln for ln in out.splitlines() if ln.startswith("[")]) == len(built)
    (line,) = [ln for ln in _plan_lines(out) if ln.startswith(f"  skipped {', '.join(linked)}: ")]
    assert "they link nvshmem, which is missing: nvshmem: MORI_JIT_NVSHMEM_HOME points at " in line
    assert "pip install nvidia-nvshmem-cu13" in line
    rc, out, _ = run(capsys, "precompile", "--arch", "gfx90a")  # (no device linking on AMD: said so)
    assert f"  skipped {', '.join(linked)}: they link nvshmem, and device linking is built for NVIDIA arches " \
           f"only" in out.splitlines()
