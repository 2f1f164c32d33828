"""The combine's fp8 wire (``quant_type``) on the internode kernels, on the CPU: the gate serves
``fp8_direct_cast`` and ``fp8_blockwise`` (float32 and UE8M0 scales) on both families and still
names what it refuses; the combine's EpNetCfg carries the wire (``combineQuant``,
``combineScaleBytes``: rendered, in the entry name and the key; an op without it renders as
before) and the dispatch's does not; the wire's rows size the combine regions; nvcc builds and
device-links every such combine kernel, whose PTX casts with the hardware conversion. The GPU runs
(golden, parity with the torch backend bit for bit, graph replay) are in
``tests/test_gpu_ep_combine_quant.py``."""
from __future__ import annotations

import re

import pytest
import torch

from jit_helpers import STT_FUNC, elf_symbols, toolchain_or_skip
from test_ep_internode_cpu import _fake_nvshmem
from test_ep_net_split_cpu import _ptx
from mori_jit.jit.compile import build, resolve
from mori_jit.jit.devlib import DeviceLibraryError
from mori_jit.jit.fields import ConfigError
from mori_jit.jit.nvshmem import NVSHMEM
from mori_jit.jit.toolchain import make_toolchain
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, DISPATCH
from mori_jit.ops.ep.backends.hip.common.consts import EpDType
from mori_jit.ops.ep.backends.hip.internode.cfg import EpCombineQuant, EpNetCfg, NetWireBytes, net_region_bytes
from mori_jit.ops.ep.backends.hip.internode.kernels import net_regions
from mori_jit.ops.ep.backends.hip.internode.specs import net_spec
from mori_jit.ops.ep.backends.hip.internode.variants import net_variants
from mori_jit.ops.ep.backends.hip.variants import hip_gaps

FAMILIES = ("v2_ll", "v2")
#: (quant_type, combine_scale_type_size, the combine's entry-name mark)
WIRES = [("fp8_direct_cast", 4, "_w8"), ("fp8_blockwise", 4, "_w8b4"), ("fp8_blockwise", 1, "_w8b1")]
_WIRE_IDS = [f"{q}-{s}" for q, s, _ in WIRES]
H = 256


def _cfg(family="v2_ll", quant="none", scale_bytes=4, **kw):
    fields = dict(rank=0, world_size=8, gpu_per_node=4, internode_kernel=family, hidden_dim=H,
                  max_num_inp_token_per_rank=64, num_experts_per_rank=2, num_experts_per_token=4, quant_type=quant,
                  combine_scale_type_size=scale_bytes, dispatch_block_num=8, combine_block_num=8)
    return EpDispatchCombineConfig(**{**fields, **kw})


# -- the gate --------------------------------------------------------------------------------------

@pytest.mark.parametrize("quant, scale_bytes, _mark", WIRES, ids=_WIRE_IDS)
@pytest.mark.parametrize("family", FAMILIES + ("auto",))
def test_the_gate_serves_the_fp8_wire_on_every_internode_family(family, quant, scale_bytes, _mark):
    assert hip_gaps(_cfg(family, quant, scale_bytes), "sm_90a") == []
    assert hip_gaps(_cfg(family, quant, scale_bytes, data_type=torch.float32), "sm_90a") == []


@pytest.mark.parametrize("quant", ["fp4_blockwise", "fp4_blockwise_fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_gate_still_names_the_wires_it_refuses(family, quant):
    (gap,) = hip_gaps(_cfg(family, quant), "sm_90a")
    assert gap == (f"quant_type={quant!r} (mori's combine-wire quantization; this backend serves 'none', "
                   f"'fp8_direct_cast', 'fp8_blockwise')")
    assert not any("internode" in g for g in hip_gaps(_cfg(family, "fp8_blockwise"), "sm_90a"))


# -- the config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("quant, scale_bytes, _mark", WIRES, ids=_WIRE_IDS)
def test_the_combine_cfg_carries_the_wire_and_the_dispatch_cfg_does_not(quant, scale_bytes, _mark):
    var = net_variants(_cfg("auto", quant, scale_bytes, max_num_inp_token_per_rank=128,
                            internode_auto_ll_max_tokens=32), "sm_90a", 132)
    assert set(var.families) == set(FAMILIES)
    want = EpCombineQuant.coerce(quant)
    assert all((c.combineQuant, c.combineScaleBytes) == (want, scale_bytes) for c in var.combine)
    assert all(d.combineQuant == EpCombineQuant.Plain for d in var.dispatch)


@pytest.mark.parametrize("kw, match", [
    (dict(combineQuant=EpCombineQuant.Fp8Block, hiddenDim=192), "Fp8Block also hiddenDim a multiple of 128"),
    (dict(combineQuant=EpCombineQuant.Fp8Block, combineScaleBytes=2), "combineScaleBytes 4 or 1"),
    (dict(combineQuant=EpCombineQuant.Fp8Direct, dtype=EpDType.Fp8), "combineQuant needs dtype Bf16 or Fp32"),
])
def test_a_bad_wire_names_the_rule(kw, match):
    with pytest.raises(ConfigError, match=match):
        EpNetCfg(**{"worldSize": 4, "gpuPerNode": 2, "hiddenDim": H, **kw})


def test_the_wire_sizes_the_combine_regions():
    plain = EpNetCfg(worldSize=4, gpuPerNode=2, hiddenDim=H, maxTokPerRank=64, numExpertPerToken=4)
    direct = EpNetCfg(worldSize=4, gpuPerNode=2, hiddenDim=H, maxTokPerRank=64, numExpertPerToken=4,
                      combineQuant=EpCombineQuant.Fp8Direct)
    block = EpNetCfg(worldSize=4, gpuPerNode=2, hiddenDim=H, maxTokPerRank=64, numExpertPerToken=4,
                     combineQuant=EpCombineQuant.Fp8Block, combineScaleBytes=1)
    # one byte per element; blockwise also a 32-bit word per 128 elements, padded to 16 bytes
    assert (NetWireBytes(plain), NetWireBytes(direct), NetWireBytes(block)) == (2 * H, H, H + 16)
    for comb in (direct, block):
        sizes = net_region_bytes(plain, comb, FAMILIES)
        base = net_region_bytes(plain, plain, FAMILIES)
        wire = {"comb_recv": 4 * 64, "comb_stage": 4 * 64, "comb_relay": 4 * 64}  # rows of each
        assert {n for n in sizes if sizes[n] != base[n]} == set(wire)
        assert all(sizes[n] == rows * NetWireBytes(comb) for n, rows in wire.items())


# -- specs, names, keys ----------------------------------------------------------------------------

@pytest.mark.parametrize("quant, scale_bytes, mark", WIRES, ids=_WIRE_IDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_wire_is_its_own_combine_kernel(family, quant, scale_bytes, mark, fake_cc, monkeypatch, tmp_path):
    _fake_nvshmem(monkeypatch, tmp_path)
    tc = make_toolchain("sm_90a")
    plain, wired = net_variants(_cfg(family), "sm_90a", 132), net_variants(_cfg(family, quant, scale_bytes), "sm_90a", 132)
    assert wired.dispatch == plain.dispatch and net_regions(wired) != net_regions(plain)
    spec = net_spec(family, COMBINE)
    for p, c in zip(plain.combine, wired.combine):
        assert spec.entry_name(c) == spec.entry_name(p) + mark
        src = spec.render_source(c, tc)
        assert f".combineQuant=EpCombineQuant::{c.combineQuant.name}" in src
        assert (".combineScaleBytes=1" in src) == (scale_bytes == 1)  # (4 is the default: not rendered)
        assert "combineQuant" not in spec.render_source(p, tc)  # an op without the wire renders as before
        assert resolve(spec, c, tc).key != resolve(spec, p, tc).key
    disp = net_spec(family, DISPATCH)
    assert [resolve(disp, c, tc).key for c in wired.dispatch] == [resolve(disp, c, tc).key for c in plain.dispatch]


# -- a real build ----------------------------------------------------------------------------------

def _nvcc_with_nvshmem():
    tc = toolchain_or_skip("sm_90a")
    try:
        NVSHMEM.locate()
    except DeviceLibraryError as e:
        pytest.skip(f"NVSHMEM absent: {e}")
    return tc


#: (family, quant_type, scale bytes, combine dtype): both families under each wire, and a float32
#: combine (32 vectors to a scale block: the whole warp)
BUILDS = [(f, q, s, torch.bfloat16) for f in FAMILIES for q, s, _ in WIRES] + [("v2", "fp8_blockwise", 1, torch.float32)]


@pytest.mark.parametrize("family, quant, scale_bytes, dtype", BUILDS,
                         ids=[f"{f}-{q}-{s}-{str(d)[6:]}" for f, q, s, d in BUILDS])
def test_real_nvcc_builds_and_device_links_every_fp8_wire_combine(family, quant, scale_bytes, dtype):
    tc = _nvcc_with_nvshmem()
    var = net_variants(_cfg(family, quant, scale_bytes, data_type=dtype), "sm_90a", 132)
    spec = net_spec(family, COMBINE)
    for c in dict.fromkeys(var.combine):  # (one geometry: the buckets share a binary)
        symbols = elf_symbols(build(spec, c, tc).read_binary())
        assert symbols.get(spec.entry_name(c)) == STT_FUNC, spec.entry_name(c)
        assert "nvshmemi_device_lib_version_d" in symbols


@pytest.mark.parametrize("family", FAMILIES)
def test_real_nvcc_builds_the_split_halves_of_an_fp8_wire_combine(family):
    tc = _nvcc_with_nvshmem()
    var = net_variants(_cfg(family, "fp8_blockwise", 4, split_send_recv=True), "sm_90a", 132)
    spec = net_spec(family, COMBINE)
    halves = [c for c in dict.fromkeys(c for s, c in var.requests() if s is spec) if c.phase.name != "Whole"]
    assert len(halves) == 2
    for c in halves:
        assert spec.entry_name(c).endswith(("_w8b4_send", "_w8b4_recv"))
        assert elf_symbols(build(spec, c, tc).read_binary()).get(spec.entry_name(c)) == STT_FUNC


#: sm_90a's packed conversions: two float32 values to e4m3 (the cast, plat::e4m3x4_from_f32) and
#: two e4m3 bytes to f16 (the decode, plat::f32x4_from_e4m3x4)
_CAST = r"cvt\.rn\.satfinite\.e4m3x2\.f32"
_DECODE = r"cvt\.rn\.f16x2\.e4m3x2"
#: the software conversion's mark (Fp8E4m3FromF32): the denormal trick adds 2^14 as a float
_SOFT = r"add\.f32\s+%f\d+, %f\d+, 0f46800000;"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fp8_wire_combine_uses_the_packed_hardware_conversions(family, tmp_path):
    """nvcc's PTX for sm_90a: the wire's combine kernel casts and decodes with the packed hardware
    conversions, never the software one; the plain combine has none of them."""
    tc = _nvcc_with_nvshmem()
    spec = net_spec(family, COMBINE)
    wired = _ptx(tc, spec, net_variants(_cfg(family, "fp8_direct_cast"), "sm_90a", 132).combine[0], tmp_path)
    plain = _ptx(tc, spec, net_variants(_cfg(family), "sm_90a", 132).combine[0], tmp_path)
    assert re.search(_CAST, wired) and re.search(_DECODE, wired) and not re.search(_SOFT, wired)
    assert not any(re.search(p, plain) for p in (_CAST, _DECODE, _SOFT))
