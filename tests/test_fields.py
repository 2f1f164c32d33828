"""Cfg dataclasses are the one list of fields: render, describe, schema and apply_request all follow them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mori_jit.examples.axpy_spec import AxpyCfg, AxpyDType
from mori_jit.jit.fields import (CEnum, ConfigError, apply_request, cfg_fields, coerce_field, cpp_struct,
                                 describe, render_cfg, request_schema)
from mori_jit.ops.ep.backends.hip.intranode.cfg import COMBINE, DISPATCH, EpCfg, EpDType, make_ep_cfg


# -- render: only non-default fields, in declaration order ----------------------------------------

def test_render_default_cfg_is_empty_initializer():
    assert render_cfg(AxpyCfg()) == "AxpyCfg{}"
    assert render_cfg(EpCfg()) == "EpCfg{}"


def test_render_only_non_default_fields_in_declaration_order():
    cfg = EpCfg(maxRecv=4096, hiddenDim=2048)  # keyword order must not matter
    assert render_cfg(cfg) == "EpCfg{.hiddenDim=2048, .maxRecv=4096}"


def test_render_enum_and_bool_values():
    cfg = EpCfg(dtype=EpDType.Fp8, useWeights=False)
    assert render_cfg(cfg) == "EpCfg{.dtype=EpDType::Fp8, .useWeights=false}"
    assert render_cfg(AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4)) == "AxpyCfg{.dtype=AxpyDType::Fp32, .vecElems=4}"


def test_render_value_equal_to_default_is_not_rendered():
    assert render_cfg(AxpyCfg(blockNum=264)) == "AxpyCfg{}"  # 264 is the default


def test_cpp_struct_mirrors_fields_and_defaults():
    text = cpp_struct(EpCfg)
    for fi in cfg_fields(EpCfg):
        assert f" {fi.name} = " in text
    assert "EpDType dtype = EpDType::Bf16;" in text
    assert "bool useWeights = true;" in text
    assert "int hiddenDim = 7168;" in text


# -- describe / schema ------------------------------------------------------------------------------

def test_describe_every_field_in_order_enums_by_name():
    d = describe(EpCfg(dtype=EpDType.Fp32))
    assert list(d) == [f.name for f in dataclasses.fields(EpCfg)]
    assert d["dtype"] == "Fp32" and d["hiddenDim"] == 7168 and d["useWeights"] is True


def test_request_schema_lists_kind_default_and_choices():
    schema = {e["name"]: e for e in request_schema(EpCfg)}
    assert list(schema) == [f.name for f in dataclasses.fields(EpCfg)]
    assert schema["dtype"] == {"name": "dtype", "kind": "EpDType", "default": "Bf16",
                               "choices": ["Bf16", "Fp32", "Fp8", "Fp4x2"]}
    assert schema["useWeights"]["kind"] == "bool" and "choices" not in schema["useWeights"]
    assert schema["hiddenDim"] == {"name": "hiddenDim", "kind": "int", "default": 7168}


def test_cfg_fields_rejects_unsupported_field_kinds():
    @dataclasses.dataclass(frozen=True)
    class Bad:
        x: float = 1.0

    with pytest.raises(TypeError, match="Bad.x"):
        cfg_fields(Bad)


# -- apply_request --------------------------------------------------------------------------------

def test_apply_request_unknown_field_lists_valid_fields():
    with pytest.raises(ConfigError) as ei:
        apply_request(EpCfg(), {"hidden": 1024})
    msg = str(ei.value)
    assert "'hidden'" in msg
    for f in dataclasses.fields(EpCfg):
        assert f.name in msg


@pytest.mark.parametrize("value", ["Fp32", "fp32", "FP32", EpDType.Fp32, 1, torch.float32, "torch.float32"])
def test_apply_request_enum_by_name_int_and_torch_dtype(value):
    assert apply_request(EpCfg(), {"dtype": value}).dtype is EpDType.Fp32


def test_apply_request_torch_byte_dtypes_map_to_ep_byte_tags():
    assert apply_request(EpCfg(), {"dtype": torch.float8_e4m3fn}).dtype is EpDType.Fp8
    assert apply_request(EpCfg(), {"dtype": torch.uint8}).dtype is EpDType.Fp4x2
    assert apply_request(AxpyCfg(vecElems=4), {"dtype": torch.bfloat16}).dtype is AxpyDType.Bf16


def test_apply_request_coerces_numeric_strings_and_bools():
    cfg = apply_request(EpCfg(), {"hiddenDim": "2048", "blockNum": "0x20", "useWeights": "false"})
    assert (cfg.hiddenDim, cfg.blockNum, cfg.useWeights) == (2048, 32, False)
    assert apply_request(EpCfg(), {"useWeights": 0}).useWeights is False


@pytest.mark.parametrize("name,value,fragment", [
    ("dtype", "fp16", "EpCfg.dtype"),
    ("dtype", torch.float16, "allowed"),
    ("hiddenDim", "12x", "EpCfg.hiddenDim"),
    ("hiddenDim", True, "bool"),
    ("useWeights", 2, "EpCfg.useWeights"),
    ("hiddenDim", 1.5, "not an int"),
])
def test_apply_request_bad_values_name_the_field(name, value, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        apply_request(EpCfg(), {name: value})


def test_apply_request_runs_the_dataclass_validation():
    with pytest.raises(ConfigError, match="invalid"):
        apply_request(AxpyCfg(), {"vecElems": 3})


def test_apply_request_returns_a_new_value_and_keeps_the_base():
    base = EpCfg()
    new = apply_request(base, {"hiddenDim": 2048})
    assert base.hiddenDim == 7168 and new.hiddenDim == 2048 and new != base


def test_cenum_coerce_rejects_unknown_and_lists_members():
    with pytest.raises(ConfigError) as ei:
        AxpyDType.coerce("fp64")
    assert str(ei.value) == "'fp64' is not an AxpyDType; allowed: Bf16, Fp32 (a name in any case, or its number: 0, 1)"
    assert isinstance(AxpyDType.Bf16, CEnum) and AxpyDType.coerce(0) is AxpyDType.Bf16


def test_coerce_field_owner_prefix():
    fi = next(f for f in cfg_fields(AxpyCfg) if f.name == "blockNum")
    with pytest.raises(ConfigError, match=r"^AxpyCfg\.blockNum:"):
        coerce_field(fi, "many", "AxpyCfg")
    fi = next(f for f in cfg_fields(AxpyCfg) if f.name == "dtype")  # the field, the value and the allowed ones
    with pytest.raises(ConfigError, match=r"^AxpyCfg\.dtype: 7 is not an AxpyDType; allowed: Bf16, Fp32 \("):
        coerce_field(fi, 7, "AxpyCfg")


# -- EpCfg validity: errors name the rule and the values --------------------------------------------

@pytest.mark.parametrize("kwargs,rule", [
    ({"hiddenDim": 7}, "token bytes (hiddenDim * element bytes) must be a multiple of 16"),
    ({"worldSize": 9}, "worldSize must be <= 8"),
    ({"worldSize": 0}, "worldSize must be >= 1"),
    ({"numExpertPerToken": 65}, "numExpertPerToken (topk) must fit in one wavefront/warp"),
    ({"worldSize": 8, "waveSize": 32, "numExpertPerToken": 33}, "numExpertPerToken (topk) must fit"),
    ({"maxRecv": 100}, "maxRecv must be 0 or cover the worst case worldSize*maxTokPerRank"),
    ({"waveSize": 48}, "waveSize must be 32 or 64"),
    ({"warpPerBlock": 17}, "warpPerBlock*waveSize must be <= 1024"),
    ({"blockNum": 0}, "blockNum must be >= 1"),
])
def test_ep_cfg_invalid_names_rule_and_values(kwargs, rule):
    with pytest.raises(ConfigError) as ei:
        EpCfg(**kwargs)
    msg = str(ei.value)
    assert rule in msg
    for k, v in kwargs.items():
        assert f"{k}={v}" in msg  # the offending values are in the message


def test_ep_cfg_lists_every_violated_rule():
    with pytest.raises(ConfigError) as ei:
        EpCfg(worldSize=9, hiddenDim=7, blockNum=0)
    msg = str(ei.value)
    assert "worldSize must be <= 8" in msg and "multiple of 16" in msg and "blockNum must be >= 1" in msg


def test_ep_token_alignment_depends_on_dtype():
    EpCfg(hiddenDim=16, dtype=EpDType.Fp8)  # 16 bytes: fine
    with pytest.raises(ConfigError, match="multiple of 16"):
        EpCfg(hiddenDim=8 + 16, dtype=EpDType.Fp8)
    EpCfg(hiddenDim=8, dtype=EpDType.Bf16)  # 16 bytes: fine


def test_make_ep_cfg_combine_refuses_byte_dtypes():
    assert make_ep_cfg(DISPATCH, "gfx942", {"dtype": "Fp8"}).dtype is EpDType.Fp8
    with pytest.raises(ConfigError, match="cannot be summed"):
        make_ep_cfg(COMBINE, "gfx942", {"dtype": "Fp8"})


def test_make_ep_cfg_arch_sets_wave_size():
    assert make_ep_cfg(DISPATCH, "gfx942", {}).waveSize == 64
    assert make_ep_cfg(DISPATCH, "sm_90a", {}).waveSize == 32
