"""The differentiable op (``mori_jit.ops.ep.train``) on the torch backend (gloo, 2, 3 and 4 ranks):
gradients of the tokens, the router and each rank's expert shard against a dense float64 MoE on one
process (``mori_jit.testing.moe_grads``), fresh random data each run (the seed is in every failure).

Covered: the three layouts (per received row through the op's methods, expert-major through the op's
methods, packed with grouped GEMMs through the functional API); fp32 legs (relative error <= 1e-4) and
bf16 legs (<= 3e-2, with a bf16 router); int32 and int64 ids; a rank with no tokens; combine's
backward by replay and by re-route; an fp8 forward whose gradients are bf16 (a gradient op)."""
from __future__ import annotations

import random

import pytest
import torch

from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.moe_grads import Case, cases_job

BF16, I32 = torch.bfloat16, torch.int32
#: token counts per rank: rank 1 has none
TOKENS = [8, 0, 5, 7]

CASES = {
    2: [Case(("rows",), replay=True), Case(("expert_major",), index_dtype=I32), Case(("packed",)),
        Case(("rows",), dtype=BF16, index_dtype=I32), Case(("expert_major",), dtype=BF16, replay=True),
        Case(("packed",), dtype=BF16)],
    3: [Case(("rows",), index_dtype=I32), Case(("expert_major",), replay=True), Case(("packed",), replay=True),
        Case(("rows",), dtype=BF16, replay=True)],
    4: [Case(("rows",)), Case(("expert_major",), index_dtype=I32), Case(("packed",), dtype=BF16)],
}


def _seed() -> int:
    return random.SystemRandom().randrange(2 ** 31)


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_gradients_match_the_dense_moe(ws):
    run_distributed(cases_job, ws, _seed(), CASES[ws], TOKENS, timeout=300)


def test_fp8_forward_has_bf16_gradients():
    """dispatch_quant_type fp8 forward: experts see the fp8 rows, gradients travel and arrive as bf16."""
    cases = [Case(("rows",), fp8=True), Case(("packed",), fp8=True, replay=True)]
    run_distributed(cases_job, 2, _seed(), cases, [6, 3], timeout=300)
