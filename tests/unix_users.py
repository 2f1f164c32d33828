"""Second Unix users for the cache tests: created when the suite runs as root, else the test skips.

:func:`run_as` runs a function in a forked child that has dropped to another user: the modules it
needs must be imported (and the compiler signature memoized) before, since that user may not be
able to read the interpreter's own directories.
"""
from __future__ import annotations

import os
import pickle
import pwd
import shutil
import subprocess
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

#: The users the tests create (and remove when the pytest run ends): an owner of a cache, a reader.
NAMES = ("mori-jit-test-owner", "mori-jit-test-reader")


def need_root() -> None:
    """Skip the calling test, with the reason, unless it runs as root."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test changes file owners and runs code as a second Unix user")


def ensure_users() -> dict[str, pwd.struct_passwd]:
    """The test users by name, created with ``useradd`` if missing (root only; skips otherwise)."""
    need_root()
    if shutil.which("useradd") is None:
        pytest.skip("needs useradd to create the second Unix users")
    out = {}
    for name in NAMES:
        try:
            out[name] = pwd.getpwnam(name)
        except KeyError:
            p = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                               capture_output=True, text=True)
            if p.returncode != 0:
                pytest.skip(f"useradd {name} failed: {p.stderr.strip()}")
            out[name] = pwd.getpwnam(name)
    return out


def remove_users() -> None:
    """Remove the test users if this pytest run created them (best effort)."""
    if os.geteuid() != 0 or shutil.which("userdel") is None:
        return
    for name in NAMES:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        subprocess.run(["userdel", name], capture_output=True)


def shared_tmpdir() -> Path:
    """A fresh directory under /tmp that every user can traverse (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="mori-jit-users-", dir="/tmp"))
    os.chmod(d, 0o755)
    return d


def readable_copy(sources: dict[str, Path], dest: Path) -> dict[str, Path]:
    """Copies of ``sources`` (name → file or tree) under ``dest``, readable by every user (executables
    stay executable): a checkout in a folder only its owner can enter (a ``mktemp -d`` folder, a
    0700 home) hides its own files from a second user."""
    out = {}
    for name, src in sources.items():
        out[name] = dest / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, out[name])
        for dirpath, _, filenames in os.walk(out[name]) if src.is_dir() else [(str(dest), [], [name])]:
            os.chmod(dirpath, 0o755)
            for n in filenames:
                f = os.path.join(dirpath, n)
                os.chmod(f, 0o755 if os.access(f, os.X_OK) else 0o644)
    return out


def unreachable(user: pwd.struct_passwd, paths: list[Path]) -> list[str]:
    """Those of ``paths`` that ``user`` cannot read (a directory: list), each with the reason; checked
    as that user, so a test can skip, naming them, rather than fail on what the machine does not allow."""
    def probe() -> list[str]:
        out = []
        for p in paths:
            try:
                os.listdir(p) if p.is_dir() else open(p, "rb").close()
            except OSError as e:
                out.append(f"{p} ({e.strerror})")
        return out
    return run_as(user, probe)


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """``chown -R`` without following links."""
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, gid)
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


def run_as(user: pwd.struct_passwd, fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a forked child as ``user``; returns its result or raises ``RuntimeError``
    carrying the child's traceback."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            os.environ["HOME"] = "/nonexistent"
            payload = ("ok", fn())
        except BaseException:  # noqa: BLE001 - reported to the parent
            payload = ("error", traceback.format_exc())
        with os.fdopen(w, "wb") as f:
            f.write(pickle.dumps(payload))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    status, value = pickle.loads(data)
    if status != "ok":
        raise RuntimeError(f"child as {user.pw_name} failed:\n{value}")
    return value
