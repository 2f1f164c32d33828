"""The README's EP example runs as written: it is the marked part of ``scripts/ep_example.py``, line
for line, and that program, run by torchrun on two gloo ranks (the ``torch`` backend on the CPU),
prints its success line only when every rank's combine matches a dense computation of the same
MoE layer."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "scripts" / "ep_example.py"


def _readme_block() -> str:
    """The first ``python`` code block of the README's "EP example" section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## EP example\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "README.md: the EP example section has no ```python block"
    return found.group(1)


def _script_block() -> str:
    text = SCRIPT.read_text(encoding="utf-8")
    return text.split("# --- README: begin ---\n", 1)[1].split("# --- README: end ---\n", 1)[0]


def test_readme_shows_the_example_program():
    assert _readme_block().strip() == _script_block().strip()


def test_example_runs_on_two_gloo_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    report = f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert re.search(r"^ep_example: OK: 2 ranks, torch backend, .*combine matches the dense layer", proc.stdout,
                     re.M), report
