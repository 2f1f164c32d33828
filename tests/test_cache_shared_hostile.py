"""A shared cache (``MORI_JIT_SHARED_CACHE=1``) whose owner turns on its users (fake toolchain, CPU).

The owner of a shared cache can rename anything in its directories at any moment. Each test does
what such an owner does, at the worst moment, through a hook at that point (the real code runs
around it): a directory that was checked becomes a link to the victim's own folder. Nothing of the
victim's outside the cache may be written or deleted through it:

* ``cache clear`` / ``cache verify --remove``: an entry swapped for a link after it was classified;
* a compile: its build directory swapped for a link once the compiler is about to run;
* ``MORI_JIT_KEEP_FAILED``: the kept source's name planted as a link to the victim's file.

The swaps are made by the test's own user: what matters is that no path is resolved again after
its check, which holds or fails the same for any owner.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fake_compiler import output_for
from mori_jit.cli import main
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
from mori_jit.jit import cache, cache_admin, procs
from mori_jit.jit.compile import CompileError, build, resolve
from mori_jit.jit.toolchain import make_toolchain

ARCH = "sm_90a"
#: The victim's project: what must survive every test untouched.
PROJECT_FILES = {"meta.json": "the victim's own meta.json", "kernel.hip": "the victim's own kernel",
                 "notes.txt": "the victim's notes"}


@pytest.fixture(autouse=True)
def _shared(monkeypatch):
    monkeypatch.setenv("MORI_JIT_SHARED_CACHE", "1")


def _project(tmp_path: Path) -> Path:
    d = tmp_path / "victims-project"
    d.mkdir()
    for name, text in PROJECT_FILES.items():
        (d / name).write_text(text)
    return d


def _untouched(project: Path) -> bool:
    return {p.name: p.read_text() for p in project.iterdir()} == PROJECT_FILES


def _swap_for_link(d: Path, target: Path, away: Path) -> None:
    """What the owner does: move the directory ``d`` away and put a link to ``target`` in its place."""
    os.rename(d, away)
    d.symlink_to(target)


@pytest.mark.parametrize("marked", [True, False], ids=["marked-root", "mark-removed"])
@pytest.mark.parametrize("verb", [["cache", "clear"], ["cache", "verify", "--remove"]], ids=" ".join)
def test_an_entry_swapped_for_a_link_mid_clear_deletes_nothing_it_points_to(fake_cc, capsys, monkeypatch, tmp_path,
                                                                             verb, marked):
    entry = build(AXPY, AxpyCfg(), make_toolchain(ARCH))
    entry.binary.write_bytes(b"damaged")  # (verify --remove removes corrupt entries only)
    if not marked:  # the owner can take the mark away too
        (cache.cache_root() / "CACHEDIR.TAG").unlink()
    project = _project(tmp_path)
    real_classify = cache_admin.classify

    def classify_then_swap(root):
        contents = real_classify(root)
        assert entry.path in contents.entries
        _swap_for_link(entry.path, project, tmp_path / "moved-away")
        return contents

    monkeypatch.setattr(cache_admin, "classify", classify_then_swap)
    main(list(verb))
    capsys.readouterr()
    assert _untouched(project), sorted(p.name for p in project.iterdir())


def test_a_build_dir_swapped_for_a_link_mid_compile_writes_nothing_through_it(fake_cc, monkeypatch, tmp_path):
    project = _project(tmp_path)
    seen = {}

    def run_after_swap(cmd, **kwargs):
        (d,) = (cache.cache_root() / "tmp").iterdir()  # the build dir, as the compiler is about to run
        st = os.lstat(d)
        seen.update(uid=st.st_uid, mode=stat.S_IMODE(st.st_mode))
        _swap_for_link(d, project, tmp_path / "moved-away")
        return run(cmd, **kwargs)

    run = procs.run  # (the compile runs its compiler through procs.run)
    monkeypatch.setattr(procs, "run", run_after_swap)
    try:
        entry = build(AXPY, AxpyCfg(), make_toolchain(ARCH))
    finally:  # (checked first: a write through the link is the failure that matters)
        assert _untouched(project), {p.name: p.read_bytes()[:40] for p in project.iterdir()}
    assert seen == {"uid": os.geteuid(), "mode": 0o700}  # a private folder of the user's
    source = (entry.path / cache.SOURCE_NAME).read_bytes()
    assert source == resolve(AXPY, AxpyCfg(), make_toolchain(ARCH)).source.encode()
    assert entry.read_binary() == output_for(source) and cache.verify_entry(entry.path) is not None


def test_keep_failed_replaces_a_planted_link_never_writes_through_it(fake_cc, monkeypatch, tmp_path):
    tc = make_toolchain(ARCH)
    res = resolve(AXPY, AxpyCfg(), tc)
    victim = tmp_path / "victims-file.txt"
    victim.write_text("the victim's own file")
    planted = cache.cache_root() / "failed" / f"{res.entry_name}.{res.key[:16]}" / cache.SOURCE_NAME
    planted.parent.mkdir(parents=True)
    planted.symlink_to(victim)
    monkeypatch.setenv("MORI_JIT_KEEP_FAILED", "1")
    monkeypatch.setenv("FAKE_CC_FAIL", "kernel.hip(1): error: boom")
    with pytest.raises(CompileError) as ei:
        build(AXPY, AxpyCfg(), tc, resolved=res)
    assert victim.read_text() == "the victim's own file"
    kept = ei.value.source_path
    assert kept == planted and not kept.is_symlink() and kept.read_text() == res.source
    assert sorted(p.name for p in planted.parent.iterdir()) == [cache.SOURCE_NAME]  # no tmp file left
