"""Settings: each variable declared once (type, default, doc), read at access time, bad values
named in the error, and ``mori-jit info`` listing every one from its declaration."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from mori_jit.cli import main
from mori_jit.jit import knobs
from mori_jit.ops.ep import knobs as ep_knobs

PKG = Path(knobs.__file__).resolve().parent.parent


def test_every_variable_is_declared_once_with_a_doc():
    settings = knobs.all_settings()
    names = [s.var for s in settings]
    assert len(names) == len(set(names)), names
    assert all(s.doc and s.attr and s.type_name for s in settings)
    assert [g.name for g in knobs.all_groups()][:4] == ["compiler", "source", "cache", "log"]


def test_the_ep_ops_settings_live_in_its_package():
    assert ep_knobs.ep in knobs.all_groups()
    assert {s.var for s in ep_knobs.ep.settings()} == {"MORI_EP_KERNEL_BACKEND", "MORI_EP_TIMEOUT_S", "MORI_EP_CFG_",
                                                      "MORI_EP_TEST_WORLD_SIZES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                                                      "MORI_EP_MASK_ON_TIMEOUT"}
    assert not any(s.var.startswith(("MORI_V2_", "MORI_EP_")) for g in (knobs.compiler, knobs.source, knobs.cache,
                                                                       knobs.log) for s in g.settings())


def test_values_are_read_at_access_time(monkeypatch, tmp_path):
    monkeypatch.delenv("MORI_JIT_ARCH", raising=False)
    assert knobs.compiler.arch is None
    monkeypatch.setenv("MORI_JIT_ARCH", "gfx942")
    assert knobs.compiler.arch == "gfx942"
    monkeypatch.setenv("MORI_JIT_ARCH", "")  # empty is unset
    assert knobs.compiler.arch is None
    monkeypatch.delenv("MORI_JIT_CACHE_DIR")
    assert knobs.cache.dir == Path.home() / ".mori" / "jit"
    monkeypatch.setenv("MORI_JIT_CACHE_DIR", str(tmp_path))
    assert knobs.cache.dir == tmp_path


@pytest.mark.parametrize("var, attr, text, value", [
    ("MORI_JIT_KEEP_FAILED", "keep_failed", "off", False),
    ("MORI_JIT_KEEP_FAILED", "keep_failed", "Yes", True),
    ("MORI_JIT_VERBOSE", "verbose", "2", 2),
    ("MORI_JIT_VERBOSE", "verbose", "true", 1),
    ("MORI_JIT_VERBOSE", "verbose", "no", 0),
    ("MORI_JIT_LOCK_TIMEOUT_S", "lock_timeout_s", "2.5", 2.5),
    ("MORI_JIT_EXTRA_FLAGS", "extra_flags", "-DA=1 '-DB=two words'", ("-DA=1", "-DB=two words")),
    ("MORI_JIT_DEVICE_NIC", "device_nic", "mlx5_0", "mlx5_0"),
])
def test_typed_values(monkeypatch, var, attr, text, value):
    monkeypatch.setenv(var, text)
    group = next(g for g in knobs.all_groups() if any(s.var == var for s in g.settings()))
    assert getattr(group, attr) == value


@pytest.mark.parametrize("var, attr, text, fragment", [
    ("MORI_JIT_LOCK_TIMEOUT_S", "lock_timeout_s", "soon", "MORI_JIT_LOCK_TIMEOUT_S='soon' is not a number"),
    ("MORI_JIT_LOCK_TIMEOUT_S", "lock_timeout_s", "-1", "MORI_JIT_LOCK_TIMEOUT_S='-1' must be > 0"),
    ("MORI_JIT_DEVICE_NIC", "device_nic", "a/b", "MORI_JIT_DEVICE_NIC='a/b': only letters, digits"),
    ("MORI_EP_TIMEOUT_S", "timeout_s", "0", "MORI_EP_TIMEOUT_S='0' must be > 0"),
])
def test_bad_values_name_the_variable(monkeypatch, var, attr, text, fragment):
    monkeypatch.setenv(var, text)
    group = next(g for g in knobs.all_groups() if any(s.var == var for s in g.settings()))
    with pytest.raises(ValueError, match=re.escape(fragment)):
        getattr(group, attr)


def test_prefix_family(monkeypatch):
    monkeypatch.setenv("MORI_EP_CFG_COMBINE_BLOCKNUM", "64")
    monkeypatch.setenv("MORI_EP_CFG_VECUNROLL", "")  # empty: skipped
    assert ep_knobs.ep.cfg_overrides == {"COMBINE_BLOCKNUM": "64"}
    family = ep_knobs.EpKnobs.cfg_overrides
    assert family.matches("MORI_EP_CFG_X") and not family.matches("MORI_EP_CFG_")
    assert family.label == "MORI_EP_CFG_* | MORI_V2_EP_*"


def test_the_ops_variables_share_one_prefix_and_read_moris_names_as_aliases(monkeypatch):
    ep = ep_knobs.EpKnobs
    assert all(s.var.startswith("MORI_EP_") for s in ep.settings(ep_knobs.ep) if s.var.startswith("MORI_"))
    assert not [s.var for s in knobs.all_settings() if s.var.startswith("MORI_") and
                not s.var.startswith(("MORI_JIT_", "MORI_EP_"))]
    monkeypatch.setenv("MORI_V2_KERNEL_BACKEND", "torch")  # mori's name
    assert ep_knobs.ep.kernel_backend == "torch" and ep.kernel_backend.is_set()
    monkeypatch.setenv("MORI_EP_KERNEL_BACKEND", "hip")  # the own name wins
    assert ep_knobs.ep.kernel_backend == "hip"
    monkeypatch.setenv("MORI_V2_EP_BLOCKNUM", "8")
    monkeypatch.setenv("MORI_V2_EP_VECUNROLL", "2")
    monkeypatch.setenv("MORI_EP_CFG_BLOCKNUM", "16")
    assert ep_knobs.ep.cfg_overrides == {"BLOCKNUM": "16", "VECUNROLL": "2"}
    monkeypatch.setenv("MORI_SOURCE_ROOT", "/nowhere")  # the framework's old names likewise
    assert str(knobs.source.root) == "/nowhere"
    monkeypatch.setenv("MORI_DEVICE_NIC", "a/b")  # a bad value names the variable that was set
    with pytest.raises(ValueError, match=r"MORI_DEVICE_NIC='a/b'.*read as MORI_JIT_DEVICE_NIC"):
        knobs.compiler.device_nic


def test_info_lists_every_setting_from_its_declaration(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("MORI_EP_CFG_BLOCKNUM", "32")
    assert main(["info", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("settings ("):]
    for g in knobs.all_groups():
        assert f"\n  {g.name}\n" in table
        for s in g.settings():
            assert re.search(rf"^    {re.escape(s.label)}\s+{s.type_name}\s+{re.escape(s.doc)}; default: "
                             rf"{re.escape(s.default_text())}$", table, re.M), s.var
    assert "    MORI_EP_CFG_BLOCKNUM=32" in out and "unrecognised" not in out


def test_no_module_reads_the_environment_but_knobs():
    readers = [p for p in PKG.rglob("*.py") if p.name != "knobs.py" and p != PKG / "jit" / "settings.py"
               and re.search(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[", p.read_text())]
    assert readers == []


def test_int_list_setting_parses_world_sizes_and_names_a_bad_value(monkeypatch):
    from mori_jit.ops.ep import knobs as ep_knobs

    assert ep_knobs.ep.test_world_sizes == (1, 2, 4, 8)
    monkeypatch.setenv("MORI_EP_TEST_WORLD_SIZES", "8, 2")
    assert ep_knobs.ep.test_world_sizes == (8, 2)
    for bad in ("two", "0", ","):
        monkeypatch.setenv("MORI_EP_TEST_WORLD_SIZES", bad)
        with pytest.raises(ValueError, match=f"MORI_EP_TEST_WORLD_SIZES={bad!r}"):
            ep_knobs.ep.test_world_sizes
