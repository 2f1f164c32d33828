"""The ``mori-jit`` CLI: every verb on example_axpy with ``--arch sm_90a`` and the fake toolchain;
bad input exits non-zero with exactly one ``mori-jit: error:`` line and no traceback."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from mori_jit.cli import main, precompile_targets
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType
from mori_jit.jit import cache
from mori_jit.jit.compile import resolve
from mori_jit.jit.fields import request_schema
from mori_jit.jit.registry import all_specs
from mori_jit.jit.toolchain import make_toolchain

ARCH = ["--arch", "sm_90a"]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, fragment=""):
    assert rc != 0
    assert err.count("\n") == 1 and err.startswith("mori-jit: error: "), err
    assert "Traceback" not in err
    assert fragment in err, err


# -- verbs -----------------------------------------------------------------------------------------

def test_info_with_arch(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_CC_VERSION", "fake-nvcc 9.9 (cli test)")
    monkeypatch.setenv("MORI_JIT_EXTRA_FLAGS", "-DX=1")
    monkeypatch.setenv("MORI_JIT_TYPO", "1")
    rc, out, err = run(capsys, "info", *ARCH)
    assert rc == 0 and err == ""
    assert re.search(r"^arch:\s+sm_90a \(from --arch", out, re.M)
    assert f"compiler:    {fake_cc.nvcc}" in out
    assert "fake-nvcc 9.9 (cli test)" in out  # the full signature
    assert f"source root: {REPO} (checkout)" in out
    assert f"cache dir:   {cache.cache_root()}" in out
    assert f"MORI_JIT_CACHE_DIR={cache.cache_root()}" in out and "MORI_JIT_EXTRA_FLAGS=-DX=1" in out
    assert "MORI_JIT_NVCC=" in out and "unrecognised MORI_* variables (ignored): MORI_JIT_TYPO" in out
    assert "example_axpy" in out and "generated headers: up to date" in out


def test_info_source_root_from_env(fake_cc, capsys, src_copy):
    rc, out, _ = run(capsys, "info", "--arch", "gfx90a")
    assert rc == 0 and f"source root: {src_copy} (MORI_JIT_SOURCE_ROOT)" in out
    assert f"compiler:    {fake_cc.hipcc}" in out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_info_without_any_arch_says_so(fake_cc, capsys):
    rc, out, err = run(capsys, "info")
    assert rc == 0 and err == ""
    assert "(none resolvable:" in out and "--arch" in out
    assert f"nvcc:        {fake_cc.nvcc}" in out and f"hipcc:       {fake_cc.hipcc}" in out
    assert f"precompile:  builds for sm_90a (from the nvcc at {fake_cc.nvcc}" in out


def test_info_arch_from_env(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("MORI_JIT_ARCH", "gfx942")
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "gfx942 (from MORI_JIT_ARCH" in out


def test_render(fake_cc, capsys):
    rc, out, err = run(capsys, "render", "example_axpy", *ARCH, "--set", "blockNum=7", "dtype=fp32", "vecElems=4")
    tc = make_toolchain("sm_90a")
    cfg = AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4, blockNum=7)
    assert rc == 0 and err == ""
    assert out == AXPY.render_source(cfg, tc)
    assert "AxpyCfg{.dtype=AxpyDType::Fp32, .vecElems=4, .blockNum=7}" in out
    assert AXPY.entry_name(cfg) in out and '#include "platform/nvidia.hpp"' in out


def test_render_set_repeated_and_torch_dtype(fake_cc, capsys):
    rc, out, _ = run(capsys, "render", "example_axpy", "--arch", "gfx90a", "--set", "vecElems=4",
                     "--set", "dtype=torch.float32")
    assert rc == 0 and ".dtype=AxpyDType::Fp32" in out and '#include "platform/amd.hpp"' in out


def test_render_and_describe_need_no_compiler(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MORI_JIT_NVCC", str(tmp_path / "absent"))
    rc, out, _ = run(capsys, "render", "example_axpy", *ARCH)
    assert rc == 0 and "AxpyCfg{}" in out
    rc, out, _ = run(capsys, "describe", "example_axpy", *ARCH)
    assert rc == 0 and json.loads(out)["spec"] == "example_axpy"


def test_key(fake_cc, capsys):
    rc, out, err = run(capsys, "key", "example_axpy", *ARCH)
    tc = make_toolchain("sm_90a")
    assert rc == 0 and err == ""
    assert out.strip() == resolve(AXPY, AxpyCfg(), tc, fresh_include_hash=True).key
    assert re.fullmatch(r"[0-9a-f]{64}\n", out)
    rc, out2, _ = run(capsys, "key", "example_axpy", *ARCH, "--set", "blockNum=7")
    assert rc == 0 and out2 != out
    assert out2.strip() == resolve(AXPY, AxpyCfg(blockNum=7), tc, fresh_include_hash=True).key


def test_describe(fake_cc, capsys):
    rc, out, err = run(capsys, "describe", "example_axpy", *ARCH, "--set", "blockSize=128")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    cfg = AxpyCfg(blockSize=128)
    assert doc["spec"] == "example_axpy" and doc["arch"] == "sm_90a"
    assert doc["entry"] == AXPY.entry_name(cfg)
    assert doc["cfg"] == {"dtype": "Bf16", "vecElems": 8, "blockSize": 128, "blockNum": 264}
    assert doc["schema"] == request_schema(AxpyCfg)
    assert doc["geometry"] == {"grid": [264, 1, 1], "block": [128, 1, 1], "shared_bytes": 0}
    assert doc["rendered_cfg"] == "AxpyCfg{.blockSize=128}"


def test_describe_every_spec(fake_cc, capsys):
    for spec in all_specs():
        rc, out, _ = run(capsys, "describe", spec.name, *ARCH)
        assert rc == 0 and json.loads(out)["entry"]


def test_compile_builds_then_hits(fake_cc, capsys):
    rc, out, err = run(capsys, "compile", "example_axpy", *ARCH, "--set", "blockNum=9")
    assert rc == 0 and err == ""
    path = out.strip()
    tc = make_toolchain("sm_90a")
    assert path == str(resolve(AXPY, AxpyCfg(blockNum=9), tc).path)
    assert cache.verify_entry(cache.cache_root() / path) is not None
    rc, out2, _ = run(capsys, "compile", "example_axpy", *ARCH, "--set", "blockNum=9")
    assert rc == 0 and out2 == out and len(fake_cc.compiles()) == 1


def test_precompile_targets_come_from_each_specs_hook(fake_cc):
    tc = make_toolchain("sm_90a")
    targets = precompile_targets(tc, {})
    assert [(s.name, c) for s, c in targets] == [(s.name, c) for s in all_specs() for c in s.precompile_cfgs(tc)]
    axpy = [c for s, c in targets if s.name == "example_axpy"]
    assert {c.dtype for c in axpy} == set(AxpyDType)
    assert all(c.vecElems * (2 if c.dtype is AxpyDType.Bf16 else 4) == 16 for c in axpy)
    others = [(s, c) for s, c in targets if s.name != "example_axpy"]
    assert others and all(c == s.default_cfg(tc) for s, c in others)


def test_precompile_progress_then_all_hits(fake_cc, capsys):
    rc, out, err = run(capsys, "precompile", *ARCH, "-j", "2")
    assert rc == 0, err
    tc = make_toolchain("sm_90a")
    targets = precompile_targets(tc, {})
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert len(lines) == len(targets)
    for spec, cfg in targets:
        line = next(ln for ln in lines if f" {spec.entry_name(cfg)} " in ln)
        assert re.search(r"\bcompiled\s+\d+\.\d\ds$", line), line
    assert f"{len(targets)} compiled, 0 hit, 0 failed" in out
    assert len(cache.list_entries()) == len(targets)
    rc, out, _ = run(capsys, "precompile", *ARCH)
    assert rc == 0 and f"0 compiled, {len(targets)} hit, 0 failed" in out
    assert all(re.search(r"\bhit\s+\d+\.\d\ds$", ln) for ln in out.splitlines() if ln.startswith("["))


def test_precompile_failure_reports_every_kernel_and_one_error_line(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_CC_FAIL", "fatal error: platform.hpp: No such file")
    rc, out, err = run(capsys, "precompile", *ARCH)
    n = len(precompile_targets(make_toolchain("sm_90a"), {}))
    assert_one_line_error(rc, err, f"{n} of {n} kernels failed to build")
    status_lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert len(status_lines) == n and all(" FAILED " in ln and "No such file" in ln for ln in status_lines)


def test_precompile_ep_incomplete_request_is_one_line(fake_cc, capsys):
    rc, _, err = run(capsys, "precompile", *ARCH, "--ep", "world_size=8")
    assert_one_line_error(rc, err, "hidden_dim")


def test_cache_path_ls_verify_clear(fake_cc, capsys):
    rc, out, _ = run(capsys, "cache", "path")
    assert rc == 0 and out.strip() == str(cache.cache_root())
    rc, out, _ = run(capsys, "cache", "ls")
    assert rc == 0 and out.startswith("0 entries")
    assert run(capsys, "compile", "example_axpy", *ARCH)[0] == 0
    assert run(capsys, "compile", "example_axpy", "--arch", "gfx90a")[0] == 0
    rc, out, _ = run(capsys, "cache", "ls")
    assert rc == 0 and "2 entries" in out and sum(ln.startswith("example_axpy ") for ln in out.splitlines()) == 2
    assert "sm_90a_none/kernel.mori_example_axpy" in out
    rc, out, err = run(capsys, "cache", "verify")
    assert rc == 0 and err == "" and "2 ok, 0 corrupt" in out
    # damage one entry: reported, not deleted; --remove deletes it
    victim = cache.list_entries()[0]
    (victim / json.loads((victim / cache.META_NAME).read_text())["binary"]).write_bytes(b"x")
    rc, out, err = run(capsys, "cache", "verify")
    assert_one_line_error(rc, err, "1 corrupt cache entries")
    assert f"corrupt  {victim.relative_to(cache.cache_root())}" in out and victim.exists()
    rc, out, _ = run(capsys, "cache", "verify", "--remove")
    assert rc == 0 and "(1 removed)" in out and not victim.exists()
    # clear removes everything of ours, with the count, and leaves foreign files alone, listed
    (cache.cache_root() / "README.mine").write_text("not ours")
    (cache.cache_root() / "tmp" / "leftover").mkdir(parents=True, exist_ok=True)
    rc, out, _ = run(capsys, "cache", "clear")
    assert rc == 0 and f"removed 1 entries, 2 bookkeeping files from {cache.cache_root()}; left 2 items" in out
    assert "left     README.mine: not made by mori-jit" in out and "left     tmp/leftover: not made" in out
    assert cache.list_entries() == [] and (cache.cache_root() / "tmp" / "leftover").is_dir()
    assert (cache.cache_root() / "README.mine").exists()


def test_cache_verify_reports_meta_problems(fake_cc, capsys):
    assert run(capsys, "compile", "example_axpy", *ARCH)[0] == 0
    entry = cache.list_entries()[0]
    (entry / cache.META_NAME).write_text("[1, 2]")
    rc, out, err = run(capsys, "cache", "verify")
    assert rc == 1 and "meta.json is not a JSON object" in out


# -- bad input: non-zero, one line, no traceback --------------------------------------------------

@pytest.mark.parametrize("argv,fragment", [
    (["render", "nope", *ARCH], "unknown spec 'nope'; known specs: "),
    (["key", "example_axpy", *ARCH, "--set", "bogus=1"], "valid fields: dtype, vecElems, blockSize, blockNum"),
    (["compile", "example_axpy", *ARCH, "--set", "vecElems=3"], "invalid AxpyCfg"),
    (["render", "example_axpy", *ARCH, "--set", "dtype=fp64"],
     "AxpyCfg.dtype: 'fp64' is not an AxpyDType; allowed: Bf16, Fp32"),
    (["render", "example_axpy", *ARCH, "--set", "blockNum=lots"], "AxpyCfg.blockNum"),
    (["render", "example_axpy", *ARCH, "--set", "blockNum"], "--set expects FIELD=VALUE"),
    (["describe", "ep_dispatch", *ARCH, "--set", "hiddenDim=7"], "multiple of 16"),
    (["render", "example_axpy", "--arch", "sm_9"], "arch 'sm_9' is not supported"),
    (["info", "--arch", "rdna"], "arch 'rdna' is not supported"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "required"),
    (["render"], "required: spec"),
    (["cache", "zap"], "invalid choice: 'zap'"),
    (["precompile", "-j", "many"], "-j/--jobs: expected an int >= 1"),
])
def test_bad_input_one_line(fake_cc, capsys, argv, fragment):
    rc, _, err = run(capsys, *argv)
    assert_one_line_error(rc, err, fragment)


def test_usage_errors_exit_2_and_input_errors_exit_1(fake_cc, capsys):
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "render", "nope", *ARCH)[0] == 1


def test_no_compiler_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MORI_JIT_NVCC", str(tmp_path / "nvcc-missing"))
    for verb in ("key", "compile"):
        rc, _, err = run(capsys, verb, "example_axpy", *ARCH)
        assert_one_line_error(rc, err, "MORI_JIT_NVCC=")
    rc, _, err = run(capsys, "precompile", *ARCH)
    assert_one_line_error(rc, err, "is not an executable file")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_no_arch_is_one_line(fake_cc, capsys):
    for argv in (["compile", "example_axpy"], ["render", "example_axpy"]):
        rc, _, err = run(capsys, *argv)
        assert_one_line_error(rc, err, "pass --arch")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_precompile_without_arch_or_gpu_builds_for_the_installed_compiler(no_compilers, fake_cc, capsys,
                                                                          monkeypatch):
    monkeypatch.setenv("FAKE_CC_FAIL", "error: stop")  # the arch chosen is the point, not the build
    n = len(precompile_targets(make_toolchain("sm_90a"), {}))
    rc, out, err = run(capsys, "precompile")
    assert out.startswith(f"precompiling {n} kernels for sm_90a with {fake_cc.nvcc}"), out
    monkeypatch.delenv("MORI_JIT_NVCC")
    n = len(precompile_targets(make_toolchain("gfx90a"), {}))  # (no internode kernels: no AMD transport)
    rc, out, err = run(capsys, "precompile")
    assert out.startswith(f"precompiling {n} kernels for gfx90a with {fake_cc.hipcc}"), out
    monkeypatch.delenv("MORI_JIT_HIPCC")
    rc, out, err = run(capsys, "precompile")
    assert_one_line_error(rc, err, "no nvcc found")
    assert "CUDA toolkit" in err and "apt-get install hipcc" in err and "pass --arch" in err
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "precompile:  has no compiler to use" in out
    assert re.search(r"^nvcc: +\(missing: no nvcc found .*CUDA toolkit", out, re.M), out


def test_compile_error_is_one_line_with_the_compiler_message(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("FAKE_CC_FAIL", "note: in TU\nkernel.hip(3): error: expected a ';'\n1 error detected")
    rc, out, err = run(capsys, "compile", "example_axpy", *ARCH)
    assert_one_line_error(rc, err, "compiling example_axpy failed (exit 1): kernel.hip(3): error: expected a ';'")
    assert "MORI_JIT_KEEP_FAILED=1" in err and out == ""
    monkeypatch.setenv("MORI_JIT_KEEP_FAILED", "1")
    rc, _, err = run(capsys, "compile", "example_axpy", *ARCH)
    assert_one_line_error(rc, err, "source kept at ")
    kept = re.search(r"source kept at (\S+);", err).group(1)
    assert os.path.isfile(kept)


def test_verbose_2_shows_the_traceback(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("MORI_JIT_VERBOSE", "2")
    rc, _, err = run(capsys, "render", "nope", *ARCH)
    assert rc == 1 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("mori-jit: error: ")


def test_help_exits_0(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "precompile" in out and "cache" in out


# -- entry points --------------------------------------------------------------------------------

def test_python_dash_m_entry_point(fake_cc):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "mori_jit", "key", "example_axpy", *ARCH], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and re.fullmatch(r"[0-9a-f]{64}\n", p.stdout), p.stderr
    p = subprocess.run([sys.executable, "-m", "mori_jit", "render", "nope", *ARCH], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("mori-jit: error: unknown spec") and p.stderr.count("\n") == 1


@pytest.mark.skipif(shutil.which("mori-jit") is None, reason="the console script is not installed")
def test_console_script(fake_cc):
    p = subprocess.run(["mori-jit", "cache", "path"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == str(cache.cache_root())


# -- start-up: the verbs that only render, key or list need no torch -------------------------------

@pytest.mark.parametrize("argv", [
    ["render", "ep_combine", *ARCH, "--set", "dtype=torch.float32"],
    ["key", "example_axpy", *ARCH],
    ["describe", "ep_dispatch", *ARCH],
    ["cache", "ls"],
])
def test_verbs_without_torch_do_not_import_it(fake_cc, argv):
    code = ("import sys; from mori_jit.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules, 'numpy' in sys.modules); sys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "False False", f"{argv[0]} imported torch or numpy"


def test_ep_package_names_load_on_first_use():
    code = ("import sys, mori_jit.ops.ep as ep; before = 'torch' in sys.modules; "
            "cfg = ep.EpDispatchCombineConfig; print(before, 'torch' in sys.modules, cfg.__module__)")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["False", "True", "mori_jit.ops.ep.config"], p.stderr
    import mori_jit.ops.ep as ep
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ep.Nope  # noqa: B018


def test_warnings_during_a_failing_command_keep_the_error_one_line(fake_cc, capsys, monkeypatch):
    import warnings

    import mori_jit.cli as cli

    def warn_then_fail(args):
        warnings.warn("Failed to initialize NumPy: No module named 'numpy'", UserWarning)
        raise cli.CliError("it failed")

    monkeypatch.setattr(cli, "cmd_render", warn_then_fail)
    rc, _, err = run(capsys, "render", "example_axpy", *ARCH)
    assert_one_line_error(rc, err, "it failed")
    monkeypatch.setenv("MORI_JIT_VERBOSE", "1")
    rc, _, err = run(capsys, "render", "example_axpy", *ARCH)
    assert rc == 1 and err.splitlines()[0] == "mori-jit: warning: Failed to initialize NumPy: No module named 'numpy'"


def test_warnings_after_success_are_one_line_each(fake_cc, capsys, monkeypatch):
    import warnings

    import mori_jit.cli as cli
    real = cli.cmd_render

    def warn_then_render(args):
        warnings.warn("first\nwarning", UserWarning)
        return real(args)

    monkeypatch.setattr(cli, "cmd_render", warn_then_render)
    rc, out, err = run(capsys, "render", "example_axpy", *ARCH)
    assert rc == 0 and "mori_example_axpy" in out and err == "mori-jit: warning: first warning\n"
