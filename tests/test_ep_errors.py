"""One error root: every error the EP op raises is an ``EpError`` (and the built-in a caller expects)."""
from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import mori_jit.ops.ep as ep
from mori_jit.jit.compile import CompileError
from mori_jit.jit.fields import ConfigError
from mori_jit.ops.ep import errors

EP = Path(ep.__file__).resolve().parent
#: The kernel-spec layer raises the JIT's errors (it also serves ``mori-jit render``); the op turns
#: them into its own at construction (:func:`errors.jit_errors_as_ep_errors`).
SPEC_LAYER = {f"backends/hip/{fam}/{m}.py" for fam in ("intranode", "internode") for m in ("cfg", "specs", "tuning")}
BUILTINS = {n for n in dir(builtins) if n.endswith(("Error", "Exception"))}


def test_every_error_class_derives_from_the_root():
    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert len(classes) >= 10
    for cls in classes:
        assert cls is ConfigError or issubclass(cls, errors.EpError), cls


def test_the_hierarchy_callers_rely_on():
    assert issubclass(ep.EpCapacityError, ep.EpDeviceError)  # both from check(), both need reset()
    assert issubclass(ep.EpConfigError, ConfigError) and issubclass(ep.EpConfigError, ValueError)
    assert issubclass(ep.EpArgumentError, ValueError) and issubclass(ep.EpArgumentTypeError, TypeError)
    assert issubclass(ep.EpUnsupportedError, NotImplementedError)
    assert "ConfigError" in ep.__all__ and ep.ConfigError is ConfigError
    assert "KernelSet" not in ep.__all__  # for backend authors: mori_jit.ops.ep.core.kernel_set


def _builtin_raises(path: Path, root: Path = EP) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
            if node.exc.func.id in BUILTINS or node.exc.func.id == "ConfigError":
                out.append(f"{path.relative_to(root)}:{node.lineno}: raise {node.exc.func.id}")
    return out


def test_the_op_raises_only_its_own_errors():
    found = []
    for path in sorted(EP.rglob("*.py")):
        rel = path.relative_to(EP).as_posix()
        # (a lazy package face's AttributeError is Python's attribute protocol, not the op's error)
        if rel in SPEC_LAYER or rel in ("__init__.py", "train/__init__.py"):
            continue
        found += _builtin_raises(path)
    assert found == [], "raise an ops.ep.errors class instead:\n" + "\n".join(found)


def test_the_scan_sees_a_builtin_raise(tmp_path):
    bad = EP / "config.py"
    assert _builtin_raises(bad) == []
    planted = tmp_path / "x.py"
    planted.write_text("def f():\n    raise ValueError('x')\n")
    assert _builtin_raises(planted, tmp_path) == ["x.py:2: raise ValueError"]


def test_jit_errors_become_the_ops_errors_with_their_cause():
    with pytest.raises(errors.EpConfigError, match="MORI_EP_CFG_X") as e:
        with errors.jit_errors_as_ep_errors():
            raise ConfigError("MORI_EP_CFG_X: no EpCfg field")
    assert isinstance(e.value.__cause__, ConfigError)
    with pytest.raises(errors.EpBuildError, match="nvcc failed") as e:
        with errors.jit_errors_as_ep_errors():
            raise CompileError("ep_dispatch", ["nvcc"], 1, "nvcc failed", None)
    assert isinstance(e.value.__cause__, CompileError)
    with pytest.raises(errors.EpDeviceError):  # the op's own pass through unchanged
        with errors.jit_errors_as_ep_errors():
            raise errors.EpDeviceError("kept")
