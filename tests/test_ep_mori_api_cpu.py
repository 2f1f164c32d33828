"""CPU tests of what mori's op API adds to the EP op (the torch backend on gloo, and the schedule's
geometry lookup): a communicator for a group, ``effective_max_recv``, combine's optional routing,
``call_local_expert_count``/``local_expert_count``, per-call geometry honoured or refused by name,
``get_registered_combine_input_buffer``, combine's ``use_external_inp_buf``/``call_reset``,
``backend_name`` and the combine-wire ``quant_type`` refused at construction."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from mori_jit.ops.ep import (EpArgumentError, EpArgumentTypeError, EpDispatchCombineConfig, EpDispatchCombineOp,
                             EpStateError, EpUnsupportedError)
from mori_jit.ops.ep.core.schedule import Schedule
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.golden import golden_check, make_inputs

M, H, EPR, K = 12, 64, 3, 2


def _cfg(rank, ws, **fields):
    return EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                   num_experts_per_rank=EPR, num_experts_per_token=K, kernel_backend="torch",
                                   **fields)


def _step(op, rank, ws, gen, n, **dispatch_options):
    """One dispatch and a combine without routing, golden-checked; returns the dispatch's outputs."""
    x, w, idx = make_inputs(rank, n, H, K, op.cfg.num_experts, torch.bfloat16, op.device, gen)
    out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True, **dispatch_options)
    y, y_w = op.combine(out, out_w, idx)  # (mori's positional form; the routing is the latest dispatch's)
    golden_check(op.group, rank, ws, M, EPR, x, w, idx, out, out_w, out_idx, total, routing.recv_src, y, y_w)
    return out, out_w, out_idx, total, routing


def _api_job(rank, ws):
    gen = torch.Generator().manual_seed(7 + rank)
    # a communicator-like object stands for its group
    comm = types.SimpleNamespace(process_group=dist.group.WORLD)
    with pytest.raises(EpStateError, match="routing=None takes the latest dispatch's routing"):
        with EpDispatchCombineOp(_cfg(rank, ws), comm) as op:
            op.combine(torch.zeros(0, H, dtype=torch.bfloat16), None)
    with EpDispatchCombineOp(_cfg(rank, ws, expert_counts=True), comm) as op:
        assert op.group is dist.group.WORLD and op.backend_name == "torch"
        assert op.cfg.effective_max_recv == op.cfg.recv_capacity == ws * M
        with pytest.raises(EpStateError, match="local_expert_count: no dispatch has run"):
            op.local_expert_count
        for n in (M, 0, M - 2 * rank):
            out, _, out_idx, total, _ = _step(op, rank, ws, gen, n, call_local_expert_count=True)
            ids = out_idx[:int(total)]
            local = ids[(ids >= rank * EPR) & (ids < (rank + 1) * EPR)] - rank * EPR
            want = torch.bincount(local.flatten().long(), minlength=EPR).to(torch.int32)
            assert op.local_expert_count.dtype == torch.int32 and torch.equal(op.local_expert_count, want)
        # the registered combine input buffer: one tensor, read in place by combine, both input modes
        buf = op.get_registered_combine_input_buffer(torch.bfloat16)
        assert buf is op.get_registered_combine_input_buffer(torch.bfloat16, hidden_dim=H) is \
            op.get_combine_input_buffer() and buf.shape == (ws * M, H)
        with pytest.raises(EpArgumentTypeError, match=r"dtype=torch.float32: .* combine dtype torch.bfloat16"):
            op.get_registered_combine_input_buffer(torch.float32)
        with pytest.raises(EpArgumentError, match=f"hidden_dim=32: .* pass -1 or {H}"):
            op.get_registered_combine_input_buffer(torch.bfloat16, hidden_dim=32)
        for mode, reset in ((0, False), (1, True), (-1, True)):
            x, w, idx = make_inputs(rank, M, H, K, op.cfg.num_experts, torch.bfloat16, op.device, gen)
            out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
            buf.copy_(out)
            y, y_w = op.combine(buf, out_w, idx, use_external_inp_buf=mode, call_reset=reset)
            golden_check(op.group, rank, ws, M, EPR, x, w, idx, out, out_w, out_idx, total, routing.recv_src, y, y_w)
        # refused on every rank, before any exchange
        with pytest.raises(EpArgumentError, match=r"use_external_inp_buf=2: allowed -1 .*, 0 .* or 1"):
            op.combine(buf, out_w, use_external_inp_buf=2)
        with pytest.raises(EpArgumentTypeError, match="call_reset=1: expected True or False"):
            op.combine(buf, out_w, call_reset=1)
        # a geometry no built variant has (the torch backend launches none) and network blocks
        with pytest.raises(EpArgumentError, match=r"dispatch: block_num=80, warp_per_block=16: no dispatch variant "
                                                  r"built .* \[\(0, 0\)\]"):
            _step(op, rank, ws, gen, M, block_num=80, warp_per_block=16)
        with pytest.raises(EpUnsupportedError, match="combine: rdma_block_num=8: the kernels give no blocks"):
            op.combine(buf, out_w, rdma_block_num=8)
        with pytest.raises(EpArgumentTypeError, match=r"block_num='8': expected an int"):
            op.combine(buf, out_w, block_num="8")
        _step(op, rank, ws, gen, M, block_num=0, rdma_block_num=-1, warp_per_block=None)  # (<= 0, None: the op's)
    with EpDispatchCombineOp(_cfg(rank, ws)) as op:  # no counts asked for in the config
        with pytest.raises(EpUnsupportedError, match="call_local_expert_count=True: .*expert_counts=True"):
            _step(op, rank, ws, gen, M, call_local_expert_count=True)
        with pytest.raises(EpUnsupportedError, match="local_expert_count: .*expert_counts=True"):
            op.local_expert_count
    for quant in ("fp4_blockwise", "fp4_blockwise_fp32"):  # (the fp8 ones: test_ep_combine_quant_cpu.py)
        with pytest.raises(EpUnsupportedError, match=f"quant_type='{quant}' \\(mori's combine-wire quantization"):
            EpDispatchCombineOp(_cfg(rank, ws, quant_type=quant))


def test_mori_call_options_on_the_torch_backend():
    run_distributed(_api_job, 2, timeout=180)


def _geometry_job(rank, ws):
    """A call that names a built geometry launches that variant: the torch backend's kernel set
    with a three-bucket schedule in place of its own, recording the bucket each call launches."""
    gen = torch.Generator().manual_seed(11 + rank)
    with EpDispatchCombineOp(_cfg(rank, ws)) as op:
        k, launched = op._kernels, []

        def record(leg, fn):
            def call(v, *args):
                launched.append((leg, v))
                return fn(v, *args)
            return call

        sched = Schedule((4, 8, None), ((8, 2), (16, 4), (32, 4)), ((8, 4), (16, 4), (16, 8)))
        op._kernels = dataclasses.replace(k, schedule=sched, dispatch=record("dispatch", k.dispatch),
                                          combine=record("combine", k.combine))
        op._pick = sched.index
        x, w, idx = make_inputs(rank, M, H, K, op.cfg.num_experts, torch.bfloat16, op.device, gen)
        for geometry, want in (({}, 2), (dict(block_num=16), 1), (dict(warp_per_block=2), 0),
                               (dict(block_num=32, warp_per_block=4), 2)):
            launched.clear()
            out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True, **geometry)
            y, y_w = op.combine(out, out_w, routing=routing, block_num=16, warp_per_block=8)
            assert launched == [("dispatch", want), ("combine", 2)], (geometry, launched)
            golden_check(op.group, rank, ws, M, EPR, x, w, idx, out, out_w, out_idx, total, routing.recv_src, y, y_w)
        with pytest.raises(EpArgumentError, match=r"combine: block_num=32, warp_per_block=-1: no combine variant .* "
                                                  r"\[\(8, 4\), \(16, 4\), \(16, 8\)\]"):
            op.combine(out, out_w, routing=routing, block_num=32)
        op._kernels = k  # (the backend's own, for close)


def test_per_call_geometry_launches_a_built_variant():
    run_distributed(_geometry_job, 2, timeout=120)


def test_schedule_find_keeps_to_the_calls_own_bucket_and_group():
    s = Schedule((4, 8, None), ((8, 2), (16, 4), (8, 2)), ((8, 4),) * 3)
    assert s.find("dispatch", 10, 8, 2) == 2  # its own bucket has the geometry
    assert s.find("dispatch", 10, 16, -1) == 1 and s.find("dispatch", 1, -1, 4) == 1
    assert s.find("dispatch", 1, 32, -1) is None and s.find("combine", 1, -1, 4) == 0
    # buckets of another group (another internode family) are never taken
    g = dataclasses.replace(s, groups=("v2_ll", "v2_ll", "v2"))
    assert g.find("dispatch", 1, 16, 4) == 1 and g.find("dispatch", 10, 16, 4) is None
    assert g.find("dispatch", 10, 8, 2) == 2 and g.find("dispatch", 1, 8, 2) == 0
