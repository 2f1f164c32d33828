"""A cache that must never wedge, and removals whose outcome is told right (fake toolchain, CPU).

* an entry member (``meta.json``, the binary, the source) that is a directory is reported as
  corrupt, skipped by ``verify`` (which goes on with the other entries), removed by ``clear`` and
  rebuilt by the next compile.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from mori_jit.cli import main
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType
from mori_jit.jit import cache
from mori_jit.jit.compile import build
from mori_jit.jit.toolchain import make_toolchain

ARCH = "sm_90a"


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _build(cfg=None, arch=ARCH):
    return build(AXPY, cfg or AxpyCfg(), make_toolchain(arch))


def _rel(p: Path) -> str:
    return str(p.relative_to(cache.cache_root()))


def _make_dir_of(p: Path) -> None:
    p.unlink()
    p.mkdir()
    (p / "inside.txt").write_text("x")


@pytest.mark.parametrize("member", [cache.META_NAME, "kernel.cubin", cache.SOURCE_NAME])
def test_an_entry_member_that_is_a_directory_is_reported_skipped_cleared_and_rebuilt(fake_cc, capsys, member):
    entry, other = _build(), _build(AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4))
    good = entry.binary.read_bytes()
    _make_dir_of(entry.path / member)
    rc, out, err = _cli(capsys, "cache", "verify")
    assert rc == 1 and f"corrupt  {_rel(entry.path)}: {member} is not a regular file (d" in out, (out, err)
    assert "verified 2 entries" in out and "1 ok, 1 corrupt" in out and _rel(other.path) not in out, out
    rc, out, err = _cli(capsys, "cache", "ls")
    assert rc == 0 and "2 entries (1 corrupt)" in out, (out, err)
    again = _build()
    assert again.path == entry.path and again.binary.read_bytes() == good
    assert sorted(p.name for p in again.path.iterdir()) == sorted([cache.SOURCE_NAME, "kernel.cubin", cache.META_NAME])
    _make_dir_of(entry.path / member)
    rc, out, err = _cli(capsys, "cache", "clear")
    assert rc == 0 and "removed 2 entries" in out and "left" not in out, (out, err)
    assert cache.list_entries() == []
