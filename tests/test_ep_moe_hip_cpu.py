"""The ``hip`` backend's MoE features on the CPU: what the capability gate still refuses, the EpCfg
fields each feature sets (so its key), the arena regions it sizes, and the real compilers (nvcc for
``sm_90a``, Debian's hipcc for ``gfx90a``) building the kernels with each feature on. An op with no
feature asks for exactly the EpCfgs it asked for before (each feature is off in the default Cfg)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from jit_helpers import toolchain_or_skip
from mori_jit.jit.compile import build
from mori_jit.jit.toolchain import make_toolchain
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.cfg import EpCfg, region_bytes
from mori_jit.ops.ep.backends.hip.variants import ep_variants, hip_gaps, plan_requests

BASE = dict(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=16, num_experts_per_rank=4,
            num_experts_per_token=4)
#: every EpCfg field a MoE feature adds, all off by default
MOE_FIELDS = ("ids64", "scaleDim", "scaleTypeSize", "expertCounts", "routingReplay", "quantFp8Block128",
              "expertCapacity")


def _cfg(**fields) -> EpDispatchCombineConfig:
    return EpDispatchCombineConfig(**{**BASE, **fields})


def _variants(cfg, arch="sm_90a"):
    return ep_variants(cfg, arch, 132)


def test_a_plain_op_sets_no_moe_field():
    var = _variants(_cfg())
    defaults = EpCfg()
    for c in var.dispatch + var.combine:
        for f in MOE_FIELDS:
            assert getattr(c, f) == getattr(defaults, f), f


def test_int64_ids_are_a_dispatch_cfg_field_and_widen_out_idx():
    plain, wide = _variants(_cfg()), _variants(_cfg(index_dtype=torch.int64))
    assert hip_gaps(_cfg(index_dtype=torch.int64), "sm_90a") == []
    assert all(c.ids64 for c in wide.dispatch)
    assert wide.combine == plain.combine  # combine never reads ids: same binaries
    assert [dataclasses.replace(c, ids64=False) for c in wide.dispatch] == list(plain.dispatch)
    tc = make_toolchain("sm_90a")
    names = {spec.entry_name(c) for spec, c in plan_requests(_cfg(index_dtype=torch.int64), "sm_90a", 132)}
    assert any(n.startswith("mori_ep_dispatch") and n.endswith("_i64") for n in names)
    src = {spec.render_source(c, tc) for spec, c in wide.requests()} - {spec.render_source(c, tc)
                                                                          for spec, c in plain.requests()}
    assert src and all(".ids64=true" in s for s in src)  # the field is in the text, so in the key
    k, cap = BASE["num_experts_per_token"], 2 * BASE["max_num_inp_token_per_rank"]
    assert region_bytes(plain.dispatch[0], plain.combine[0])["out_idx"] == cap * k * 4
    assert region_bytes(wide.dispatch[0], wide.combine[0])["out_idx"] == cap * k * 8


@pytest.mark.parametrize("dtype,dim,size", [(torch.bfloat16, 2, 4), (torch.float8_e4m3fn, 3, 1),
                                            (torch.float32, 5, 2), (torch.bfloat16, 1, 8)])
def test_scales_are_dispatch_cfg_fields_with_their_own_region(dtype, dim, size):
    plain = _variants(_cfg(dispatch_data_type=dtype, combine_data_type=torch.bfloat16))
    scaled = _variants(_cfg(dispatch_data_type=dtype, combine_data_type=torch.bfloat16, scale_dim=dim,
                            scale_type_size=size))
    assert hip_gaps(_cfg(scale_dim=dim, scale_type_size=size), "sm_90a") == []
    assert all((c.scaleDim, c.scaleTypeSize) == (dim, size) for c in scaled.dispatch)
    assert scaled.combine == plain.combine
    assert [dataclasses.replace(c, scaleDim=0, scaleTypeSize=0) for c in scaled.dispatch] == list(plain.dispatch)
    cap = 2 * BASE["max_num_inp_token_per_rank"]
    assert region_bytes(plain.dispatch[0], plain.combine[0])["out_scales"] == 0
    assert region_bytes(scaled.dispatch[0], scaled.combine[0])["out_scales"] == cap * dim * size
    assert all(spec.entry_name(c).endswith(f"_s{dim}x{size}") for spec, c in scaled.requests() if spec.kind == "dispatch")


@pytest.mark.parametrize("dim,size", [(2, 3), (0, 4), (2, 0), (-1, 4)])
def test_an_ep_cfg_refuses_inconsistent_scales(dim, size):
    from mori_jit.jit.fields import ConfigError

    with pytest.raises(ConfigError, match="scaleDim and scaleTypeSize must be both 0"):
        EpCfg(scaleDim=dim, scaleTypeSize=size)


def test_expert_counts_are_a_dispatch_cfg_field_with_parity_counters():
    plain, counted = _variants(_cfg()), _variants(_cfg(expert_counts=True))
    assert hip_gaps(_cfg(expert_counts=True), "sm_90a") == []
    assert all(c.expertCounts for c in counted.dispatch) and counted.combine == plain.combine
    E = BASE["num_experts_per_rank"]
    got = region_bytes(counted.dispatch[0], counted.combine[0])
    assert (got["expert_adds"], got["expert_counts"]) == (2 * E * 4, E * 4)
    none = region_bytes(plain.dispatch[0], plain.combine[0])
    assert (none["expert_adds"], none["expert_counts"]) == (0, 0)
    # a reset clears the parity counters with the other sync words (a failed dispatch may have added)
    from mori_jit.ops.ep.backends.hip.backend import _SYNC_REGIONS
    assert "expert_adds" in _SYNC_REGIONS and "expert_counts" not in _SYNC_REGIONS


def test_expert_counts_refuse_more_experts_than_a_block_tallies():
    from mori_jit.jit.fields import ConfigError
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EP_MAX_COUNTED_EXPERTS

    EpCfg(worldSize=8, numExpertPerRank=EP_MAX_COUNTED_EXPERTS // 8, expertCounts=True)
    with pytest.raises(ConfigError, match=f"expertCounts needs numExpertPerRank\\*worldSize <= {EP_MAX_COUNTED_EXPERTS}"):
        EpCfg(worldSize=8, numExpertPerRank=EP_MAX_COUNTED_EXPERTS // 8 + 1, expertCounts=True)
    EpCfg(worldSize=8, numExpertPerRank=EP_MAX_COUNTED_EXPERTS)  # (without counts, no limit)


def test_routing_replay_is_a_dispatch_cfg_field_with_a_trailing_flag_argument():
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EP_ARGS, EP_REGIONS

    plain, replay = _variants(_cfg()), _variants(_cfg(routing_replay=True))
    assert hip_gaps(_cfg(routing_replay=True), "sm_90a") == []
    assert all(c.routingReplay for c in replay.dispatch) and replay.combine == plain.combine
    assert all(spec.entry_name(c).endswith("_rr") for spec, c in replay.requests() if spec.kind == "dispatch")
    # the MoE arguments trail every argument a plain kernel reads, so their offsets stay
    names = [f.name for f in EP_ARGS.fields]
    assert names[-2:] == ["inpScales", "replay"]
    assert names.index(f"off_{list(EP_REGIONS)[-1]}") == len(names) - 3


FP8 = torch.float8_e4m3fn
QUANT = dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8, combine_data_type=torch.bfloat16,
             scale_dim=2)


@pytest.mark.parametrize("size", [4, 1])
def test_in_kernel_fp8_cast_is_a_dispatch_cfg_field_never_on_the_bulk_path(size):
    assert hip_gaps(_cfg(**QUANT, scale_type_size=size), "sm_90a") == []
    plain = _variants(_cfg(dispatch_data_type=FP8, combine_data_type=torch.bfloat16, max_num_inp_token_per_rank=4096))
    quant = _variants(_cfg(**QUANT, scale_type_size=size, max_num_inp_token_per_rank=4096))
    assert any(c.bulkMinTokens for c in plain.dispatch)  # (this shape takes the bulk path unquantized)
    assert all(c.quantFp8Block128 and not c.bulkMinTokens and (c.scaleDim, c.scaleTypeSize) == (2, size)
               for c in quant.dispatch)
    assert quant.combine == plain.combine
    cap = 2 * 4096
    assert region_bytes(quant.dispatch[0], quant.combine[0])["out_scales"] == cap * 2 * size
    assert all(spec.entry_name(c).endswith("_q128") for spec, c in quant.requests() if spec.kind == "dispatch")


@pytest.mark.parametrize("fields", [dict(dtype=torch.bfloat16), dict(scaleDim=3), dict(scaleTypeSize=2),
                                    dict(hiddenDim=192, scaleDim=1), dict(bulkMinTokens=8)])
def test_an_ep_cfg_refuses_an_inconsistent_fp8_cast(fields):
    from mori_jit.jit.fields import ConfigError
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EpDType

    good = dict(hiddenDim=256, dtype=EpDType.Fp8, scaleDim=2, scaleTypeSize=4, quantFp8Block128=True)
    EpCfg(**good)
    if "dtype" in fields:
        fields = {"dtype": EpDType.Bf16}
    with pytest.raises(ConfigError, match="quantFp8Block128 needs dtype Fp8"):
        EpCfg(**{**good, **fields})


def test_the_expert_major_layout_adds_its_kernels_per_variant():
    from mori_jit.ops.ep.backends.hip.intranode.specs import EP_LAYOUT

    cfg = _cfg(expert_counts=True, expert_capacity=24, scale_dim=2, scale_type_size=4)
    assert hip_gaps(cfg, "sm_90a") == []
    plain, laid = _variants(_cfg(expert_counts=True)), _variants(cfg)
    assert all(c.expertCapacity == 24 for c in laid.dispatch) and laid.combine == plain.combine
    layouts = [c for spec, c in laid.requests() if spec is EP_LAYOUT]
    assert layouts == list(dict.fromkeys(laid.dispatch))  # one per dispatch variant, on its EpCfg
    assert not any(spec is EP_LAYOUT for spec, _ in plain.requests())
    assert EP_LAYOUT.precompile_cfgs(make_toolchain("sm_90a")) == []  # only an op's config has one
    assert EP_LAYOUT.geometry(layouts[0]).shared_bytes == 0
    E, H, entries = BASE["num_experts_per_rank"], BASE["hidden_dim"], BASE["num_experts_per_rank"] * 24
    got = laid.region_bytes()
    assert (got["exp_cursor"], got["exp_x"], got["exp_scales"], got["exp_wts"], got["exp_maps"]) == (
        E * 4, entries * H * 2, entries * 2 * 4, entries * 4, 3 * entries * 4)
    none = region_bytes(plain.dispatch[0], plain.combine[0])
    assert not any(none[k] for k in ("exp_cursor", "exp_x", "exp_scales", "exp_wts", "exp_maps"))
    assert all(spec.entry_name(c).endswith("_c24") for spec, c in laid.requests() if spec.kind in ("dispatch", "layout"))
    # combine_expert_major: a local sum on each combine EpCfg, then the same combine moving float32 rows
    from mori_jit.ops.ep.backends.hip.intranode.cfg import EpDType
    from mori_jit.ops.ep.backends.hip.intranode.specs import EP_COMBINE, EP_EXPERT_SUM
    assert [c for spec, c in laid.requests() if spec is EP_EXPERT_SUM] == list(dict.fromkeys(laid.combine))
    assert laid.expert_combine == tuple(dataclasses.replace(c, dtype=EpDType.Fp32) for c in laid.combine)
    assert {c for spec, c in laid.requests() if spec is EP_COMBINE} == {*laid.combine, *laid.expert_combine}
    assert plain.expert_combine == () and EP_EXPERT_SUM.precompile_cfgs(make_toolchain("sm_90a")) == []
    # the float32 rows size the combine's receive side
    assert got["comb_recv"] == 2 * region_bytes(laid.dispatch[0], laid.combine[0])["comb_recv"]
    assert got["exp_entry"] == 2 * BASE["max_num_inp_token_per_rank"] * BASE["num_experts_per_token"] * 4


def test_an_ep_cfg_refuses_a_layout_without_counts():
    from mori_jit.jit.fields import ConfigError

    with pytest.raises(ConfigError, match="expertCapacity must be 0 .* or >= 1 with expertCounts"):
        EpCfg(expertCapacity=8)
    with pytest.raises(ConfigError, match="expertCapacity must be 0"):
        EpCfg(expertCapacity=-1, expertCounts=True)


def test_precompile_builds_every_moe_kernel_a_live_op_asks_for(fake_cc, capsys):
    from mori_jit.cli import main
    from mori_jit.jit import cache
    from mori_jit.jit.compile import resolve

    fields = dict(index_dtype=torch.int64, scale_dim=2, scale_type_size=4, expert_counts=True, expert_capacity=32,
                  routing_replay=True)
    tc = make_toolchain("sm_90a")
    want = {resolve(spec, c, tc).path for spec, c in plan_requests(_cfg(**fields), "sm_90a", 132)}
    args = [f"{k}={v}" for k, v in {**BASE, **fields}.items() if k != "rank"]
    args = [a.replace("torch.int64", "int64").replace("=True", "=on") for a in args]
    assert main(["precompile", "--arch", "sm_90a", "--ep", *args, "num_cus=132"]) == 0, capsys.readouterr().err
    got = set(cache.list_entries())
    assert got == want
    names = {p.name.split(".")[1] for p in got}
    assert {n.split("_")[2] for n in names} >= {"dispatch", "combine", "layout", "expert"}


#: op configs with each feature on, as the real compilers build them (small shapes: fast builds), and
#: the EpCfg field that feature sets; 4096 tokens at EP2 take the bulk-copy dispatch on sm_90a
FEATURE_CFGS = {
    "int64_ids": (dict(index_dtype=torch.int64), "ids64"),
    "scales": (dict(scale_dim=3, scale_type_size=4), "scaleDim"),
    "expert_counts": (dict(expert_counts=True, index_dtype=torch.int64), "expertCounts"),
    "counts_bulk": (dict(expert_counts=True, max_num_inp_token_per_rank=4096), "expertCounts"),
    "routing_replay": (dict(routing_replay=True, expert_counts=True, scale_dim=2, scale_type_size=4), "routingReplay"),
    "replay_bulk": (dict(routing_replay=True, max_num_inp_token_per_rank=4096), "routingReplay"),
    "fp8_cast_f32": (dict(QUANT, scale_type_size=4, expert_counts=True), "quantFp8Block128"),
    "fp8_cast_ue8m0_replay": (dict(QUANT, scale_type_size=1, routing_replay=True, index_dtype=torch.int64),
                              "quantFp8Block128"),
    "layout": (dict(expert_counts=True, expert_capacity=40, scale_dim=3, scale_type_size=1, index_dtype=torch.int64,
                    routing_replay=True), "expertCapacity"),
    "layout_fp8_cast": (dict(QUANT, scale_type_size=4, expert_counts=True, expert_capacity=16), "expertCapacity"),
    "scales_bulk_fp8": (dict(scale_dim=2, scale_type_size=1, max_num_inp_token_per_rank=4096,
                             dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16), "scaleDim"),
}


@pytest.mark.parametrize("feature", list(FEATURE_CFGS))
@pytest.mark.parametrize("arch,compiler", [("sm_90a", "nvcc"), ("gfx90a", "hipcc")])
def test_real_compilers_build_the_moe_kernels(arch, compiler, feature):
    tc = toolchain_or_skip(arch)
    fields, field = FEATURE_CFGS[feature]
    var = ep_variants(_cfg(**fields), arch, 104)
    built: dict[str, list] = {}
    for spec, c in var.requests():
        if spec.kind == "combine" and c in var.combine:
            continue  # (the plain combine: test_ep_precompile builds those)
        e = build(spec, c, tc)
        assert spec.entry_name(c).encode() in e.binary.read_bytes()
        built.setdefault(spec.kind, []).append(c)
    assert all(getattr(c, field) for c in built["dispatch"])
    # the layout brings its kernel, the expert-major combine a local sum and a float32 combine
    assert set(built) == ({"dispatch", "layout", "expert_sum", "combine"} if field == "expertCapacity" else {"dispatch"})
    if "_bulk" in feature and arch == "sm_90a":
        assert any(c.bulkMinTokens for c in built["dispatch"])
