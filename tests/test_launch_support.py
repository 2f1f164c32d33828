"""What launching needs, said plainly: the README's JIT example on a machine without a GPU raises
mori_jit's :class:`NoDeviceError` naming what is missing and what to install (before compiling
anything).

The machine here has no GPU (CPU torch); the tests that depend on that say so and skip elsewhere.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from mori_jit.jit.runtime import NoDeviceError, get_runtime
from mori_jit.jit.runtime.support import BINDINGS, bindings_version

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the example would run")


def _readme_jit_example() -> str:
    text = (REPO / "README.md").read_text()
    return re.search(r"## JIT example\n\n```python\n(.*?)```", text, re.S).group(1)


def _run_python(code: str, env_extra: dict[str, str], extra_path: str = "") -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (extra_path, str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def _expected_missing(vendor: str | None) -> list[str]:
    vendors = [vendor] if vendor else list(BINDINGS)
    if any(bindings_version(v) for v in vendors):
        return []
    return [BINDINGS[v].install() for v in vendors]


@no_gpu
@pytest.mark.parametrize("arch_env", [{}, {"MORI_JIT_ARCH": "sm_90a"}], ids=["no-arch", "MORI_JIT_ARCH"])
def test_the_readme_jit_example_without_a_gpu_says_what_is_missing(fake_cc, arch_env):
    p = _run_python(_readme_jit_example(), arch_env)
    assert p.returncode == 1
    last = p.stderr.rstrip().splitlines()[-1]
    assert last.startswith("mori_jit.jit.runtime.support.NoDeviceError: prepare() needs a GPU, and this machine "
                           "has none usable: "), p.stderr
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        assert f"torch {torch.__version__} is a CPU-only build" in last and "install a CUDA or ROCm build" in last
    assert all(hint in last for hint in _expected_missing(None)), last
    assert "Torch not compiled" not in p.stderr and "During handling" not in p.stderr
    assert fake_cc.compiles() == []  # (said before compiling anything)


@no_gpu
def test_get_runtime_without_a_gpu_names_what_is_missing():
    with pytest.raises(NoDeviceError, match=r"^the nvidia runtime needs a GPU, .*Compiling needs no GPU") as ei:
        get_runtime("nvidia")
    assert all(hint in str(ei.value) for hint in _expected_missing("nvidia"))
