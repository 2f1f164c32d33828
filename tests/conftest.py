"""Shared fixtures of the CPU tests.

* every test that is not marked ``gpu`` gets its own ``MORI_JIT_CACHE_DIR`` (under ``tmp_path``),
  a freshly reset process toolchain and compiler-signature memo, and none of mori-jit's ``MORI_*``
  settings (:func:`mori_jit.jit.knobs.all_settings`) inherited from the shell but those that say
  where the compilers are (``MORI_JIT_HIPCC``, ``MORI_JIT_NVCC``);
* ``fake_cc``: the fake compiler (``tests/fake_compiler.py``) as both nvcc and hipcc;
* ``no_compilers``: a machine with neither hipcc nor nvcc installed (the fake stays usable through
  ``MORI_JIT_HIPCC``/``MORI_JIT_NVCC``);
* ``src_copy``: a private copy of ``kernels/`` and ``templates/`` used through ``MORI_JIT_SOURCE_ROOT``.

The ``gpu`` marker is registered in ``pyproject.toml``; gpu tests skip themselves without a GPU.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from mori_jit.jit import knobs, toolchain as _toolchain

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FAKE_NVCC = TESTS / "bin" / "fake-nvcc"
FAKE_HIPCC = TESTS / "bin" / "fake-hipcc"

_KEEP = (knobs.CompilerKnobs.hipcc, knobs.CompilerKnobs.nvcc)  # where the compilers are
_SCRUB = [s for s in knobs.all_settings() if s.var.startswith("MORI_") and s not in _KEEP]


def _reset_toolchain() -> None:
    _toolchain._reset_for_tests()
    _toolchain._signature.cache_clear()


@pytest.fixture(autouse=True)
def _isolated_jit(request, monkeypatch, tmp_path):
    if request.node.get_closest_marker("gpu") is not None:
        yield  # gpu tests run under the caller's environment (and shared cache)
        return
    for name in [k for k in os.environ if k.startswith("FAKE_CC_") or any(s.matches(k) for s in _SCRUB)]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MORI_JIT_CACHE_DIR", str(tmp_path / "jit-cache"))
    _reset_toolchain()
    yield
    _reset_toolchain()


class FakeCC:
    """Handle on the fake toolchain: its paths and the log of its invocations."""

    def __init__(self, log: Path):
        self.nvcc, self.hipcc, self.log_path = FAKE_NVCC, FAKE_HIPCC, log

    def calls(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [json.loads(ln) for ln in self.log_path.read_text().splitlines() if ln.strip()]

    def compiles(self) -> list[dict]:
        """Invocations other than ``--version``."""
        return [c for c in self.calls() if "--version" not in c["argv"]]


@pytest.fixture
def fake_cc(monkeypatch, tmp_path) -> FakeCC:
    """Point MORI_JIT_NVCC / MORI_JIT_HIPCC at the fake compiler (log in ``tmp_path/fake-cc.log``)."""
    log = tmp_path / "fake-cc.log"
    monkeypatch.setenv("MORI_JIT_NVCC", str(FAKE_NVCC))
    monkeypatch.setenv("MORI_JIT_HIPCC", str(FAKE_HIPCC))
    monkeypatch.setenv("FAKE_CC_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_CC_LOG", str(log))
    _reset_toolchain()
    return FakeCC(log)


@pytest.fixture
def no_compilers(monkeypatch, tmp_path) -> Path:
    """No compiler variable, none in ``$ROCM_PATH``/``$CUDA_HOME`` or the standard places, and a PATH
    holding only what the fake compiler's shell wrapper runs. Returns that PATH directory."""
    bin_dir = tmp_path / "path-bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    for var in ("MORI_JIT_HIPCC", "MORI_JIT_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "rocm"))
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(_toolchain, "STANDARD_PLACE", {"amd": str(tmp_path / "opt-rocm" / "bin" / "hipcc"),
                                                       "nvidia": str(tmp_path / "cuda" / "bin" / "nvcc")})
    return bin_dir


@pytest.fixture
def src_copy(monkeypatch, tmp_path) -> Path:
    """A copy of the source tree (``kernels/``, ``templates/``) selected with MORI_JIT_SOURCE_ROOT."""
    root = tmp_path / "src-root"
    for d in ("kernels", "templates"):
        shutil.copytree(REPO / d, root / d)
    monkeypatch.setenv("MORI_JIT_SOURCE_ROOT", str(root))
    return root


@pytest.fixture(scope="session", autouse=True)
def _mps_daemon_stopped_at_end():
    """Stop the CUDA MPS daemon the GPU harness (``mori_jit/testing/gpu_world.py``) started, even on failure."""
    yield
    harness = sys.modules.get("mori_jit.testing.gpu_world")
    if harness is not None:
        harness.stop_mps()
