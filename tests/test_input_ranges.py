"""Out-of-range and wrongly typed input is refused with an error naming the field, the value and
what is allowed, before anything is compiled, written or sent (fake toolchain, CPU, gloo).

* int Cfg fields are C++ ``int``: a value beyond it never reaches a translation unit or a path;
* an arch or NIC with a trailing newline is not a name (``re.fullmatch``, not ``$``);
* ``precompile -j`` takes a count >= 1; ``precompile --ep`` refuses what the live op refuses and
  names ``num_cus`` for a bad CU count;
* the EP config applies one validity rule for every backend (row bytes, top-k, C++ int range);
* the op refuses a dict for its config and a routing that is not one.
"""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.distributed import run_distributed
from mori_jit.cli import main
from mori_jit.examples.axpy_spec import AXPY, AxpyCfg
from mori_jit.jit import cache
from mori_jit.jit.fields import ConfigError, render_cfg
from mori_jit.jit.toolchain import make_toolchain
from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
from mori_jit.ops.ep.backends.hip.intranode.cfg import EpCfg
from mori_jit.ops.ep.backends.hip.variants import ep_variants

ARCH = ["--arch", "sm_90a"]


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(rc, err, *fragments, status=1):
    assert rc == status and err.count("\n") == 1 and err.startswith("mori-jit: error: "), err
    for f in fragments:
        assert f in err, err


def _cache_files() -> list[str]:
    root = cache.cache_root()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# -- int fields are C++ ints ------------------------------------------------------------------------

@pytest.mark.parametrize("spec,field,value", [
    ("ep_dispatch", "maxTokPerRank", "2147483648"),
    ("ep_dispatch", "hiddenDim", "2147483648"),
    ("ep_combine", "numExpertPerRank", "4294967297"),
    ("example_axpy", "blockNum", "0x7fffffffffffffff"),
    ("example_axpy", "blockNum", "9" * 300),
    ("example_axpy", "blockNum", "-2147483649"),
])
def test_int_field_beyond_the_cpp_int_is_refused(fake_cc, capsys, spec, field, value):
    for verb in ("render", "compile"):
        rc, _, err = _cli(capsys, verb, spec, *ARCH, "--set", f"{field}={value}")
        _one_line(rc, err, f".{field}: ", "is outside the C++ int range [-2147483648, 2147483647]")
        assert "digits)" in err or len(err) < 300  # a 300-digit value is shortened
    assert _cache_files() == []


def test_cfg_built_directly_beyond_the_cpp_int_is_not_rendered(fake_cc):
    tc = make_toolchain("sm_90a")
    with pytest.raises(ConfigError, match=r"EpCfg.hiddenDim: 2147483648 is outside the C\+\+ int range"):
        render_cfg(EpCfg(hiddenDim=1 << 31))
    with pytest.raises(ConfigError, match=r"AxpyCfg.blockNum: 1099511627776 is outside"):
        AXPY.render_source(AxpyCfg(blockNum=1 << 40), tc)


# -- names are matched whole ------------------------------------------------------------------------

@pytest.mark.parametrize("verb", ["render", "compile", "key", "info"])
def test_arch_with_a_trailing_newline_is_refused(fake_cc, capsys, verb):
    argv = [verb] + ([] if verb == "info" else ["example_axpy"]) + ["--arch", "sm_90a\n"]
    rc, _, err = _cli(capsys, *argv)
    _one_line(rc, err, "argument --arch: arch 'sm_90a\\n' is not supported", status=2)  # (a bad option value)
    assert _cache_files() == []


def test_arch_from_the_environment_with_a_newline_is_refused(fake_cc, capsys, monkeypatch):
    monkeypatch.setenv("MORI_JIT_ARCH", "gfx90a\n")
    rc, _, err = _cli(capsys, "compile", "example_axpy")
    _one_line(rc, err, "arch 'gfx90a\\n' is not supported")
    assert _cache_files() == []


@pytest.mark.parametrize("nic", ["none\n", "ethé"])
def test_nic_outside_its_alphabet_is_refused(fake_cc, capsys, monkeypatch, nic):
    monkeypatch.setenv("MORI_JIT_DEVICE_NIC", nic)
    rc, _, err = _cli(capsys, "compile", "example_axpy", *ARCH)
    _one_line(rc, err, "MORI_JIT_DEVICE_NIC=", "only letters, digits")
    assert _cache_files() == []


# -- precompile ---------------------------------------------------------------------------------

@pytest.mark.parametrize("jobs", ["-3", "0", "many"])
def test_precompile_jobs_must_be_a_positive_count(fake_cc, capsys, jobs):
    rc, _, err = _cli(capsys, "precompile", *ARCH, "-j", jobs)
    _one_line(rc, err, "-j/--jobs: expected an int >= 1", status=2)
    assert _cache_files() == []


_EP = ["world_size=2", "hidden_dim=2048", "max_num_inp_token_per_rank=64", "num_experts_per_rank=2"]


@pytest.mark.parametrize("extra,fragments", [
    (["num_experts_per_token=8"], ["num_experts_per_token=8: more than the 4 experts"]),
    (["num_experts_per_token=2", "combine_mode=scatter"], ["the hip op does not support: combine_mode='scatter'"]),
    (["num_experts_per_token=2", "num_cus=0"], ["num_cus=0: expected the device's CU/SM count, an int >= 1"]),
    (["num_experts_per_token=2", "num_cus=-4"], ["num_cus=-4"]),
    (["num_experts_per_token=2", "hidden_dim=7"], ["hidden_dim=7: a dispatch row of torch.bfloat16 is 14 bytes"]),
])
def test_precompile_ep_refuses_what_the_live_op_refuses(fake_cc, capsys, extra, fragments):
    rc, _, err = _cli(capsys, "precompile", *ARCH, "--ep", *_EP, *extra)
    _one_line(rc, err, *fragments)
    assert "blockNum" not in err and "hiddenDim=7168" not in err  # no value the user never passed
    assert _cache_files() == []


def test_ep_variants_names_num_cus():
    cfg = EpDispatchCombineConfig(rank=0, world_size=2, hidden_dim=2048, max_num_inp_token_per_rank=64,
                                  num_experts_per_rank=2, num_experts_per_token=2)
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ConfigError, match=r"num_cus=.*: expected the device's CU/SM count"):
            ep_variants(cfg, "sm_90a", bad)


# -- one validity rule for every backend ------------------------------------------------------------

_BASE = dict(rank=0, world_size=2, hidden_dim=2048, max_num_inp_token_per_rank=64, num_experts_per_rank=2,
             num_experts_per_token=2)


@pytest.mark.parametrize("backend", ["torch", "hip"])
@pytest.mark.parametrize("change,fragment", [
    (dict(hidden_dim=7), "hidden_dim=7: a dispatch row of torch.bfloat16 is 14 bytes, not a multiple of 16"),
    (dict(hidden_dim=6, data_type=torch.float32), "hidden_dim=6: a dispatch row of torch.float32 is 24 bytes"),
    (dict(hidden_dim=24, dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16),
     "a dispatch row of torch.float8_e4m3fn is 24 bytes"),
    (dict(num_experts_per_token=5), "num_experts_per_token=5: more than the 4 experts"),
    (dict(hidden_dim=1 << 31), "hidden_dim=2147483648: above 2147483647"),
    (dict(max_num_inp_token_per_rank=1 << 31), "max_num_inp_token_per_rank=2147483648: above"),
])
def test_config_rule_is_the_same_for_every_backend(backend, change, fragment):
    with pytest.raises(ValueError, match="EpDispatchCombineConfig") as ei:
        EpDispatchCombineConfig(**{**_BASE, **change}, kernel_backend=backend)
    assert fragment in str(ei.value)


@pytest.mark.parametrize("legs,hidden", [
    (dict(data_type=torch.bfloat16), 8), (dict(data_type=torch.float32), 4),
    (dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16), 16),
    (dict(dispatch_data_type=torch.uint8, combine_data_type=torch.float32), 16),
])
def test_config_rule_accepts_rows_of_whole_vectors(legs, hidden):
    cfg = EpDispatchCombineConfig(**{**_BASE, "hidden_dim": hidden}, **legs)
    assert cfg.hidden_dim == hidden
    assert EpDispatchCombineConfig(**{**_BASE, "num_experts_per_token": 4}).num_experts == 4  # top-k = all


# -- the op's arguments -----------------------------------------------------------------------------

def test_op_refuses_a_dict_for_its_config():
    with pytest.raises(TypeError, match="cfg: expected an EpDispatchCombineConfig, got dict"):
        EpDispatchCombineOp(dict(_BASE))


def _routing_job(rank, ws):
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=64, max_num_inp_token_per_rank=4,
                                  num_experts_per_rank=2, num_experts_per_token=2, kernel_backend="torch")
    with EpDispatchCombineOp(cfg) as op:
        x = torch.randn(4, 64).to(torch.bfloat16)
        idx = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
        out, _, _, _, total, routing = op.dispatch(x, None, None, idx, return_routing=True)
        for bad in (object(), "routing", 3, {"num_tokens": 4}):
            with pytest.raises(ValueError, match="routing: expected the routing returned by this op's latest dispatch"):
                op.combine(out, routing=bad)
        y, _ = op.combine(out, routing=routing)  # a valid round works afterwards
        assert y.shape == (4, 64)


def test_op_refuses_a_routing_that_is_not_one():
    run_distributed(_routing_job, 1, timeout=120)
