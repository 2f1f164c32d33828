"""The combine's fp8 wire (``quant_type``) on the hip kernels, at every world size of
``MORI_EP_TEST_WORLD_SIZES`` (ranks share a GPU under MPS where there are fewer GPUs): the CPU suite's
job (exact golden of identity experts, error against the bf16 combine, saturation, zero-token ranks,
the split legs, the expert-major combine), parity with the torch backend bit for bit on experts
whose outputs differ by rank (so the order of the float32 sum matters), with and without weights,
bf16 and float32 combines, both protocols; and a graph replay. The internode kernels (both families,
on NVSHMEM: ``mori_jit/testing/gpu_world_shmem.py``) run the golden check within the wire's error
and against the exact sum of the cast rows, the parity and the graph replay, in one world per
family and layout."""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.cuda_graph import capture
from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job
from mori_jit.testing.gpu_world_shmem import run_shmem_job
from test_ep_combine_quant_cpu import H, K, M, WIRES, epr, golden_identity_sum, quant_cfg, wire_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

#: combine_low_latency: the flag protocol, and every word its own signal
PROTOCOLS = [False, True]
#: (family, world_size, gpu_per_node) of the internode runs: each family on two nodes or more, v2 with
#: several ranks per node (so that its forwarders pass rows on within a node and across nodes)
NET_CASES = [(f, ws, g) for f, ws, g in (("v2_ll", 4, 2), ("v2", 4, 2), ("v2_ll", 8, 2), ("v2", 8, 4))
             if ws in WORLD_SIZES]
#: The golden check's tolerance for y = U * x through the wire: e4m3 keeps 3 mantissa bits, so a cast
#: value is within 2^-4 of x relatively, plus the bf16 output's rounding (2^-9); a value below
#: e4m3's smallest normal (2^-6) is within 2^-10 absolutely, once per destination rank (at most K).
FP8_RTOL, FP8_ATOL = 2 ** -4 + 2 ** -8, K * 2 ** -10 + 1e-3


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _experts(res, rank, dtype):
    """Expert outputs that differ by rank and by source token (keyed by each row's source id, not its
    receive row: the hip backend's arrival order varies): each rank's float32 terms differ, so a sum
    in another order than the kernels' would round differently. Computed on the CPU for either
    backend, so that both get the same bits (``sin`` on a GPU and on the CPU differ in the last bit,
    and a float32 block scale carries that bit into every value of its block)."""
    out = res.out.cpu()
    ids = res.routing.recv_src[:out.shape[0]].cpu()  # (the torch backend keeps only the received rows' ids)
    src = torch.zeros(out.shape[0])
    src[:ids.shape[0]] = ids.to(torch.float32)
    src = torch.where(torch.arange(out.shape[0]) < res.total_recv.cpu().long(), src, 0.0)
    y = out.float() * (1.0 + 0.37 * rank) + torch.sin(src[:, None] * 0.731 + rank)
    return y.to(dtype).to(res.out.device)


def _golden_job(rank, ws, quant, scale_bytes, layout):
    """Identity experts, each call with weights: the golden check (y = U * x, mori_jit/testing/golden.py)
    within the wire's error, and y exactly the sum of the cast rows (every term the same: any order)."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import golden_check, make_inputs

    gen = torch.Generator().manual_seed(555 + rank)
    with EpDispatchCombineOp(quant_cfg(rank, ws, "hip", quant, scale_bytes, **layout)) as op:
        for call, n in enumerate([M, [0, 5, M - 1, 9][rank % 4], 1 + rank]):
            x, w, idx = make_inputs(rank, n, H, K, epr(ws) * ws, torch.bfloat16, _dev(), gen, drop_frac=0.2,
                                    world_size=ws)
            res = op.dispatch(x, w, None, idx, return_result=True)
            y, y_w = op.combine(res.out, weights=res.out_weights, routing=res.routing)
            golden_check(op.group, rank, ws, M, epr(ws), x, w, idx, res.out, res.out_weights, res.out_indices,
                         res.total_recv, res.routing.recv_src, y, y_w, atol=FP8_ATOL, rtol=FP8_RTOL)
            want = golden_identity_sum(x, idx, ws, quant, scale_bytes, torch.bfloat16)
            diff = y.view(torch.int16) != want.view(torch.int16)
            assert not bool(diff.any()), f"{quant}/{scale_bytes} {layout} call {call} (rank {rank} of {ws}): " \
                                         f"{int(diff.sum())} elements differ from the sum of the cast rows"
        op.check()


def _parity_job(rank, ws, quant, scale_bytes, layout):
    """hip against torch, bit for bit: y and y_w of each call, bf16 and float32 combines (``layout``:
    the op's protocol or internode fields)."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(4242 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        fields = dict(data_type=dtype, **layout)
        with EpDispatchCombineOp(quant_cfg(rank, ws, "hip", quant, scale_bytes, **fields)) as op, \
                EpDispatchCombineOp(quant_cfg(rank, ws, "torch", quant, scale_bytes, data_type=dtype)) as ref:
            for call, n in enumerate([M, [0, 5, M - 1, 9][rank % 4], 1 + rank, M]):
                x, w, idx = make_inputs(rank, n, H, K, epr(ws) * ws, dtype, _dev(), gen, drop_frac=0.2, world_size=ws)
                w = w if call != 2 else None
                res = op.dispatch(x, w, None, idx, return_result=True)
                y, y_w = op.combine(_experts(res, rank, dtype), weights=res.out_weights, routing=res.routing)
                on = ref.device
                r = ref.dispatch(x.to(on), None if w is None else w.to(on), None, idx.to(on), return_result=True)
                yr, yr_w = ref.combine(_experts(r, rank, dtype), weights=r.out_weights, routing=r.routing)
                where = f"{quant}/{scale_bytes} {dtype} {layout} call {call} (rank {rank} of {ws})"
                bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                diff = y.view(bits).cpu() != yr.view(bits).cpu()
                assert not bool(diff.any()), f"{where}: {int(diff.sum())} elements differ from the torch backend"
                assert (y_w is None) == (w is None) and (y_w is None or torch.equal(y_w.cpu(), yr_w.cpu())), where
            op.check()


def _graph_job(rank, ws, quant, scale_bytes, layout):
    """dispatch + combine captured once, replayed on new inputs: each replay equals the torch
    backend's eager result bit for bit."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(99 + rank)
    with EpDispatchCombineOp(quant_cfg(rank, ws, "hip", quant, scale_bytes, **layout)) as op, \
            EpDispatchCombineOp(quant_cfg(rank, ws, "torch", quant, scale_bytes)) as ref:
        def inputs():
            return make_inputs(rank, M, H, K, epr(ws) * ws, torch.bfloat16, _dev(), gen, drop_frac=0.2, world_size=ws)

        static = inputs()

        def step():
            res = op.dispatch(*static[:2], None, static[2], return_result=True)
            return op.combine(res.out, weights=res.out_weights, routing=res.routing)

        graph, (y, y_w) = capture(step)
        for i in range(4):
            torch.distributed.barrier()
            for dst, src in zip(static, inputs()):
                dst.copy_(src)
            y.fill_(float("nan")), y_w.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            on = ref.device
            r = ref.dispatch(*(t.to(on) for t in static[:2]), None, static[2].to(on), return_result=True)
            yr, yr_w = ref.combine(r.out, weights=r.out_weights, routing=r.routing)
            assert torch.equal(y.view(torch.int16).cpu(), yr.view(torch.int16).cpu()), f"replay {i}: y"
            assert torch.equal(y_w.cpu(), yr_w.cpu()), f"replay {i}: y_w"
        op.check()


@pytest.mark.parametrize("low", PROTOCOLS, ids=["flags", "ll"])
@pytest.mark.parametrize("quant, scale_bytes", WIRES)
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_fp8_wire_matches_the_golden(ws, quant, scale_bytes, low):
    run_ep_job(wire_job, ws, "hip", quant, scale_bytes, torch.int64, low)


@pytest.mark.parametrize("low", PROTOCOLS, ids=["flags", "ll"])
@pytest.mark.parametrize("quant, scale_bytes", WIRES)
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_fp8_wire_is_the_torch_backends_bit_for_bit(ws, quant, scale_bytes, low):
    run_ep_job(_parity_job, ws, quant, scale_bytes, dict(combine_low_latency=low))


@pytest.mark.parametrize("low", PROTOCOLS, ids=["flags", "ll"])
@pytest.mark.parametrize("quant, scale_bytes", WIRES)
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_fp8_wire_in_a_graph_replay(ws, quant, scale_bytes, low):
    run_ep_job(_graph_job, ws, quant, scale_bytes, dict(combine_low_latency=low))


def _net_job(rank, ws, gpn, family, quant, scale_bytes):
    """Every check of one internode family in one world (a world's start-up, NVSHMEM's included, is
    most of a short check's time)."""
    layout = dict(gpu_per_node=gpn, internode_kernel=family)
    for job in (_golden_job, _parity_job, _graph_job):
        job(rank, ws, quant, scale_bytes, layout)
        torch.distributed.barrier()


@pytest.mark.parametrize("quant, scale_bytes", WIRES)
@pytest.mark.parametrize("family, ws, gpn", NET_CASES, ids=[f"{f}-ws{ws}-gpn{g}" for f, ws, g in NET_CASES])
def test_internode_fp8_wire_golden_parity_graph(family, ws, gpn, quant, scale_bytes):
    run_shmem_job(_net_job, ws, gpn, family, quant, scale_bytes, timeout=1200)
