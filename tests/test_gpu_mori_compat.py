"""The serving engines' mori adapters replayed on the hip backend (on a GPU machine: ``pytest -m
gpu tests/test_gpu_mori_compat.py``), at every world size of ``MORI_EP_TEST_WORLD_SIZES`` (ranks
share a GPU under MPS where there are fewer GPUs): the replays of ``tests/mori_replays.py``
eagerly, on a side stream between events (the two-batch-overlap pattern), and captured in a CUDA
graph replayed with fresh inputs; each step against the dense result. Also a per-call geometry:
a built one launched, any other refused by name."""
from __future__ import annotations

import pytest
import torch

import mori_replays as R
from mori_jit.testing.cuda_graph import capture
from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

REPLAYS = 6


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _static_inputs(rank, ws, gen):
    """Graph inputs: ``M`` tokens (a captured step has a fixed token count)."""
    return [t.clone() for t in R.route(rank, ws, R.M, gen, _dev())]


def _replay_and_check(rank, ws, gen, step, check):
    """Capture ``step(x, w, ids)`` over static inputs, then replay it with fresh inputs copied in;
    ``check(outputs, x, w, ids)`` after each replay."""
    static = _static_inputs(rank, ws, gen)
    graph, outs = capture(lambda: step(*static))
    for i in range(REPLAYS):
        torch.distributed.barrier()  # (the peers have read their results of the previous replay)
        fresh = R.route(rank, ws, R.M, gen, _dev(), avoid_last=i % 2 == 1)
        for s, t in zip(static, fresh):
            s.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        check(outs, *static)


def _sglang_v2_job(rank, ws):
    mori = R.install_mori()
    op = R.sglang_v2_op(mori, rank, ws)
    assert op.backend_name == "hip"
    gen = torch.Generator().manual_seed(100 + rank)
    side = torch.cuda.Stream()
    for stream in (None, side):
        for n, avoid_last in R.calls(rank, ws):
            x, w, ids = R.route(rank, ws, n, gen, _dev(), avoid_last)
            y = R.sglang_v2_step(op, rank, x, w, ids, stream=stream)
            torch.cuda.synchronize()
            R.check(y, x, w, ids)
    op.check()
    _replay_and_check(rank, ws, gen, lambda x, w, ids: R.sglang_v2_step(op, rank, x, w, ids),
                      lambda y, x, w, ids: R.check(y, x, w, ids))
    op.check()
    op.close()


def _sglang_v1_job(rank, ws, data_type):
    mori = R.install_mori()
    R.register_group(mori)
    op = R.v1_op(mori, rank, ws, data_type=getattr(torch, data_type))
    gen = torch.Generator().manual_seed(200 + rank)
    for n, avoid_last in R.calls(rank, ws):
        x, w, ids = R.route(rank, ws, n, gen, _dev(), avoid_last)
        ids = ids.to(torch.int32)
        y, counts, seen = R.sglang_v1_step(op, rank, ws, x, w, ids)
        torch.cuda.synchronize()
        R.check(y, seen, w, ids)
        assert torch.equal(counts.cpu(), R.expected_local_counts(ids, rank, ws))

    def step(x, w, ids):
        y, counts, seen = R.sglang_v1_step(op, rank, ws, x, w, ids.to(torch.int32))
        return y, counts, seen

    def check(outs, x, w, ids):
        y, counts, seen = outs
        R.check(y, seen, w, ids)
        assert torch.equal(counts.cpu(), R.expected_local_counts(ids, rank, ws))

    _replay_and_check(rank, ws, gen, step, check)
    op.check()
    op.close()


def _vllm_job(rank, ws):
    mori = R.install_mori()
    R.register_group(mori)
    ops = [R.v1_op(mori, rank, ws) for _ in range(2)]  # (one per micro-batch)
    gen = torch.Generator().manual_seed(300 + rank)
    for step in (R.vllm_ht_step, R.vllm_ll_step):
        for n, avoid_last in R.calls(rank, ws):
            batches = [R.route(rank, ws, max(n - u, 0), gen, _dev(), avoid_last) for u in range(2)]
            batches = [(x, w, ids.to(torch.int32)) for x, w, ids in batches]
            outputs = [torch.empty_like(x) for x, _, _ in batches]
            for op, (x, w, ids), output in zip(ops, batches, outputs):
                step(op, rank, x, w, ids, output)
            torch.cuda.synchronize()
            for (x, w, ids), output in zip(batches, outputs):
                R.check(output, x, w, ids)
    output = torch.empty(R.M, R.H, dtype=R.BF16, device=_dev())

    def captured(x, w, ids):
        R.vllm_ht_step(ops[0], rank, x, w, ids.to(torch.int32), output)
        return output

    _replay_and_check(rank, ws, gen, captured, lambda y, x, w, ids: R.check(y, x, w, ids))
    for op in ops:
        op.check()
        op.close()


def _geometry_job(rank, ws):
    from mori_jit.ops.ep import EpArgumentError

    mori = R.install_mori()
    op = R.sglang_v2_op(mori, rank, ws)
    sched = op.kernels.schedule
    gen = torch.Generator().manual_seed(400 + rank)
    x, w, ids = R.route(rank, ws, R.M, gen, _dev())
    buckets = [None] * ws  # (ranks with other shares of a GPU may have other schedules: every rank's turn)
    torch.distributed.all_gather_object(buckets, len(sched.edges))
    for v in range(min(buckets)):  # every built geometry, whatever the call's own bucket
        (db, dw), (cb, cw) = sched.dispatch[v], sched.combine[v]
        out, out_w, _, out_ids, _, routing = op.dispatch(x, w, None, ids.to(torch.int32), return_routing=True,
                                                         block_num=db, warp_per_block=dw)
        y, _ = op.combine(R.expert(out, out_w, out_ids, rank), None, out_ids, routing=routing, block_num=cb,
                          warp_per_block=cw)
        torch.cuda.synchronize()
        R.check(y[:R.M], x, w, ids)
    bogus = max(b for b, _ in sched.dispatch) + 1
    with pytest.raises(EpArgumentError, match=f"block_num={bogus}, warp_per_block=-1: no dispatch variant built"):
        op.dispatch(x, w, None, ids.to(torch.int32), block_num=bogus)
    op.check()
    op.close()


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_sglang_v2_on_hip_eager_side_stream_and_graph(ws):
    run_ep_job(_sglang_v2_job, ws)


@pytest.mark.parametrize("data_type", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_sglang_v1_on_hip_eager_and_graph(ws, data_type):
    run_ep_job(_sglang_v1_job, ws, data_type)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_vllm_ht_and_ll_on_hip_eager_and_graph(ws):
    run_ep_job(_vllm_job, ws)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_per_call_geometry_on_hip(ws):
    run_ep_job(_geometry_job, ws)
