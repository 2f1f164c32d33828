"""Build hook: regenerate the generated C++ headers and ship ``kernels/`` + ``templates/`` in the wheel.

Everything else is in ``pyproject.toml``. ``build_py``:

(a) regenerates ``kernels/**/_generated.hpp`` from the Python declarations, importing
    ``mori_jit.jit.codegen`` from *this source tree* (the headers are also committed; a test fails
    on a stale one);
(b) copies ``kernels/`` and ``templates/`` into the wheel as ``mori_jit/_sources/``, where
    ``mori_jit/jit/paths.py`` finds them in an installed package. Editable installs skip the copy:
    they compile the live tree.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SOURCE_DIRS = ("kernels", "templates")


def regenerate_headers() -> None:
    kernels = ROOT / "kernels"
    sys.path.insert(0, str(ROOT))
    try:
        for name in [m for m in sys.modules if m == "mori_jit" or m.startswith("mori_jit.")]:
            del sys.modules[name]  # never a mori_jit installed elsewhere
        from mori_jit.jit.codegen import registered_headers, write_headers
        written = write_headers(kernels)
        declared = {h.path for h in registered_headers()}
    except ImportError as e:
        print(f"mori-jit build: warning: cannot import the spec modules ({e}); the committed generated "
              f"headers ship as they are", file=sys.stderr)
        return
    finally:
        sys.path.remove(str(ROOT))
    for rel in written:
        print(f"mori-jit build: regenerated kernels/{rel}")
    # The spec registry skips a package that fails to import (e.g. one that needs torch, absent from an
    # isolated build environment): say which generated headers were therefore left as committed.
    on_disk = {p.relative_to(kernels).as_posix() for p in kernels.rglob("*_generated.hpp")}
    for rel in sorted(on_disk - declared):
        print(f"mori-jit build: warning: kernels/{rel} not regenerated (its declaring module could not be "
              f"imported at build time); the committed copy ships", file=sys.stderr)


class BuildPy(build_py):
    def run(self):
        regenerate_headers()
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dst_root = Path(self.build_lib) / "mori_jit" / "_sources"
        if dst_root.exists():
            shutil.rmtree(dst_root)
        for d in SOURCE_DIRS:
            shutil.copytree(ROOT / d, dst_root / d,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*.tmp"))


setup(cmdclass={"build_py": BuildPy})
