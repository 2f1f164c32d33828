"""The cache against a hostile neighbour and broken states (fake toolchain, CPU).

* nothing planted in the cache runs on the host (the template bytecode Jinja would unpickle);
* a cache directory others could write, or owned by another user, is refused with one error that
  names the directory, the owner, the mode and the fix, unless ``MORI_JIT_SHARED_CACHE`` is set;
* an entry is read only through its own fixed names, as bounded regular files, with ``meta.json``
  checked field by field: every damage below is reported as corrupt and rebuilt, never loaded,
  never a hang or a crash;
* a read-only cache of another user serves hits and ``render``.
Cases that need a second Unix user create it when run as root and skip otherwise.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest

import unix_users
from conftest import REPO, TESTS
from fake_compiler import output_for
from mori_jit.cli import main
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType
from mori_jit.jit import cache, spec as spec_mod
from mori_jit.jit.compile import build, resolve
from mori_jit.jit.paths import templates_dir
from mori_jit.jit.toolchain import make_toolchain

ARCH = "sm_90a"


@pytest.fixture(scope="module")
def users():
    yield unix_users.ensure_users()
    unix_users.remove_users()


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _build(cfg=None):
    tc = make_toolchain(ARCH)
    return build(AXPY, cfg or AxpyCfg(), tc)


def _within(seconds: float, fn):
    """``fn()``'s result, failing the test (not hanging it) if it takes longer than ``seconds``."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s (blocked on a file?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


# -- nothing in the cache runs on the host ---------------------------------------------------------

class _Payload:
    """Pickles to ``os.mkdir(marker)``: unpickling it runs a command."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant_template_bytecode(cache_dir: Path, marker: Path) -> int:
    """Plant Jinja bytecode files for every template where a bytecode cache in ``cache_dir/jinja``
    would look for them; returns how many."""
    import jinja2
    from jinja2.bccache import bc_magic
    d = cache_dir / "jinja"
    d.mkdir(parents=True, exist_ok=True)
    bcc = jinja2.FileSystemBytecodeCache(str(d))
    loader = jinja2.FileSystemLoader(str(templates_dir()))
    env = jinja2.Environment(loader=loader)
    names = loader.list_templates()
    for name in names:
        filename = loader.get_source(env, name)[1]
        (d / (bcc.pattern % bcc.get_cache_key(name, filename))).write_bytes(bc_magic + pickle.dumps(_Payload(marker)))
    return len(names)


@pytest.mark.parametrize("how", ["render_source", "cli-render", "cli-compile"])
def test_planted_template_bytecode_never_runs(fake_cc, capsys, tmp_path, how):
    marker = tmp_path / "planted-code-ran"
    assert _plant_template_bytecode(cache.cache_root(), marker) >= 2
    spec_mod._jinja_env.cache_clear()
    if how == "render_source":
        tc = make_toolchain(ARCH)
        AXPY.render_source(AXPY.make_cfg(tc, {}), tc)
    else:
        rc, _, err = _cli(capsys, how[4:], "example_axpy", "--arch", ARCH)
        assert rc == 0, err
    assert not marker.exists(), "a file planted in the cache ran as the user"


# -- directories others could write are refused ----------------------------------------------------

@pytest.mark.parametrize("where,mode", [("", 0o777), ("", 0o775), ("", 0o757), ("sm_90a_none", 0o777),
                                        ("sm_90a_none", 0o770), ("tmp", 0o777), ("locks", 0o777)])
def test_cache_dir_writable_by_others_is_refused_with_the_fix(fake_cc, capsys, monkeypatch, where, mode):
    _build()
    d = cache.cache_root() / where if where else cache.cache_root()
    os.chmod(d, mode)
    # a miss (a new config) goes through every directory; a hit through the root and arch dir
    rc, _, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH, "--set", "vecElems=4")
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"cache directory {d} is " in err and f"mode {mode:04o}" in err, err
    assert "writable by" in err and f"'chmod go-w {d}'" in err and "MORI_JIT_SHARED_CACHE=1" in err, err
    assert not any("vecElems" in str(p) for p in cache.list_entries())
    monkeypatch.setenv("MORI_JIT_SHARED_CACHE", "1")  # the explicit opt-in
    rc, _, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH, "--set", "vecElems=4")
    assert rc == 0, err


def test_cache_owned_by_another_user_is_refused(fake_cc, capsys, users, monkeypatch):
    owner = users["mori-jit-test-owner"]
    _build()
    unix_users.chown_tree(cache.cache_root(), owner.pw_uid, owner.pw_gid)
    rc, _, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH)  # a hit
    assert rc == 1 and f"owned by {owner.pw_name} (uid {owner.pw_uid})" in err and "mode 0755" in err, err
    assert "MORI_JIT_SHARED_CACHE=1" in err and "chmod" not in err, err
    monkeypatch.setenv("MORI_JIT_SHARED_CACHE", "1")
    rc, out, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH)
    assert rc == 0 and out.strip() == str(_build().path), err


def test_entry_planted_in_a_world_writable_cache_is_never_loaded(fake_cc):
    tc = make_toolchain(ARCH)
    res = resolve(AXPY, AxpyCfg(), tc)
    root = cache.cache_root()
    root.mkdir(parents=True)
    os.chmod(root, 0o777)
    evil = b"\x7fELF planted kernel"
    res.path.mkdir(parents=True)
    (res.path / cache.SOURCE_NAME).write_text(res.source)
    (res.path / "kernel.cubin").write_bytes(evil)
    (res.path / cache.META_NAME).write_text(json.dumps({
        "spec": AXPY.name, "entry": res.entry_name, "key": res.key, "arch": ARCH, "nic": "none",
        "binary": "kernel.cubin", "binary_sha256": hashlib.sha256(evil).hexdigest()}))
    with pytest.raises(PermissionError, match=f"cache directory {root} is writable by group and others"):
        build(AXPY, AxpyCfg(), tc, resolved=res)


def test_links_below_the_root_are_not_followed(fake_cc, capsys, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("mine")
    cache.cache_root().mkdir(parents=True)
    (cache.cache_root() / "sm_90a_none").symlink_to(elsewhere)
    rc, _, err = _cli(capsys, "compile", "example_axpy", "--arch", ARCH)
    assert rc == 1 and "is a symbolic link" in err, err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious.txt"]


# -- a read-only cache of another user -------------------------------------------------------------

def test_read_only_cache_of_another_user_serves_hits_and_render(fake_cc, capsys, users, monkeypatch):
    owner, reader = users["mori-jit-test-owner"], users["mori-jit-test-reader"]
    base = unix_users.shared_tmpdir()
    try:
        # the reader needs the compiler (its path is checked) and the sources (rendered, hashed): copies
        # it can read, as the checkout may sit in a folder only its owner enters
        shared = unix_users.readable_copy({"kernels": REPO / "kernels", "templates": REPO / "templates",
                                           "bin": fake_cc.nvcc.parent, "fake_compiler.py": TESTS / "fake_compiler.py"},
                                          base / "src")
        lost = unix_users.unreachable(reader, list(shared.values()))
        if lost:
            pytest.skip(f"the second user cannot read the copies under {base}: {', '.join(lost)}")
        monkeypatch.setenv("MORI_JIT_NVCC", str(shared["bin"] / fake_cc.nvcc.name))
        monkeypatch.setenv("MORI_JIT_SOURCE_ROOT", str(base / "src"))
        root = base / "team-cache"
        monkeypatch.setenv("MORI_JIT_CACHE_DIR", str(root))
        entry = _build()
        assert _cli(capsys, "render", "example_axpy", "--arch", ARCH)[0] == 0
        unix_users.chown_tree(root, owner.pw_uid, owner.pw_gid)
        for dirpath, _, filenames in os.walk(root):  # read-only for everyone, the owner included
            os.chmod(dirpath, 0o555)
            for n in filenames:
                os.chmod(os.path.join(dirpath, n), 0o444)
        before = sorted(str(p) for p in root.rglob("*"))

        def as_reader():
            spec_mod._jinja_env.cache_clear()
            results = {}
            for shared in ("", "1"):
                os.environ["MORI_JIT_SHARED_CACHE"] = shared
                for verb in ("compile", "render"):
                    err = io.StringIO()
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                        rc = main([verb, "example_axpy", "--arch", ARCH])
                    results[shared, verb] = rc, err.getvalue()
            return results

        got = unix_users.run_as(reader, as_reader)
        assert got["1", "compile"] == (0, "") and got["1", "render"] == (0, ""), got
        rc, err = got["", "compile"]  # refused without the opt-in
        assert rc == 1 and f"cache directory {root} is owned by {owner.pw_name}" in err, err
        assert sorted(str(p) for p in root.rglob("*")) == before and entry.path.is_dir()
    finally:
        for dirpath, _, _ in os.walk(base):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(base)


# -- meta.json and the entry's files are not trusted -----------------------------------------------

def _meta(entry) -> dict:
    return json.loads((entry.path / cache.META_NAME).read_text())


def _write_meta(entry, **changes) -> None:
    meta = {**_meta(entry), **changes}
    (entry.path / cache.META_NAME).write_text(json.dumps(meta))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _replace(p: Path, make) -> None:
    p.unlink()
    make(p)


_HOSTNAME = Path("/etc/hostname") if Path("/etc/hostname").is_file() else Path("/etc/passwd")
_OTHER_CFG = AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4)

DAMAGE = {
    "binary outside the entry (relative)": lambda e: _write_meta(
        e, binary="../../../../../../../../.." + str(_HOSTNAME), binary_sha256=_sha(_HOSTNAME.read_bytes())),
    "binary outside the entry (absolute)": lambda e: _write_meta(
        e, binary=str(_HOSTNAME), binary_sha256=_sha(_HOSTNAME.read_bytes())),
    "binary named /dev/zero": lambda e: _write_meta(e, binary="/dev/zero"),
    "binary a link to /dev/zero": lambda e: _replace(e.binary, lambda p: p.symlink_to("/dev/zero")),
    "binary a link to a good binary elsewhere": lambda e: _replace(
        e.binary, lambda p: p.symlink_to(_build(_OTHER_CFG).binary)),
    "binary a FIFO": lambda e: _replace(e.binary, os.mkfifo),
    "meta.json a FIFO": lambda e: _replace(e.path / cache.META_NAME, os.mkfifo),
    "empty binary with its sha256": lambda e: (e.binary.write_bytes(b""), _write_meta(e, binary_sha256=_sha(b""))),
    "binary of 1 GiB (sparse)": lambda e: os.truncate(e.binary, 1 << 30),
    "meta.json over the size bound": lambda e: _write_meta(e, pad="x" * (1 << 17)),
    "meta.json nested 30000 deep": lambda e: (e.path / cache.META_NAME).write_text("[" * 30000 + "]" * 30000),
    "meta.json a list": lambda e: (e.path / cache.META_NAME).write_text("[1, 2]"),
    "meta.json binary an int": lambda e: _write_meta(e, binary=5),
    "meta.json sha256 null": lambda e: _write_meta(e, binary_sha256=None),
    "meta.json key of another entry": lambda e: _write_meta(e, key="0" * 64),
    "meta.json arch of another arch": lambda e: _write_meta(e, arch="gfx90a"),
    "another key's files": lambda e: [shutil.copyfile(p, e.path / p.name) for p in _build(_OTHER_CFG).path.iterdir()],
    "source missing": lambda e: (e.path / cache.SOURCE_NAME).unlink(),
    "binary writable by others": lambda e: os.chmod(e.binary, 0o666),
    "entry dir a link to another entry": lambda e: (shutil.rmtree(e.path),
                                                    e.path.symlink_to(_build(_OTHER_CFG).path)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_entry_is_reported_and_rebuilt_never_loaded(fake_cc, capsys, caplog, damage):
    entry = _build()
    good = entry.binary.read_bytes()
    DAMAGE[damage](entry)
    capsys.readouterr()
    rc, out, _ = _within(30, lambda: _cli(capsys, "cache", "verify"))
    assert rc == 1 and f"corrupt  {entry.path.relative_to(cache.cache_root())}: " in out, out
    again = _within(30, _build)
    assert again.path == entry.path and again.binary.read_bytes() == good
    assert good == output_for((again.path / cache.SOURCE_NAME).read_bytes())
    # reported as it is rebuilt: a warning of the mori_jit logger (stderr unless the application
    # configures logging)
    assert any(r.levelname == "WARNING" and f"corrupt cache entry {entry.path}" in r.getMessage()
               for r in caplog.records), caplog.text
    assert _cli(capsys, "cache", "verify")[0] == 0
