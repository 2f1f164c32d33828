"""The packed expert-sorted layout (``mori_jit.ops.ep.train.packed``) on the ``hip`` backend, at
every world size of ``MORI_EP_TEST_WORLD_SIZES`` (several ranks per GPU under MPS where there are
fewer GPUs): the CPU suite's golden check (every pair once, groups aligned, offsets, counts and the
map back right; int64 ids; a call with no tokens), and ``torch._grouped_mm`` over the layout equal
to the dense MoE at prefill sizes (4096 tokens per rank: no capacity to choose and none exceeded)."""
from __future__ import annotations

import random

import pytest
import torch

from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job
from test_ep_packed_cpu import _golden_job, _grouped_mm_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_packed_layout_golden(ws):
    run_ep_job(_golden_job, ws, _seed(), "hip")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_grouped_mm_over_the_packed_layout_at_prefill_sizes(ws):
    run_ep_job(_grouped_mm_job, ws, _seed(), 4096, "hip")
