"""The fp8 casts at a model's shape (hidden 7168, top-8 of 256 experts, 128 tokens per rank, int64
ids), at every world size of ``MORI_EP_TEST_WORLD_SIZES``: the combine wire's cast and the dispatch's
block-128 cast, each byte for byte against its golden. A row is 56 scale blocks there and the kernels
keep several vectors per lane in flight, where a pair form of the hardware e4m3 conversion (a 16-bit
result per instruction) put NaN bytes into the combine wire's cast (kernels/platform/nvidia.hpp:
e4m3x4_from_f32); the other GPU checks run hidden 256, which does not show it. And one rank at that
shape with thousands of tokens, where the combine runs two blocks per SM (more blocks than SMs)."""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job
from test_ep_combine_quant_cpu import WIRES, golden_identity_sum
from test_gpu_ep_combine_quant import PROTOCOLS, _dev

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

BIG_H, BIG_K, BIG_E, BIG_M = 7168, 8, 256, 128
FP8 = torch.float8_e4m3fn


def _cfg(rank, ws, m=BIG_M, **fields):
    """The hip op at the model's shape (``m`` tokens per rank at most), int64 ids, with the cast's
    ``fields``."""
    from mori_jit.ops.ep import EpDispatchCombineConfig

    return EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=BIG_H, max_num_inp_token_per_rank=m,
                                   num_experts_per_rank=BIG_E // ws, num_experts_per_token=BIG_K,
                                   kernel_backend="hip", index_dtype=torch.int64, **fields)


def _ids(gen, dev):
    return torch.stack([torch.randperm(BIG_E, generator=gen)[:BIG_K] for _ in range(BIG_M)]).to(dev)


def _model_shape_job(rank, ws, quant, scale_bytes, low):
    """Identity experts at a model's shape, int64 ids, two calls: y is exactly the sum of the cast
    rows (golden_identity_sum), every element, so a NaN anywhere fails."""
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen, epr_ = torch.Generator().manual_seed(31 + rank), BIG_E // ws
    cfg = _cfg(rank, ws, quant_type=quant, combine_scale_type_size=scale_bytes, combine_low_latency=low)
    with EpDispatchCombineOp(cfg) as op:
        for call in range(2):
            x = torch.randn(BIG_M, BIG_H, generator=gen).bfloat16().to(_dev())
            idx = _ids(gen, _dev())
            res = op.dispatch(x, None, None, idx, return_result=True)
            y, _ = op.combine(res.out, routing=res.routing)
            want = golden_identity_sum(x, idx, ws, quant, scale_bytes, torch.bfloat16, experts_per_rank=epr_)
            diff = y.view(torch.int16) != want.view(torch.int16)
            assert not bool(diff.any()), (f"{quant}/{scale_bytes} low={low} call {call} (rank {rank} of {ws}): "
                                          f"{int(diff.sum())} elements differ from the sum of the cast rows, "
                                          f"{int(y.isnan().sum())} of them NaN")
        op.check()


@pytest.mark.parametrize("low", PROTOCOLS, ids=["flags", "ll"])
@pytest.mark.parametrize("quant, scale_bytes", WIRES)
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_fp8_wire_at_a_models_shape(ws, quant, scale_bytes, low):
    run_ep_job(_model_shape_job, ws, quant, scale_bytes, low)


def _cast_job(rank, ws, scale_bytes):
    """The dispatch's in-kernel block-128 cast, two calls: every received row and its scales byte for
    byte the golden cast (DeepGEMM's) of its source row; every rank knows every rank's input."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden_moe import golden_quantize

    cfg = _cfg(rank, ws, dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8,
               combine_data_type=torch.bfloat16, scale_dim=BIG_H // 128, scale_type_size=scale_bytes)
    with EpDispatchCombineOp(cfg) as op:
        for call in range(2):
            xs = [torch.randn(BIG_M, BIG_H, generator=torch.Generator().manual_seed(1000 * call + r)).bfloat16()
                  for r in range(ws)]
            res = op.dispatch(xs[rank].to(_dev()), None, None, _ids(torch.Generator().manual_seed(7 + 1000 * call + rank),
                                                                     _dev()), return_result=True)
            total = int(res.total_recv)
            src = res.routing.recv_src[:total].long().cpu()  # source rank * M + source token
            golden = [golden_quantize(x, scale_bytes) for x in xs]
            q, s = torch.cat([g[0] for g in golden])[src], torch.cat([g[1] for g in golden])[src]
            where = f"scale bytes {scale_bytes} call {call} (rank {rank} of {ws})"
            rows = res.out[:total].cpu().view(torch.uint8) != q.view(torch.uint8)
            assert not bool(rows.any()), f"{where}: {int(rows.sum())} fp8 bytes differ from the golden cast"
            assert torch.equal(res.out_scales[:total].cpu().contiguous().view(torch.uint8),
                               s.contiguous().view(torch.uint8)), f"{where}: scales differ from the golden cast"
        op.check()


@pytest.mark.parametrize("scale_bytes", [4, 1])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_fp8_dispatch_cast_at_a_models_shape(ws, scale_bytes):
    run_ep_job(_cast_job, ws, scale_bytes)


#: One rank's token counts per call: its combine's bucket edge is 128 tokens; above it the combine
#: runs on two blocks per SM (tuning: the one-rank row), below on one.
ONE_RANK_CALLS = (4096, 1, 0, 129, 2049, 4096)


def _one_rank_job(rank, ws, quant, scale_bytes):
    """Identity experts with weights, one rank, token counts changing every call: y exactly the sum
    of the cast rows and y_w the weights, into outputs poisoned with NaN first."""
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(97)
    cfg = _cfg(rank, ws, max(ONE_RANK_CALLS), quant_type=quant, combine_scale_type_size=scale_bytes)
    with EpDispatchCombineOp(cfg) as op:
        big = op._variants.combine[-1]  # (what the calls above the edge launch: two blocks per SM of the share)
        assert big.blocksPerSm == 2, big
        for call, n in enumerate(ONE_RANK_CALLS):
            x = torch.randn(n, BIG_H, generator=gen).bfloat16().to(_dev())
            idx = torch.rand(n, BIG_E, generator=gen).argsort(dim=1)[:, :BIG_K].to(_dev())  # (distinct, int64)
            w = torch.rand(n, BIG_K, generator=gen).to(_dev())
            res = op.dispatch(x, w, None, idx, return_result=True)
            y = torch.full((n, BIG_H), float("nan"), dtype=torch.bfloat16, device=_dev())
            y_w = torch.full((n, BIG_K), float("nan"), device=_dev())
            got, got_w = op.combine(res.out, weights=res.out_weights, routing=res.routing, out=y, out_weights=y_w)
            assert got.data_ptr() == y.data_ptr() and got_w.data_ptr() == y_w.data_ptr()
            want = golden_identity_sum(x, idx, ws, quant, scale_bytes, torch.bfloat16, experts_per_rank=BIG_E)
            diff = y.view(torch.int16) != want.view(torch.int16)
            where = f"{quant}/{scale_bytes} call {call} ({n} tokens)"
            assert not bool(diff.any()), f"{where}: {int(diff.sum())} elements differ from the cast rows"
            assert torch.equal(y_w, w), f"{where}: the weights differ"
        op.check()


@pytest.mark.skipif(1 not in WORLD_SIZES, reason="MORI_EP_TEST_WORLD_SIZES has no 1")
@pytest.mark.parametrize("quant, scale_bytes", [("none", 4), *WIRES])
def test_one_rank_combine_on_two_blocks_per_sm(quant, scale_bytes):
    run_ep_job(_one_rank_job, 1, quant, scale_bytes)
