"""Jobs of the split legs beside the golden rounds (``ep_overlap_checks``): their misuse, refused on
the calling rank before anything is launched, and two micro-batches in flight with one op each.
Device-generic: the CPU tests run them on the torch backend, the GPU tests on the hip kernels."""
from __future__ import annotations

import pytest
import torch

from ep_gpu_checks import identity_expert
from ep_overlap_checks import _golden, config, expect_state_error, inputs
from test_ep_moe_cpu import K


def _sync(op) -> None:
    if op.arena is not None:
        torch.cuda.synchronize()
    torch.distributed.barrier()


def misuse_job(rank, ws, backend, layout=None, moe=True):
    """Every out-of-step call raises EpStateError naming the in-flight leg (or its absence) and
    what may follow, launches nothing, and leaves the leg in flight intact: its receive then
    passes the golden check. ``layout``: fields every op takes (internode: ``gpu_per_node``,
    ``internode_kernel``); ``moe``: the op has the expert-major layout (and its combine is refused too)."""
    from mori_jit.ops.ep import EpDispatchCombineOp, EpUnsupportedError

    gen = torch.Generator().manual_seed(99 + rank)
    layout = layout or {}
    fields = dict(layout, **(dict(expert_counts=True, expert_capacity=-1) if moe else {}))
    with EpDispatchCombineOp(config(rank, ws, backend, fields)) as op:
        x, w, idx = inputs(op, rank, ws, gen)
        with expect_state_error(r"dispatch_recv: no dispatch_send is in flight on this op; a receive follows its send"):
            op.dispatch_recv()
        with expect_state_error(r"combine_recv: no combine_send is in flight on this op; a receive follows its send"):
            op.combine_recv()
        res = op.dispatch_send(x, w, None, idx, return_result=True)
        in_flight = r"a dispatch_send is in flight on this op: the next call must be dispatch_recv\(\)"
        for call in (lambda: op.dispatch_send(x, w, None, idx), lambda: op.dispatch(x, w, None, idx),
                     lambda: op.dispatch(x, w, None, idx, return_recv_hook=True),
                     lambda: op.combine(res.out, weights=res.out_weights, routing=res.routing),
                     lambda: op.combine_send(res.out, weights=res.out_weights, routing=res.routing),
                     *([lambda: op.combine_expert_major(res.expert.x.to(op.cfg.combine_dtype), routing=res.routing)]
                       if moe else [])):
            with expect_state_error(in_flight + r" \(or the hook that send returned\); its outputs and routing are not "
                                    r"valid before that receive"):
                call()
        with expect_state_error(r"combine_recv: no combine_send is in flight on this op \(a dispatch_send is: call "
                                r"dispatch_recv\(\)\)"):
            op.combine_recv()
        op.dispatch_recv()
        _golden(op, rank, ws, x, w, idx, None, res)  # the refused calls changed nothing
        _sync(op)  # (a dispatch's outputs hold until any rank's next dispatch: no peer's may start first)
        with expect_state_error("dispatch_recv: no dispatch_send is in flight"):
            op.dispatch_recv()  # a second receive
        # the hook receives once; a stale hook never receives a later send
        res, hook = op.dispatch(x, w, None, idx, return_result=True, return_recv_hook=True)
        hook()
        with expect_state_error("dispatch hook: its dispatch_send has already been received"):
            hook()
        res = op.dispatch_send(x, w, None, idx, return_result=True)
        with expect_state_error("dispatch hook: its dispatch_send has already been received"):
            hook()
        op.dispatch_recv()
        # a combine in flight refuses a dispatch; the tuple spelling appends the hook
        inp = identity_expert(res.out, op.cfg.combine_dtype)
        y, y_w, chook = op.combine(inp, weights=res.out_weights, routing=res.routing, return_recv_hook=True)
        with expect_state_error(r"a combine_send is in flight on this op: the next call must be combine_recv\(\) "
                                r"\(or the hook that send returned\); its outputs are not valid before that receive"):
            op.dispatch_send(x, w, None, idx)
        with expect_state_error(r"dispatch_recv: no dispatch_send is in flight on this op \(a combine_send is"):
            op.dispatch_recv()
        chook()
        _golden(op, rank, ws, x, w, idx, None, res, y, y_w)
        _sync(op)
        *outs, routing, dhook = op.dispatch(x, w, None, idx, return_routing=True, return_recv_hook=True)
        assert len(outs) == 5 and callable(dhook)
        dhook()
        # reset (collective) ends a leg in flight: its receive is refused, the op works on
        op.dispatch_send(x, w, None, idx)
        op.reset()
        with expect_state_error("dispatch_recv: no dispatch_send is in flight"):
            op.dispatch_recv()
        _sync(op)
        if backend == "torch":  # a rank out of step: every rank refuses (the arguments' agreement)
            _out_of_step(op, rank, x, w, idx)
        res = op.dispatch(x, w, None, idx, return_result=True)
        _golden(op, rank, ws, x, w, idx, None, res)
        op.check()
    with EpDispatchCombineOp(config(rank, ws, backend, layout, split=False)) as plain:
        x, w, idx = inputs(plain, rank, ws, gen)
        for call in (lambda: plain.dispatch_send(x, w, None, idx),
                     lambda: plain.dispatch(x, w, None, idx, return_recv_hook=True),
                     lambda: plain.combine_send(x, weights=w, routing=None)):
            with pytest.raises(EpUnsupportedError, match=r"the op was built without the split legs; set "
                                                         r"EpDispatchCombineConfig.split_send_recv=True"):
                call()


def _out_of_step(op, rank, x, w, idx):
    """Rank 0 sends twice; its peers send, receive and send again: rank 0 raises EpStateError,
    every peer EpPeerError naming it, and nobody is left inside an exchange."""
    from mori_jit.ops.ep import EpPeerError

    op.dispatch_send(x, w, None, idx)
    if rank != 0:
        op.dispatch_recv()
    if rank == 0:
        with expect_state_error("a dispatch_send is in flight"):
            op.dispatch_send(x, w, None, idx)
        op.dispatch_recv()
    else:
        with pytest.raises(EpPeerError, match=r"dispatch: rank 0 refused its arguments \(EpStateError: a "
                                              r"dispatch_send is in flight"):
            op.dispatch_send(x, w, None, idx)


def micro_batches_job(rank, ws, backend, schedule):
    """Two micro-batches, one op each (an op has one leg in flight): ``interleaved`` keeps both
    batches' sends in flight at once; ``dbo`` is vLLM's dual-batch overlap order (each receive
    after the other batch's compute). Each batch's result passes the golden check."""
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(7 + rank)
    with EpDispatchCombineOp(config(rank, ws, backend)) as a, EpDispatchCombineOp(config(rank, ws, backend)) as b:
        if a.arena is not None:  # one arena per op, each the whole layout (docs/design.md §7)
            from mori_jit.ops.ep.memory.arena import layout
            assert a.arena.tensor.nbytes == b.arena.tensor.nbytes == layout(a.arena.sizes)[1] > 0
        for step in range(3):
            batches = [(op, inputs(op, rank, ws, gen, n=(M_of(op) - 3 * i - step) % (M_of(op) + 1)))
                       for i, op in enumerate((a, b))]
            got = _run_schedule(batches, schedule)
            for (op, (x, w, idx)), (res, y, y_w) in zip(batches, got):
                _golden(op, rank, ws, x, w, idx, None, res, y, y_w)
                _sync(op)
        a.check(), b.check()


def M_of(op) -> int:
    return op.cfg.max_num_inp_token_per_rank


def _compute(x: torch.Tensor) -> None:
    """Stand-in for the other batch's work on the stream between a send and its receive."""
    (x.float() @ x.float().t()).sum()


def _run_schedule(batches, schedule):
    (a, (xa, wa, ia)), (b, (xb, wb, ib)) = batches

    def combine_send(op, res):
        return op.combine_send(identity_expert(res.out, op.cfg.combine_dtype), weights=res.out_weights,
                               routing=res.routing)

    if schedule == "interleaved":
        ra = a.dispatch_send(xa, wa, None, ia, return_result=True)
        rb = b.dispatch_send(xb, wb, None, ib, return_result=True)
        _compute(xa)
        a.dispatch_recv(), b.dispatch_recv()
        ya, yb = combine_send(a, ra), combine_send(b, rb)
        _compute(xb)
        b.combine_recv(), a.combine_recv()
    else:  # D1 send, A0, D1 recv, D0 send, MLP1, D0 recv, C1 send, MLP0, C1 recv, C0 send, A1, C0 recv
        rb, hb = b.dispatch(xb, wb, None, ib, return_result=True, return_recv_hook=True)
        _compute(xa)
        hb()
        ra, ha = a.dispatch(xa, wa, None, ia, return_result=True, return_recv_hook=True)
        _compute(rb.out)
        ha()
        yb = combine_send(b, rb)
        _compute(ra.out)
        b.combine_recv()
        ya = combine_send(a, ra)
        _compute(xa)
        a.combine_recv()
    out = [(ra, *ya), (rb, *yb)]
    assert all(r[1].shape == (x.shape[0], x.shape[1]) for r, x in zip(out, (xa, xb)))
    assert all(r[2] is not None and r[2].shape == (x.shape[0], K) for r, x in zip(out, (xa, xb)))
    return out


def router_dtype_job(rank, ws, backend):
    """A bf16 and an fp16 router's weights through the split dispatch: received as the float32
    weights the unsplit dispatch receives for the same values (the cast is exact), golden."""
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(313 + rank)
    with EpDispatchCombineOp(config(rank, ws, backend)) as op:
        for dtype in (torch.bfloat16, torch.float16):
            x, w, idx = inputs(op, rank, ws, gen)
            w = w.to(dtype)
            res = op.dispatch_send(x, w, None, idx, return_result=True)
            op.dispatch_recv()
            _golden(op, rank, ws, x, w.float(), idx, None, res)
            _sync(op)
