"""What the MoE features refuse, and that their golden checks can fail: config rules by name,
argument checks on the torch backend (gloo), expert-capacity overflow, corrupted results."""
from __future__ import annotations


import pytest
import torch

from mori_jit.jit.fields import ConfigError
from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpUnsupportedError
from mori_jit.testing.golden import golden_check, make_inputs
from mori_jit.testing.golden_moe import golden_check_experts, golden_quantize
from mori_jit.ops.ep import EpCapacityError
from mori_jit.ops.ep.backends.hip.variants import config_from_strings, precompile_targets
from mori_jit.testing.distributed import run_distributed

FP8 = torch.float8_e4m3fn
BASE = dict(rank=0, world_size=2, hidden_dim=256, max_num_inp_token_per_rank=8, num_experts_per_rank=4,
            num_experts_per_token=2)
QUANT = dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8, combine_data_type=torch.bfloat16,
             scale_dim=2, scale_type_size=4)


@pytest.mark.parametrize("fields,match", [
    (dict(index_dtype=torch.int16), "index_dtype=torch.int16: allowed torch.int32, torch.int64"),
    (dict(expert_counts=1), "expert_counts=1: expected True or False"),
    (dict(routing_replay="yes"), "routing_replay='yes': expected True or False"),
    (dict(expert_capacity=-1, expert_counts=True), "expert_capacity=-1: expected an int >= 0"),
    (dict(expert_capacity=8), "expert_capacity=8 .* set expert_counts=True"),
    (dict(scale_dim=2), "scale_dim=2 and scale_type_size=0: set together"),
    (dict(scale_dim=2, scale_type_size=3), r"scale_type_size=3: allowed \(1, 2, 4, 8\)"),
    (dict(dispatch_quant_type="fp8_blockwise"),
     "dispatch_quant_type='fp8_blockwise': allowed None, 'none', 'fp8_e4m3_block128'"),
    (dict(quant_type="fp8_e4m3_block128"), "quant_type='fp8_e4m3_block128': the combine wire's quantization, mori's "
                                           "values: 'none', 'fp8_direct_cast'.* set dispatch_quant_type="),
    (dict(quant_type=None), "quant_type=None: the combine wire's quantization"),
    (dict(QUANT, dispatch_data_type=torch.bfloat16), "sends torch.float8_e4m3fn: set dispatch_data_type"),
    (dict(QUANT, scale_dim=4), r"set scale_dim=2 \(hidden_dim / 128\), got 4"),
    (dict(QUANT, scale_type_size=2), r"scale_type_size=2, allowed 4 \(float32 scales\) or 1 \(UE8M0\)"),
    (dict(QUANT, hidden_dim=192, scale_dim=1), "needs hidden_dim a multiple of 128, got 192"),
])
def test_moe_config_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        EpDispatchCombineConfig(**{**BASE, **fields})


def test_a_quantizing_op_takes_bf16_and_returns_fp8():
    cfg = EpDispatchCombineConfig(**BASE, **QUANT)
    assert (cfg.input_dtype, cfg.dispatch_dtype, cfg.combine_dtype) == (torch.bfloat16, FP8, torch.bfloat16)
    assert EpDispatchCombineConfig(**BASE).input_dtype == torch.bfloat16 == EpDispatchCombineConfig(**BASE).dispatch_dtype


def test_precompile_parses_the_moe_fields_and_refuses_them_by_name():
    base = {k: str(v) for k, v in BASE.items() if k != "rank"}
    cfg, _ = config_from_strings({**base, "index_dtype": "int64", "expert_counts": "on", "expert_capacity": "32",
                                  "routing_replay": "true"})
    assert (cfg.index_dtype, cfg.expert_counts, cfg.expert_capacity, cfg.routing_replay) == (torch.int64, True, 32,
                                                                                              True)
    with pytest.raises(ConfigError, match="index_dtype='int8'.*expected one of int32, int64"):
        config_from_strings({**base, "index_dtype": "int8"})
    with pytest.raises(ConfigError, match="expert_counts='maybe'"):
        config_from_strings({**base, "expert_counts": "maybe"})
    moe = {"index_dtype": "int64", "expert_counts": "on", "expert_capacity": "32", "routing_replay": "on"}
    assert precompile_targets(moe | base, "sm_90a")  # the kernels do every one of them
    with pytest.raises(ConfigError, match=r"does not support: combine_mode='scatter'") as err:
        precompile_targets({**base, **moe, "combine_mode": "scatter"}, "sm_90a")
    assert all(f not in str(err.value) for f in moe), str(err.value)


def _args_job(rank, ws):
    """Every rank passes the same bad argument (each check is agreed on before any exchange)."""
    gen = torch.Generator().manual_seed(rank)
    scaled = EpDispatchCombineConfig(**{**BASE, "rank": rank, "world_size": ws}, scale_dim=3, scale_type_size=4,
                                     index_dtype=torch.int64, kernel_backend="torch")
    with EpDispatchCombineOp(scaled) as op:
        x, w, idx = make_inputs(rank, 5, 256, 2, scaled.num_experts, torch.bfloat16, "cpu", gen,
                                index_dtype=torch.int64)
        s = torch.rand(5, 3)
        with pytest.raises(ValueError, match="scales: None, but the config declares scale_dim=3"):
            op.dispatch(x, w, None, idx)
        with pytest.raises(TypeError, match="scales: torch.float16 has 2-byte elements, .* scale_type_size=4"):
            op.dispatch(x, w, s.half(), idx)
        with pytest.raises(ValueError, match=r"scales: expected shape \[5, 3\]"):
            op.dispatch(x, w, s[:, :2].contiguous(), idx)
        with pytest.raises(TypeError, match="indices: expected dtype torch.int64"):
            op.dispatch(x, w, s, idx.int())
        with pytest.raises(EpUnsupportedError, match="routing_replay=True"):
            op.dispatch(x, w, s, None, routing=op.dispatch(x, w, s, idx, return_routing=True)[5])
        with pytest.raises(ValueError, match="combine_expert_major needs the expert-major layout"):
            op.combine_expert_major(torch.zeros(4, 1, 256, dtype=torch.bfloat16), routing=None)
        res = op.dispatch(x, w, s, idx, return_result=True)  # the op still works after the refusals
        assert res.expert_counts is None and res.expert is None
        golden_check(op.group, rank, ws, 8, 4, x, w, idx, res.out, res.out_weights, res.out_indices, res.total_recv,
                     res.routing.recv_src, None, None, scales=s, out_scales=res.out_scales)
    quant = EpDispatchCombineConfig(**{**BASE, "rank": rank, "world_size": ws}, **QUANT, expert_counts=True,
                                    expert_capacity=16, kernel_backend="torch")
    with EpDispatchCombineOp(quant) as op:
        x, w, idx = make_inputs(rank, 5, 256, 2, quant.num_experts, torch.bfloat16, "cpu", gen)
        with pytest.raises(ValueError, match="scales: the op makes them"):
            op.dispatch(x, w, torch.rand(5, 2), idx)
        with pytest.raises(TypeError, match="input: expected dtype torch.bfloat16"):
            op.dispatch(x.to(FP8), w, None, idx)
        res = op.dispatch(x, w, None, idx, return_result=True)
        with pytest.raises(ValueError, match=r"input: expected shape \[4, 16, 256\]"):
            op.combine_expert_major(torch.zeros(4, 8, 256, dtype=torch.bfloat16), routing=res.routing)
        with pytest.raises(TypeError, match="input: expected dtype torch.bfloat16"):
            op.combine_expert_major(torch.zeros(4, 16, 256), routing=res.routing)
        inp = torch.zeros(4, 16, 256, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="out: overlaps input"):
            op.combine_expert_major(inp, routing=res.routing, out=inp.view(-1, 256)[:5])
        with pytest.raises(ValueError, match="routing: expected the routing returned by this op's latest"):
            op.combine_expert_major(inp, routing=None)


def test_moe_arguments_are_refused_by_name():
    run_distributed(_args_job, 2, timeout=120)


def _capacity_job(rank, ws):
    """Every token of every rank names expert 0: rank 0's expert overflows and every rank raises,
    naming rank 0. Nothing is left in a collective: the next dispatch runs on every rank."""
    cfg = EpDispatchCombineConfig(**{**BASE, "rank": rank, "world_size": ws, "num_experts_per_token": 1},
                                  expert_counts=True, expert_capacity=4, kernel_backend="torch")
    gen = torch.Generator().manual_seed(rank)
    with EpDispatchCombineOp(cfg) as op:
        x, w, _ = make_inputs(rank, 3, 256, 1, cfg.num_experts, torch.bfloat16, "cpu", gen)
        idx = torch.zeros(3, 1, dtype=torch.int32)
        with pytest.raises(EpCapacityError, match=rf"rank 0's local experts 0 \({3 * ws} pairs\) would receive "
                                                  rf"more than expert_capacity=4 .* at least {3 * ws}"):
            op.dispatch(x, w, None, idx)
        x, w, _ = make_inputs(rank, 2, 256, 1, cfg.num_experts, torch.bfloat16, "cpu", gen)
        idx = torch.full((2, 1), rank % cfg.num_experts_per_rank, dtype=torch.int32)  # 2 * ws / 4 pairs at most
        res = op.dispatch(x, w, None, idx, return_result=True)
        golden_check_experts(op.group, rank, ws, 8, 4, x, w, idx, res.expert_counts, res.expert, out=res.out,
                             recv_src=res.routing.recv_src)


def test_expert_capacity_overflow_is_an_error_never_a_truncation():
    run_distributed(_capacity_job, 2, timeout=120)


def _corruption_job(rank, ws):
    """golden_check_experts passes a clean result and names each corruption (only rank 0 corrupts;
    every rank runs every round, as the check is collective)."""
    cfg = EpDispatchCombineConfig(**{**BASE, "rank": rank, "world_size": ws}, **QUANT, expert_counts=True,
                                  expert_capacity=16, kernel_backend="torch")
    gen = torch.Generator().manual_seed(11 + rank)
    with EpDispatchCombineOp(cfg) as op:
        x, w, idx = make_inputs(rank, 8, 256, 2, cfg.num_experts, torch.bfloat16, "cpu", gen)
        res = op.dispatch(x, w, None, idx, return_result=True)
        xq, sq = golden_quantize(x, 4)
        lay, counts = res.expert, res.expert_counts
        e = int(counts.argmax())
        assert int(counts[e]) >= 2, "8 tokens x 2 experts on 8 experts: some local expert gets two"

        def bump_count():
            c = counts.clone()
            c[e] += 1
            return c, lay

        def edit(field, fn):
            t = getattr(lay, field).clone()
            fn(t)
            return counts, lay._replace(**{field: t})

        def flip(t):
            t.view(torch.uint8)[e, 0, 3] ^= 0x10

        corruptions = [
            (bump_count, "expert_counts["),
            (lambda: edit("src", lambda t: t.__setitem__((e, 0), t[e, 1])), "layout entries differ"),
            (lambda: edit("slot", lambda t: t.__setitem__((e, 0), 1 - t[e, 0])), "layout entries differ"),
            (lambda: edit("recv_row", lambda t: t.__setitem__((e, 15), 0)), "is padding"),
            (lambda: edit("x", flip), "layout.x["),
            (lambda: edit("scales", flip), "layout.scales["),
            (lambda: edit("weights", lambda t: t.__setitem__((e, 0), t[e, 0] * 2)), "layout.weights["),
            (lambda: edit("recv_row", lambda t: t.__setitem__((e, 0), t[e, 1])), "recv_row does not point"),
        ]

        def check(c, layout):
            golden_check_experts(op.group, rank, ws, 8, 4, xq, w, idx, c, layout, scales=sq, out=res.out,
                                 recv_src=res.routing.recv_src)

        check(counts, lay)
        for make, what in corruptions:
            c, layout = make() if rank == 0 else (counts, lay)
            if rank == 0:
                with pytest.raises(AssertionError, match=rf"golden_check rank 0: .*{what.replace('[', '[[]')}"):
                    check(c, layout)
            else:
                check(c, layout)
        # the payload check of the receive rows sees one wrong quantized byte
        bad = res.out.clone()
        bad.view(torch.uint8)[0, 7] ^= 0x01
        args = (op.group, rank, ws, 8, 4, xq, w, idx, bad if rank == 0 else res.out, res.out_weights,
                res.out_indices, res.total_recv, res.routing.recv_src, None, None)
        if rank == 0 and int(res.total_recv):
            with pytest.raises(AssertionError, match="out row 0"):
                golden_check(*args, scales=sq, out_scales=res.out_scales)
        else:
            golden_check(*args, scales=sq, out_scales=res.out_scales)


def test_the_moe_golden_checks_can_fail():
    run_distributed(_corruption_job, 2, timeout=120)
