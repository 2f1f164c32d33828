"""The combine's fp8 wire (``quant_type``) on a real MoE layer: transformers' Mixtral sparse-MoE
block (its router and its experts, random weights, bf16), run expert-parallel through the ``hip``
op at every world size of ``MORI_EP_TEST_WORLD_SIZES``, int64 ids as the router makes them, one
rank with no tokens. Each rank's output is compared with the block's own forward in float32 (the
dense layer): the bf16 combine within bf16's error, each fp8 wire within e4m3's (relative L2 a few
%) and measurably above the bf16 combine's (the wire really is fp8). Skips where transformers is
not installed (the GPU machine's image has it; the CPU suite's install does not)."""
from __future__ import annotations

import random

import pytest
import torch

from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job
from mori_jit.testing.moe_grads import rel_err
from test_ep_combine_quant_cpu import WIRES
from test_gpu_ep_combine_quant import _dev

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

H, FF, EPR, K, M = 1024, 512, 4, 4, 96
#: Relative L2 bounds against the float32 block: bf16 rows and a bf16 output (2^-9 each, a few roundings);
#: e4m3 keeps 3 mantissa bits (2^-4 at worst, about 2.5 % RMS on such rows), plus the bf16 output.
BF16_BOUND, FP8_BOUND = 1e-2, 6e-2


def _block(ws, seed, dev):
    """The Mixtral sparse-MoE block of EPR * ws experts, the same random weights on every rank."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=FF, num_local_experts=EPR * ws, num_experts_per_tok=K,
                        hidden_act="silu")
    block = MixtralSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block.to(dev).eval()


def hf_block_job(rank, ws, seed, backend="hip"):
    """Every wire on the same tokens and routing; asserts each one's error against the dense block."""
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

    dev = _dev() if backend == "hip" else torch.device("cpu")
    block, bf = _block(ws, seed, dev), _block(ws, seed, dev).to(torch.bfloat16)
    n = 0 if rank == ws - 1 and ws > 1 else M - 7 * rank
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(seed + 1 + rank)).to(dev)
    with torch.no_grad():
        _, w, ids = bf.gate(x.bfloat16())  # the bf16 layer's routing, int64 ids
        # the dense layer in float32 on the same routing (a near tie routed apart in float32 is not the wire's error)
        want = block.experts(x, ids, w.float())
    assert ids.dtype == torch.int64
    errs = {}
    for quant, scale_bytes in [("none", 4)] + WIRES:
        cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                      num_experts_per_rank=EPR, num_experts_per_token=K, kernel_backend=backend,
                                      index_dtype=torch.int64, quant_type=quant, combine_scale_type_size=scale_bytes)
        with EpDispatchCombineOp(cfg) as op, torch.no_grad():
            res = op.dispatch(x.bfloat16(), w.float(), None, ids, return_result=True)
            got = int(res.total_recv)
            rid, rw = res.out_indices[:got].long(), res.out_weights[:got]
            mine = rid // EPR == rank  # this rank's experts; the others' slots weigh nothing here
            expert_out = torch.zeros_like(res.out)
            expert_out[:got] = bf.experts(res.out[:got], torch.where(mine, rid, rank * EPR),
                                          torch.where(mine, rw, 0.0).bfloat16())
            y, _ = op.combine(expert_out, routing=res.routing)
            op.check()
        assert y.shape == (n, H) and not bool(y.isnan().any()), \
            (f"{quant}/{scale_bytes} rank {rank} of {ws}: {int(y.isnan().sum())} NaN in y; received {got} rows, "
             f"{int(res.out[:got].isnan().sum())} NaN in them, {int(expert_out.isnan().sum())} in the expert outputs")
        errs[(quant, scale_bytes)] = rel_err(y[:n].cpu(), want.cpu()) if n else 0.0
    if n:
        print(f"rank {rank} of {ws}: relative L2 error against the dense block: {errs}")
        base = errs[("none", 4)]
        assert base <= BF16_BOUND, errs
        for wire in WIRES:
            assert base * 2 < errs[wire] <= FP8_BOUND, (wire, errs)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_fp8_wire_error_on_a_transformers_moe_block(ws):
    pytest.importorskip("transformers", reason="needs transformers (the MoE block under test)")
    run_ep_job(hf_block_job, ws, random.SystemRandom().randrange(2 ** 31))
