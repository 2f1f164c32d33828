"""Config values the op refused late, or not at all: every product of fields that a kernel computes
in a C++ int is range-checked at construction (naming the fields and the value), and a
``dispatch_quant_type``, ``quant_type`` or ``schedule`` of the wrong shape is an ``EpConfigError`` naming the field, the
value and what is allowed, never a TypeError or an IndexError later."""
from __future__ import annotations

import pytest
import torch

from mori_jit.cli import main
from mori_jit.ops.ep import EpConfigError, EpDispatchCombineConfig

INT_MAX = 2**31 - 1
BASE = dict(rank=0, world_size=2, hidden_dim=2048, max_num_inp_token_per_rank=64, num_experts_per_rank=2,
            num_experts_per_token=2)


@pytest.mark.parametrize("change,product", [
    (dict(num_experts_per_rank=2**30), "num_experts_per_rank*world_size = 2147483648"),
    (dict(world_size=8, rank=3, num_experts_per_rank=2**28 + 1), "num_experts_per_rank*world_size = 2147483656"),
    (dict(max_num_inp_token_per_rank=2**30), "world_size*max_num_inp_token_per_rank = 2147483648"),
    (dict(max_num_inp_token_per_rank=2**29, max_total_recv_tokens=2**30 + 1),
     "world_size*max_total_recv_tokens = 2147483650"),
    (dict(max_num_inp_token_per_rank=2**28, num_experts_per_token=4),
     "(world_size*max_num_inp_token_per_rank)*num_experts_per_token = 2147483648"),
    (dict(hidden_dim=2**30), "hidden_dim*2 = 2147483648 (the bytes of a dispatch row of torch.bfloat16)"),
    (dict(hidden_dim=2**29, data_type=torch.float32), "hidden_dim*4 = 2147483648"),
    (dict(hidden_dim=2**30, dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16),
     "hidden_dim*2 = 2147483648 (the bytes of a combine row of torch.bfloat16)"),
    (dict(scale_dim=2**29, scale_type_size=4), "scale_dim*scale_type_size = 2147483648"),
    (dict(expert_counts=True, expert_capacity=2**29), "3*num_experts_per_rank*expert_capacity = 3221225472"),
])
@pytest.mark.parametrize("backend", ["torch", "hip"])
def test_a_product_beyond_the_cpp_int_is_refused_naming_its_fields(change, product, backend):
    with pytest.raises(EpConfigError) as ei:
        EpDispatchCombineConfig(**{**BASE, **change}, kernel_backend=backend)
    assert product in str(ei.value) and f"is above {INT_MAX}, the largest C++ int" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("change", [
    dict(num_experts_per_rank=INT_MAX // 2),  # 2147483646 experts
    dict(max_num_inp_token_per_rank=2**29 - 1),  # 2 ranks x 2 * capacity, and capacity x top-k 2: 2147483644
    dict(hidden_dim=2**30 - 8),  # 2147483632-byte rows
    dict(scale_dim=INT_MAX // 4, scale_type_size=4),
    dict(expert_counts=True, expert_capacity=INT_MAX // 6),  # 3 maps x 2 experts
])
def test_products_up_to_the_cpp_int_are_accepted(change):
    EpDispatchCombineConfig(**{**BASE, **change})


@pytest.mark.parametrize("field", ["gpu_per_node", "internode_auto_ll_max_tokens", "dispatch_block_num",
                                   "combine_warp_num_per_block"])
def test_every_count_field_is_a_cpp_int(field):
    with pytest.raises(EpConfigError, match=f"EpDispatchCombineConfig.{field}=2147483648: above {INT_MAX}"):
        EpDispatchCombineConfig(**BASE, **{field: 2**31})


def test_precompile_refuses_the_wrapped_expert_count(fake_cc, capsys):
    rc = main(["precompile", "--arch", "sm_90a", "--ep", "world_size=2", "hidden_dim=2048",
               "max_num_inp_token_per_rank=64", f"num_experts_per_rank={2**30}", "num_experts_per_token=2"])
    err = capsys.readouterr().err
    assert rc == 1 and "num_experts_per_rank*world_size = 2147483648" in err, err


@pytest.mark.parametrize("value", [["fp8_e4m3_block128"], [], {"fp8_e4m3_block128": 1}, 128, b"none"])
def test_dispatch_quant_type_of_the_wrong_type_names_the_field(value):
    with pytest.raises(EpConfigError, match=r"dispatch_quant_type=.*: expected None or a name: allowed None, "
                                            r"'none', 'fp8_e4m3_block128'"):
        EpDispatchCombineConfig(**BASE, dispatch_quant_type=value)


@pytest.mark.parametrize("value", [["none"], [], {"none": 1}, 128, b"none"])
def test_quant_type_of_the_wrong_type_names_the_field(value):
    # mori's combine-wire field: a name among mori's values
    with pytest.raises(EpConfigError, match=r"EpDispatchCombineConfig\.quant_type=.*: expected a name: the combine "
                                            r"wire's quantization, mori's values: 'none', 'fp8_direct_cast'"):
        EpDispatchCombineConfig(**BASE, quant_type=value)


_EDGES = "max_tokens ascending and None in the last bucket only"


@pytest.mark.parametrize("value,match", [
    ([None], r"schedule bucket None: expected \(max_tokens \| None, dispatch_blocks"),
    ([], r"schedule=\[\]: expected a non-empty list of buckets"),
    ((), r"schedule=\(\): expected a non-empty list"),
    ({}, r"schedule=\{\}: expected a non-empty list"),
    (7, "schedule=7: expected a non-empty list"),
    ("abc", "schedule='abc': expected a non-empty list"),
    ([(None, 1, 1, 1)], r"schedule bucket \(None, 1, 1, 1\): expected"),
    ([(None, 1, 1, 1, True)], r"schedule bucket \(None, 1, 1, 1, True\): expected .*ints >= 1"),
    ([(None, 1, 1, 0, 1)], r"schedule bucket .*ints >= 1"),
    ([(None, 1, 1, 2**31, 1)], r"schedule bucket .*ints >= 1"),
    ([(4, 1, 1, 1, 1)], r"schedule=.*: max_tokens \[4\]: .*" + _EDGES),
    ([(None, 1, 1, 1, 1), (4, 1, 1, 1, 1)], r"schedule=.*: max_tokens \[None, 4\]: .*" + _EDGES),
    ([(8, 1, 1, 1, 1), (4, 1, 1, 1, 1), (None, 1, 1, 1, 1)], r"schedule=.*: max_tokens \[8, 4, None\]: .*" + _EDGES),
    ([(8, 1, 1, 1, 1), (8, 2, 2, 2, 2), (None, 1, 1, 1, 1)], r"schedule=.*: max_tokens \[8, 8, None\]"),
])
def test_a_schedule_of_the_wrong_shape_names_the_field(value, match):
    with pytest.raises(EpConfigError, match="EpDispatchCombineConfig." + match):
        EpDispatchCombineConfig(**BASE, schedule=value)


def test_well_formed_schedules_are_accepted():
    for schedule in ([(None, 1, 1, 1, 1)], ((8, 4, 2, 4, 2), [64, 8, 4, 8, 4], (None, 16, 8, 16, 8))):
        assert EpDispatchCombineConfig(**BASE, schedule=schedule).schedule == schedule
