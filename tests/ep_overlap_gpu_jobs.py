"""GPU jobs of the split legs on the hip kernels (CUDA graphs, device-side waits), shared by the
intranode (``tests/test_gpu_ep_overlap.py``) and internode (``tests/test_gpu_ep_internode.py``) GPU
tests: each takes the config fields of the ops it checks."""
from __future__ import annotations

import os
import time
from unittest import mock

import pytest
import torch

from ep_gpu_checks import identity_expert
from ep_overlap_checks import _golden, config, inputs, poison_arena
from mori_jit.testing.cuda_graph import capture


def _other_work(x: torch.Tensor) -> None:
    """Stream work between a send and its receive (a micro-batch's GEMM)."""
    (x.float() @ x.float().t()).sum()


def graph_job(rank, ws, field_sets):
    """For an op of each of ``field_sets`` (config fields): each half in its own graph (replayed
    with other work between send and receive), then a whole step (the four halves) in one graph:
    every replay on fresh inputs, outputs poisoned, golden."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(61 + rank)
    for fields in field_sets:
        with EpDispatchCombineOp(config(rank, ws, "hip", fields)) as op:
            cfg = op.cfg
            sx, sw, sidx = inputs(op, rank, ws, gen)
            y = torch.empty(sx.shape, dtype=cfg.combine_dtype, device=sx.device)
            y_w = torch.empty(sw.shape, dtype=torch.float32, device=sx.device)
            state = {}

            def d_send():
                state["res"] = op.dispatch_send(sx, sw, None, sidx, return_result=True)
                return state["res"]

            def c_send():
                res = state["res"]
                state["inp"] = identity_expert(res.out, cfg.combine_dtype)
                return op.combine_send(state["inp"], weights=res.out_weights, routing=res.routing, out=y,
                                       out_weights=y_w)

            side = torch.cuda.Stream()  # the warm-up: every half once, outside capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                d_send(), op.dispatch_recv(), c_send(), op.combine_recv()
            torch.cuda.current_stream().wait_stream(side)
            graphs = []
            for half in (d_send, op.dispatch_recv, c_send, op.combine_recv):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    half()
                graphs.append(g)

            def step():
                d_send(), op.dispatch_recv(), c_send(), op.combine_recv()
                return state["res"]

            whole, res = capture(step)
            for i in range(12):
                x, w, idx = make_inputs(rank, sx.shape[0], sx.shape[1], sw.shape[1], cfg.num_experts, sx.dtype,
                                        sx.device, gen)
                poison_arena(op)  # (after a barrier: no peer still checks the last replay)
                sx.copy_(x), sw.copy_(w), sidx.copy_(idx)
                y.fill_(float("nan")), y_w.fill_(float("nan"))
                if i % 2:
                    whole.replay()
                else:
                    for g, work in zip(graphs, (sx, None, state["inp"], None)):
                        g.replay()
                        if work is not None:
                            _other_work(work)
                _golden(op, rank, ws, sx, sw, sidx, None, res, y, y_w)
            op.check()


def send_alone_job(rank, ws, field_sets):
    """For an op of each of ``field_sets``: rank 0 sends while its peers send nothing: its send
    kernels end at once (well within the wait bound, no error); its receive waits for the peers,
    gives up and reports them; reset."""
    from mori_jit.ops.ep import EpDeviceError, EpDispatchCombineOp

    gen = torch.Generator().manual_seed(83 + rank)
    with mock.patch.dict(os.environ, {"MORI_EP_TIMEOUT_S": "3"}):  # (read when the op is built)
        ops = [EpDispatchCombineOp(config(rank, ws, "hip", fields)) for fields in field_sets]
    for op in ops:
        x, w, idx = inputs(op, rank, ws, gen)
        res = op.dispatch(x, w, None, idx, return_result=True)  # (every rank: a dispatch to combine)
        torch.cuda.synchronize()
        torch.distributed.barrier()
        for leg in ("dispatch", "combine"):
            if rank == 0:
                t0 = time.monotonic()
                if leg == "dispatch":
                    op.dispatch_send(x, w, None, idx)
                else:
                    op.combine_send(identity_expert(res.out, op.cfg.combine_dtype), weights=res.out_weights,
                                    routing=res.routing)
                torch.cuda.synchronize()
                assert time.monotonic() - t0 < 1.5, f"the {leg} send kernel waited for the peers"
                op.check()  # no wait gave up
                (op.dispatch_recv if leg == "dispatch" else op.combine_recv)()
                torch.cuda.synchronize()
                with pytest.raises(EpDeviceError, match=rf"rank 0: {leg}[ :].* from rank [1-9][0-9]* timed out"):
                    op.check()
            op.reset()  # collective
            res = op.dispatch(x, w, None, idx, return_result=True)
            y, y_w = op.combine(identity_expert(res.out, op.cfg.combine_dtype), weights=res.out_weights,
                                routing=res.routing)
            _golden(op, rank, ws, x, w, idx, None, res, y, y_w)
            torch.cuda.synchronize()
            torch.distributed.barrier()
        op.close()
