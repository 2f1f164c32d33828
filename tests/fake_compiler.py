#!/usr/bin/env python3
"""A fake device compiler for the CPU tests: behaves like nvcc/hipcc on the command line.

Invoked through the shims ``tests/bin/fake-nvcc`` and ``tests/bin/fake-hipcc`` (point the toolchain
at them with ``MORI_JIT_NVCC`` / ``MORI_JIT_HIPCC``). Stdlib only.

* ``--version`` prints ``$FAKE_CC_VERSION`` (default ``fake-cc 1.0``) and exits 0.
* Otherwise it parses ``-o OUT`` and the source (the last argument that is not an option or an
  option's value), and writes ``OUT`` = ``b"FAKEBIN\\n" + sha256(source).hex + b"\\n" + source``, so
  the output is a function of the input and the entry symbol name appears in it. With ``-rdc=true``
  the output is relocatable: ``FAKERDC`` in place of ``FAKEBIN`` (:func:`output_for`).
* ``-dlink`` (nvcc's device link) takes every non-option argument as an input: relocatable objects
  and archives (``*.a``), and writes :func:`link_output_for` of their bytes. An object built
  without ``-rdc=true`` is refused (stricter than nvlink, which links one with nothing to resolve:
  a kernel calling into a library compiles only as relocatable code, so such an object here means
  the compile step lost the flag). ``FAKE_CC_LINK_FAIL=msg`` fails only this step.
* ``-save-temps``: also write intermediate files (``<source stem>.ii`` and ``.s``) into the working
  directory, as hipcc and nvcc do.
* ``FAKE_CC_FAIL=msg``: print ``msg`` on stderr and exit 1 (writes nothing).
* ``FAKE_CC_SLEEP=seconds``: sleep that long before writing.
* ``FAKE_CC_SLEEP_IN_CHILD=path``: that sleep runs in a child process (as nvcc runs cicc and ptxas,
  and hipcc clang), whose pid is appended to ``path``, one a line.
* ``FAKE_CC_DIE=1``: write half of the output, then SIGKILL itself.
* ``FAKE_CC_LOG=path``: append one JSON line per invocation (argv, cwd, ``HIP_PLATFORM``, pid).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

_WITH_VALUE = {"-o", "-x", "-I", "-D", "-include", "--offload-arch", "-gencode", "-arch", "-code"}


def output_for(source: bytes, relocatable: bool = False) -> bytes:
    """What the fake writes for ``source`` (tests recompute it to check a binary)."""
    return (b"FAKERDC\n" if relocatable else b"FAKEBIN\n") + hashlib.sha256(source).hexdigest().encode() + \
        b"\n" + source


def link_output_for(objects: list[bytes], archives: list[bytes]) -> bytes:
    """What the fake's ``-dlink`` writes: a header, the sha256 of each archive, then the objects."""
    return b"FAKELINKED\n" + b"".join(hashlib.sha256(a).hexdigest().encode() + b"\n" for a in archives) + \
        b"".join(objects)


def _dlink(inputs: list[str], out: str) -> int:
    objects, archives = [], []
    for path in inputs:
        if not os.path.isfile(path):
            print(f"fake-nvlink: error: no such file: {path}", file=sys.stderr)
            return 2
        with open(path, "rb") as f:
            data = f.read()
        if path.endswith(".a"):
            archives.append(data)
        elif data.startswith(b"FAKERDC\n"):
            objects.append(data)
        else:
            print(f"fake-nvlink: error: {path} is not relocatable device code (compile with -rdc=true)",
                  file=sys.stderr)
            return 1
    msg = os.environ.get("FAKE_CC_LINK_FAIL")
    if msg:
        print(msg, file=sys.stderr)
        return 1
    with open(out, "wb") as f:
        f.write(link_output_for(objects, archives))
    return 0


def _log(argv: list[str]) -> None:
    path = os.environ.get("FAKE_CC_LOG")
    if not path:
        return
    rec = {"argv": argv, "cwd": os.getcwd(), "HIP_PLATFORM": os.environ.get("HIP_PLATFORM"), "pid": os.getpid()}
    with open(path, "a") as f:  # one short write per line: O_APPEND keeps concurrent lines whole
        f.write(json.dumps(rec) + "\n")


def main(argv: list[str]) -> int:
    _log(argv)
    if "--version" in argv:
        print(os.environ.get("FAKE_CC_VERSION", "fake-cc 1.0 (mori-jit tests)"))
        return 0
    out = None
    inputs: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-o":
            out = argv[i + 1] if i + 1 < len(argv) else None
            i += 2
            continue
        if a in _WITH_VALUE:
            i += 2
            continue
        if not a.startswith("-"):
            inputs.append(a)
        i += 1
    if "-dlink" in argv and out is not None and inputs:
        return _dlink(inputs, out)
    src = inputs[-1] if inputs else None
    if out is None or src is None:
        print("fake-cc: error: need -o OUT and a source file", file=sys.stderr)
        return 2
    if not os.path.isfile(src):
        print(f"fake-cc: error: no such file: {src}", file=sys.stderr)
        return 2
    msg = os.environ.get("FAKE_CC_FAIL")
    if msg:
        print(msg, file=sys.stderr)
        return 1
    delay = float(os.environ.get("FAKE_CC_SLEEP") or 0)
    child_log = os.environ.get("FAKE_CC_SLEEP_IN_CHILD")
    if delay > 0 and child_log:
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({delay})"])
        with open(child_log, "a") as f:
            f.write(f"{child.pid}\n")
        child.wait()
    elif delay > 0:
        time.sleep(delay)
    with open(src, "rb") as f:
        data = output_for(f.read(), relocatable="-rdc=true" in argv)
    if "-save-temps" in argv:
        stem = os.path.splitext(os.path.basename(src))[0]
        for ext in (".ii", ".s"):
            with open(stem + ext, "wb") as f:
                f.write(data)
    with open(out, "wb") as f:
        if os.environ.get("FAKE_CC_DIE") not in (None, "", "0"):
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
