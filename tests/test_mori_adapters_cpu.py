"""The serving engines' mori adapters replayed on mori-jit (``tests/mori_replays.py`` says what
each replay does): the torch backend over gloo, 2 and 4 ranks. Each step's output is checked
against the dense MoE result of the rank's own tokens; the steps include a rank with no tokens,
a rank that receives nothing, a step where no rank has tokens, and int64 router ids (cast to int32
by the adapter, or by the engine's router for the v1 adapters). ``test_gpu_mori_compat.py`` runs the
same replays on the hip backend."""
from __future__ import annotations

import os

import pytest
import torch

import mori_replays as R
from mori_jit.testing.distributed import run_distributed


def _torch_backend() -> None:
    os.environ["MORI_V2_KERNEL_BACKEND"] = "torch"  # (an engine's process: the op's backend by the environment)


def _sglang_v2_job(rank, ws):
    _torch_backend()
    mori = R.install_mori()
    op = R.sglang_v2_op(mori, rank, ws)
    assert op.backend_name == "torch"
    gen = torch.Generator().manual_seed(100 + rank)
    for n, avoid_last in R.calls(rank, ws):
        x, w, ids = R.route(rank, ws, n, gen, op.device, avoid_last)
        assert ids.dtype == torch.int64  # (the adapter casts)
        R.check(R.sglang_v2_step(op, rank, x, w, ids), x, w, ids)
    op.close()


def _sglang_v1_job(rank, ws, data_type):
    _torch_backend()
    mori = R.install_mori()
    R.register_group(mori)
    op = R.v1_op(mori, rank, ws, data_type=getattr(torch, data_type))
    assert op.config.kernel_type is mori.ops.EpDispatchCombineKernelType.IntraNode
    gen = torch.Generator().manual_seed(200 + rank)
    for step, (n, avoid_last) in enumerate(R.calls(rank, ws)):
        x, w, ids = R.route(rank, ws, n, gen, op.ep_op.device, avoid_last)
        ids = ids.to(torch.int32)  # (SGLang's router makes int32 ids)
        record = step != 1  # (the recorder is off on some steps)
        y, counts, seen = R.sglang_v1_step(op, rank, ws, x, w, ids, record=record)
        R.check(y, seen, w, ids)
        want = R.expected_local_counts(ids, rank, ws)
        if record:
            assert counts.dtype == torch.int32 and counts.shape == (R.EPR,) and torch.equal(counts.cpu(), want)
        if avoid_last and rank == ws - 1:
            assert int(op.local_expert_count.sum()) == 0  # (the last rank received nothing)
    op.close()


def _vllm_job(rank, ws, path):
    _torch_backend()
    mori = R.install_mori()
    R.register_group(mori)
    # one op per micro-batch (DBO), each step's two micro-batches interleaved as vLLM runs them
    ops = [R.v1_op(mori, rank, ws) for _ in range(2)]
    step = R.vllm_ht_step if path == "ht" else R.vllm_ll_step
    gen = torch.Generator().manual_seed(300 + rank)
    for n, avoid_last in R.calls(rank, ws):
        batches = [R.route(rank, ws, max(n - u, 0), gen, ops[0].ep_op.device, avoid_last) for u in range(2)]
        batches = [(x, w, ids.to(torch.int32)) for x, w, ids in batches]  # (vLLM: topk_indices_dtype int32)
        outputs = [torch.empty_like(x) for x, _, _ in batches]
        for op, (x, w, ids), output in zip(ops, batches, outputs):
            step(op, rank, x, w, ids, output)
        for (x, w, ids), output in zip(batches, outputs):
            R.check(output, x, w, ids)
    for op in ops:
        op.close()


def _async_ll_job(rank, ws):
    _torch_backend()
    mori = R.install_mori()
    R.register_group(mori)
    from mori_jit.ops.ep import EpUnsupportedError

    with pytest.raises(EpUnsupportedError, match="kernel_type=AsyncLL: .*send and receive halves.* not built"):
        R.v1_op(mori, rank, ws, kernel_type=mori.ops.EpDispatchCombineKernelType.AsyncLL)
    # nothing was made: the next op of the group is constructed as usual
    R.v1_op(mori, rank, ws).close()


@pytest.mark.parametrize("ws", [2, 4])
def test_sglang_v2_adapter(ws):
    run_distributed(_sglang_v2_job, ws, timeout=240)


@pytest.mark.parametrize("ws,data_type", [(2, "bfloat16"), (4, "bfloat16"), (2, "float8_e4m3fn")])
def test_sglang_v1_adapter_normal_mode(ws, data_type):
    run_distributed(_sglang_v1_job, ws, data_type, timeout=240)


@pytest.mark.parametrize("ws,path", [(2, "ht"), (4, "ht"), (2, "ll")])
def test_vllm_adapters(ws, path):
    run_distributed(_vllm_job, ws, path, timeout=240)


def test_async_ll_is_refused_by_name():
    run_distributed(_async_ll_job, 2, timeout=120)
