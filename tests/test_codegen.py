"""Generated headers: committed copies are current, they compile with plain g++, and C++ agrees with Python.

* every registered header regenerated from the Python declarations has the sha256 of the file
  committed under ``kernels/`` (a stale header fails here);
* each header compiles alone with ``g++ -std=c++20 -fsyntax-only`` (no HIP or CUDA headers), which
  also checks every ``static_assert(offsetof(...))`` against the host ABI, i.e. the ctypes layout;
* one generated C++ program evaluates every Derived of every Cfg for >= 200 random valid configs
  (and some invalid ones, for the IsValid functions) in constant expressions and prints them; the
  values must equal Python's. Configs are written with ``render_cfg`` (non-default fields only), so
  the C++ defaults are checked against the Python defaults too;
* swapping two pointer fields in a copy of a generated args struct makes g++ fail the static_asserts.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from jit_helpers import sample_cfgs
from mori_jit.jit.codegen import registered_headers, stale_headers, write_headers
from mori_jit.jit.fields import render_cfg

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ not installed")

HEADERS = registered_headers()
# (EpCfg's random fields make a valid config rarer with every rule: 180 valid ones come within the
# sampler's tries)
N_VALID, N_INVALID = 180, 40


def _gxx(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([GXX, "-std=c++20", "-Wall", "-Wextra", "-Werror", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_every_shipped_spec_declares_its_headers():
    paths = {h.path for h in HEADERS}
    assert {"example/axpy_generated.hpp", "ep/ep_generated.hpp"} <= paths
    on_disk = {p.relative_to(REPO / "kernels").as_posix() for p in (REPO / "kernels").rglob("*_generated.hpp")}
    assert on_disk <= paths, f"generated-looking headers nobody declares: {sorted(on_disk - paths)}"


@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h.path)
def test_committed_header_matches_declarations(header):
    committed = REPO / "kernels" / header.path
    assert committed.is_file(), f"kernels/{header.path} is not committed; run write_headers"
    assert hashlib.sha256(committed.read_bytes()).hexdigest() == header.sha256(), (
        f"kernels/{header.path} is stale: regenerate it with "
        f"python -c 'from mori_jit.jit.codegen import write_headers; write_headers(\"kernels\")'")


def test_stale_header_is_detected_and_rewritten(tmp_path):
    kernels = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", kernels)
    assert stale_headers(kernels) == []
    target = kernels / HEADERS[0].path
    target.write_text(target.read_text().replace("=", "= ", 1))
    (kernels / HEADERS[-1].path).unlink()
    assert set(stale_headers(kernels)) == {HEADERS[0].path, HEADERS[-1].path}
    assert set(write_headers(kernels)) == {HEADERS[0].path, HEADERS[-1].path}
    assert stale_headers(kernels) == [] and write_headers(kernels) == []
    assert target.read_text() == HEADERS[0].text()


@needs_gxx
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h.path)
def test_header_compiles_with_plain_gxx(header, tmp_path):
    (tmp_path / "h.cpp").write_text(f'#include "{header.path}"\nint main() {{ return 0; }}\n')
    p = _gxx(["-fsyntax-only", f"-I{REPO / 'kernels'}", "h.cpp"], tmp_path)
    assert p.returncode == 0, p.stderr


def _derived_by_cfg():
    """[(header, cfg class, [Derived...])] for every Cfg that has derived functions."""
    out = []
    for h in HEADERS:
        for cls in h.cfgs:
            ds = [d for d in h.derived if d.cfg_type == cls.__name__]
            if ds:
                out.append((h, cls, ds))
    return out


@needs_gxx
def test_derived_values_agree_between_python_and_cpp(tmp_path):
    groups = _derived_by_cfg()
    assert {cls.__name__ for _, cls, _ in groups} >= {"EpCfg", "AxpyCfg"}
    src = ["#include <cstdio>"] + [f'#include "{h.path}"' for h in HEADERS]
    body = []
    expected: list[str] = []
    for gi, (h, cls, ds) in enumerate(groups):
        valid, invalid = sample_cfgs(cls, N_VALID, N_INVALID, seed=1234 + gi)
        cfgs = valid + invalid
        assert sum(1 for c in cfgs if not next(d for d in ds if d.name.endswith("IsValid"))(c)) == N_INVALID
        ns = h.namespace
        arr = f"kCfgs{gi}"
        src.append(f"namespace g{gi} {{ using namespace {ns};")
        src.append(f"constexpr {cls.__name__} {arr}[] = {{")
        src += [f"  {render_cfg(c)}," for c in cfgs]
        src.append("};")
        for d in ds:
            # constexpr array: every value is computed by the compiler (as __launch_bounds__ needs)
            vals = ", ".join(f"(long long){d.name}({arr}[{i}])" for i in range(len(cfgs)))
            src.append(f"constexpr long long k{d.name}[] = {{{vals}}};")
            body.append(f'  for (int i = 0; i < {len(cfgs)}; ++i) '
                        f'std::printf("{cls.__name__} %d {d.name} %lld\\n", i, g{gi}::k{d.name}[i]);')
            expected += [f"{cls.__name__} {i} {d.name} {int(d(c))}" for i, c in enumerate(cfgs)]
        src.append("}")
    src += ["int main() {", *body, "  return 0;", "}"]
    (tmp_path / "derived.cpp").write_text("\n".join(src) + "\n")
    p = _gxx([f"-I{REPO / 'kernels'}", "-O0", "derived.cpp", "-o", "derived"],
             tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    run = subprocess.run([str(tmp_path / "derived")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    got = run.stdout.splitlines()
    assert len(got) == len(expected)
    mismatches = [(e, g) for e, g in zip(expected, got) if e != g]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:5]}"


def _swap_first_two_pointers(struct_text: str, name: str) -> tuple[str, str, str]:
    lines = struct_text.splitlines()
    start = lines.index(f"struct {name} {{")
    ptr_lines = [i for i in range(start + 1, len(lines)) if lines[i].startswith("  ") and "*" in lines[i].split("//")[0]]
    a, b = ptr_lines[:2]
    fa = lines[a].split("//")[0].split()[-1].rstrip(";")
    fb = lines[b].split("//")[0].split()[-1].rstrip(";")
    lines[a], lines[b] = lines[b], lines[a]
    return "\n".join(lines), fa, fb


ARGS = [(h, a) for h in HEADERS for a in h.args]


@needs_gxx
@pytest.mark.parametrize("header,args", ARGS, ids=lambda x: getattr(x, "name", getattr(x, "path", "")))
def test_swapping_two_pointer_fields_fails_the_build(header, args, tmp_path):
    text = header.text()
    swapped, fa, fb = _swap_first_two_pointers(text, args.name)
    assert swapped != text
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "swapped.hpp").write_text(swapped)
    (tmp_path / "h.cpp").write_text('#include "swapped.hpp"\nint main() { return 0; }\n')
    p = _gxx(["-fsyntax-only", f"-I{tmp_path / 'kernels'}", "h.cpp"], tmp_path)
    assert p.returncode != 0, "g++ accepted an args struct with swapped pointer fields"
    assert f"{args.name}.{fa} moved" in p.stderr and f"{args.name}.{fb} moved" in p.stderr, p.stderr[-2000:]
