"""Config values the op refused late, or not at all: every product of fields that a kernel computes
in a C++ int is range-checked at construction (naming the fields and the value)."""
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
