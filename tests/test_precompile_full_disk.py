"""``mori-jit precompile`` on a full disk: each kernel that cannot be written fails with a line
naming it and the path, the others are still tried, the summary line is printed, and nothing
half-written is left in the cache.

The disk is a real one: a 4 MiB tmpfs, mounted in a mount namespace of the test's own (``unshare``,
so it goes away with the command) and filled before the precompile runs. That needs root.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = """
set -e
mount -t tmpfs -o size=4m tmpfs "$DISK"
export MORI_JIT_CACHE_DIR="$DISK/cache"
"$PY" -m mori_jit compile example_axpy --arch sm_90a > /dev/null
head -c 16M /dev/zero > "$DISK/filler" 2> /dev/null || true
set +e
"$PY" -m mori_jit precompile --arch sm_90a -j 2 > "$OUT/stdout" 2> "$OUT/stderr"
echo $? > "$OUT/rc"
cd "$DISK/cache" && find . -mindepth 2 -not -path './locks/*' | sort > "$OUT/files"
"""


def _need_a_mount_namespace() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root, unshare and mount: the test mounts a small tmpfs as the full disk")
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {p.stderr.strip()}")


def test_precompile_on_a_full_disk_names_each_kernel_and_path_and_keeps_the_summary(fake_cc, tmp_path):
    _need_a_mount_namespace()
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    env = dict(os.environ, DISK=str(disk), OUT=str(out), PY=sys.executable,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", SCRIPT], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and (out / "rc").exists(), p.stderr
    rc, stdout, stderr = int((out / "rc").read_text()), (out / "stdout").read_text(), (out / "stderr").read_text()
    n = int(re.match(r"precompiling (\d+) kernels", stdout).group(1))
    failed = re.findall(r"^\[\d+/\d+\] (\S+) +FAILED +\d+\.\d\ds  cannot write the cache entry (\S+): "
                        r"No space left on device \(ENOSPC\)$", stdout, re.M)
    assert len(failed) == n - 1, stdout  # (all but the one built before the disk filled: a hit)
    cache = disk / "cache"
    assert all(path.startswith(f"{cache}/sm_90a_none/kernel.{name}.") for name, path in failed)
    assert re.search(r"^\[\d+/\d+\] mori_example_axpy_bf16_v8_264x256 +hit ", stdout, re.M), stdout
    assert re.search(rf"^done in \d+\.\ds: 0 compiled, 1 hit, {n - 1} failed$", stdout, re.M), stdout
    assert rc == 1 and stderr.startswith(f"mori-jit: error: {n - 1} of {n} kernels failed to build: ")
    # nothing half-written: the one entry built before, no build directory
    files = (out / "files").read_text().split()
    assert files and all(f.startswith("./sm_90a_none/kernel.mori_example_axpy_bf16_v8_264x256.") for f in files)
