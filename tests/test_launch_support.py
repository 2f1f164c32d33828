"""What launching needs, said plainly: the README's JIT example on a machine without a GPU raises
mori_jit's :class:`NoDeviceError` naming what is missing and what to install (before compiling
anything); ``mori-jit info`` reports the GPU and each vendor's launch bindings; and each setting's
default is shown as its value on this machine.

The machine here has no GPU (CPU torch); the tests that depend on that say so and skip elsewhere.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from mori_jit.cli import main
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


# -- mori-jit info -------------------------------------------------------------------------------------

def _info(capsys, *argv) -> str:
    assert main(["info", *argv]) == 0
    return capsys.readouterr().out


@no_gpu
def test_info_reports_the_gpu_and_the_launch_bindings(fake_cc, capsys):
    out = _info(capsys, "--arch", "sm_90a")
    assert re.search(r"^gpu: +none usable: torch \S+ ", out, re.M), out
    line = next(ln for ln in out.splitlines() if ln.startswith("bindings:"))
    for vendor, b in BINDINGS.items():
        version = bindings_version(vendor)
        want = f"{b.distribution} {version} ({vendor})" if version else \
            f"{b.distribution} not installed ({vendor}: pip install 'mori-jit[{b.extra}]')"
        assert want in line, line


def test_info_reports_installed_bindings_with_their_version(fake_cc, tmp_path):
    # a real (tiny) installed distribution: importable module plus its metadata, found on sys.path
    site = tmp_path / "site"
    (site / "hip").mkdir(parents=True)
    (site / "hip" / "__init__.py").write_text("")
    meta = site / "hip_python-6.2.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: hip-python\nVersion: 6.2.0\n")
    code = "import sys; from mori_jit.cli import main; sys.exit(main(['info', '--arch', 'gfx90a']))"
    p = _run_python(code, {}, extra_path=str(site))
    assert p.returncode == 0, p.stderr
    assert "hip-python 6.2.0 (amd)" in p.stdout


# -- each setting's default, as its value here ----------------------------------------------------------

def _default_of(out: str, var: str) -> str:
    return re.search(rf"^    {re.escape(var)} .*; default: (.*)$", out, re.M).group(1)


def test_info_shows_each_default_as_its_value(no_compilers, fake_cc, capsys, src_copy):
    (no_compilers / "nvcc").symlink_to(fake_cc.nvcc)  # the nvcc a search finds (MORI_JIT_NVCC names another)
    out = _info(capsys, "--arch", "sm_90a")
    # (MORI_JIT_CACHE_DIR, MORI_JIT_SOURCE_ROOT and MORI_JIT_NVCC are set here: the defaults do not read them)
    assert _default_of(out, "MORI_JIT_CACHE_DIR") == f"{Path.home() / '.mori' / 'jit'} (~/.mori/jit)"
    assert _default_of(out, "MORI_JIT_SOURCE_ROOT") == f"{REPO} (the checkout, else the packaged copy)"
    assert _default_of(out, "MORI_JIT_NVCC") == \
        f"{no_compilers / 'nvcc'} (the first of $CUDA_HOME/bin (else $CUDA_PATH/bin), /usr/local/cuda/bin, PATH)"
    assert _default_of(out, "MORI_JIT_LOCK_TIMEOUT_S") == "600.0"
    if not torch.cuda.is_available():
        assert _default_of(out, "MORI_JIT_ARCH").startswith("the current device's: none here (no GPU visible")
