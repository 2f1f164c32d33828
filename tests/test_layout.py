"""The import rule of ``mori_jit/ops/ep`` (stated in its ``__init__``): imports point one way only.

Read from the source with ``ast`` (nothing is imported), so a new module that breaks the rule fails
here whatever it does at run time, a function-level import included.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EP = ROOT / "mori_jit" / "ops" / "ep"

#: The layers of ``ops/ep``, highest first: a module may import its own layer or a lower one.
#: ``top`` is the files directly in ``ops/ep``; a backend never imports another backend.
LAYERS = ["backends.hip.top", "backends.hip.families", "backends.hip.common", "backends.torch", "train", "core",
          "memory", "top"]


def _layer(module: str) -> str:
    """The layer of a dotted module path under ``mori_jit.ops.ep`` (``mori_jit.ops.ep`` excluded)."""
    parts = module.split(".")[3:]
    if parts and parts[0] in ("core", "memory", "train"):  # (a folder's package module included)
        return parts[0]
    if len(parts) <= 1:
        return "top"
    if parts[:2] == ["backends", "torch"]:
        return "backends.torch"
    if parts[0] == "backends" and len(parts) <= 2:  # the backends' package faces (docstrings only)
        return "backends.hip.top"
    if parts[:2] == ["backends", "hip"]:
        if len(parts) == 3:
            return "backends.hip.top"
        return "backends.hip.common" if parts[2] == "common" else "backends.hip.families"
    raise AssertionError(f"{module}: a folder the import rule does not place; add it to LAYERS and the docstring")


def _backend(module: str) -> str | None:
    parts = module.split(".")
    return parts[4] if len(parts) > 5 and parts[3] == "backends" else None


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[5] if len(parts) > 6 and parts[3:5] == ["backends", "hip"] and parts[5] != "common" else None


def _modules() -> dict[str, Path]:
    out = {}
    for path in EP.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every ``mori_jit`` module ``path`` imports, at any depth of the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("mori_jit")}


MODULES = _modules()


def test_every_ops_ep_module_has_a_layer():
    for module in MODULES:
        if module != "mori_jit.ops.ep":
            _layer(module)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "mori_jit.ops.ep"))
def test_imports_point_down(module):
    mine = _layer(module)
    wrong = []
    for target in sorted(_imports(module, MODULES[module])):
        if target.startswith("mori_jit.ops.ep."):
            if target not in MODULES:  # a name imported from a module, not a module
                continue
            theirs = _layer(target)
            if LAYERS.index(theirs) < LAYERS.index(mine):
                wrong.append(f"{target} ({theirs}) is above {mine}")
            elif _backend(module) and _backend(target) and _backend(module) != _backend(target):
                wrong.append(f"{target}: a backend imports another backend")
            elif _family(module) and _family(target) and _family(module) != _family(target):
                wrong.append(f"{target}: the {_family(module)} family imports the {_family(target)} family")
        elif target.startswith(("mori_jit.compat", "mori_jit.testing", "mori_jit.examples", "mori_jit.cli")):
            wrong.append(f"{target}: ops/ep imports only mori_jit.jit outside itself")
    assert not wrong, f"{module} breaks the import rule of mori_jit/ops/ep/__init__.py: " + "; ".join(wrong)


def test_the_rule_catches_an_import_that_points_up(tmp_path):
    """The check itself can fail: a memory module importing core is refused."""
    bad = tmp_path / "bad.py"
    bad.write_text("from mori_jit.ops.ep.core.op import EpDispatchCombineOp\n")
    assert "mori_jit.ops.ep.core.op" in _imports("mori_jit.ops.ep.memory.bad", bad)
    assert LAYERS.index(_layer("mori_jit.ops.ep.core.op")) < LAYERS.index(_layer("mori_jit.ops.ep.memory.bad"))
