"""The split legs on the CPU (docs/design.md §6, "Send and receive"): the torch backend's sends and
receives over gloo at 2 and 4 ranks against its unsplit legs and the golden checks, for every
config of ``ep_overlap_checks.CONFIGS`` (dtype pairs, both combine protocols, every MoE option);
their misuse; two micro-batches in flight with one op each; and the config field that asks for
them."""
from __future__ import annotations

import pytest

from ep_overlap_checks import split_job
from ep_overlap_jobs import micro_batches_job, misuse_job, router_dtype_job
from mori_jit.ops.ep import EpConfigError, EpDispatchCombineConfig
from mori_jit.testing.distributed import run_distributed


@pytest.mark.parametrize("ws", [2, 4])
def test_split_legs_match_the_unsplit_legs_and_the_golden_checks(ws):
    run_distributed(split_job, ws, "torch", timeout=600)


@pytest.mark.parametrize("ws", [2, 3])
def test_misuse_is_refused_before_anything_is_launched(ws):
    run_distributed(misuse_job, ws, "torch", timeout=240)


@pytest.mark.parametrize("schedule", ["interleaved", "dbo"])
def test_two_micro_batches_in_flight_one_op_each(schedule):
    run_distributed(micro_batches_job, 2, "torch", schedule, timeout=240)


def test_a_split_dispatch_takes_a_bf16_or_fp16_router():
    run_distributed(router_dtype_job, 2, "torch", timeout=240)


def test_split_send_recv_is_a_checked_config_field():
    base = dict(rank=0, world_size=2, hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=2,
                num_experts_per_token=2)
    assert EpDispatchCombineConfig(**base).split_send_recv is False
    with pytest.raises(EpConfigError, match=r"split_send_recv='yes': expected True or False"):
        EpDispatchCombineConfig(**base, split_send_recv="yes")
