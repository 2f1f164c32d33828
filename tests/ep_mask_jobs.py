"""Rank masking jobs (docs/design.md §6, "Rank masking"), device-generic: the torch backend runs
them on gloo (test_ep_mask_cpu.py), the hip backend on GPUs (test_gpu_ep_mask.py).

A round is a dispatch (and a replay, with ``routing_replay``), a combine and the golden checks
with the masked ranks' experts removed (``golden.golden_check(..., masked=...)``), over the
survivors' group, plus the op's count of the pairs it dropped for them. ``layout`` (config fields,
e.g. ``gpu_per_node`` and ``internode_kernel``) runs a job on the internode kernels.
"""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpDeviceError, EpPeerError, EpStateError
from mori_jit.ops.ep.core.survivors import survivors_group
from mori_jit.ops.ep.memory.arena import keep_until_exit
from mori_jit.testing.golden import golden_check, live_of, make_inputs, masked_pairs
from mori_jit.testing.golden_moe import golden_check_experts

#: MoE options each masking job runs with (every one: counts, layout, int64 ids, replay)
MOE = dict(index_dtype=torch.int64, expert_counts=True, expert_capacity=64, routing_replay=True)


def config(rank: int, ws: int, backend: str, moe: bool, m: int = 16, hidden: int = 128, k: int = 4,
           layout=None):
    """The jobs' config: 2 experts per rank, ``k`` of them per token; ``layout``: more fields."""
    return EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=m,
                                   num_experts_per_rank=2, num_experts_per_token=k, kernel_backend=backend,
                                   **(MOE if moe else {}), **(layout or {}))


def checked_round(op, gen, device, masked=(), n=None) -> None:
    """One round on every live rank, golden-checked with ``masked``'s experts removed."""
    cfg, rank, ws = op.cfg, op.cfg.rank, op.cfg.world_size
    n = cfg.max_num_inp_token_per_rank if n is None else n
    group = survivors_group(op.group, live_of(ws, masked)) if masked else op.group
    x, w, idx = make_inputs(rank, n, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts,
                            cfg.dispatch_dtype, device, gen, drop_frac=0.1, index_dtype=cfg.index_dtype)
    res = op.dispatch(x, w, None, idx, return_result=True)
    dropped = int(op.masked_pairs.item())
    assert dropped == masked_pairs(idx, ws, cfg.num_experts_per_rank, masked), (rank, dropped, masked)
    args = (group, rank, ws, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank)
    if cfg.expert_counts:
        golden_check_experts(*args, x, w, idx, res.expert_counts, res.expert, out=res.out,
                             recv_src=res.routing.recv_src, masked=masked)
        _meet(group, device)  # (the replay below, on any rank, rewrites these rows)
    if cfg.routing_replay:  # a new payload along the same routing
        x = make_inputs(rank, n, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts, cfg.dispatch_dtype,
                        device, gen)[0]
        res = op.dispatch(x, w, None, None, routing=res.routing, return_result=True)
    y, y_w = op.combine(res.out, weights=res.out_weights, routing=res.routing)
    golden_check(*args, x, w, idx, res.out, res.out_weights, res.out_indices, res.total_recv,
                 res.routing.recv_src, y, y_w, masked=masked)
    _meet(group, device)  # (a dispatch's outputs hold until any rank's next dispatch)


def _meet(group, device) -> None:
    """Every live rank has finished reading this round's outputs before any dispatches again."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)


def _store():
    return dist.distributed_c10d._get_default_store()


def _wait_for(key: str, count: int, timeout: float = 120.0) -> None:
    store, end = _store(), time.monotonic() + timeout
    while store.add(key, 0) < count:
        assert time.monotonic() < end, f"{key} never reached {count}"
        time.sleep(0.05)


def mask_and_rejoin_job(rank: int, ws: int, backend: str, moe: bool, device, gone: int, rounds: int = 3,
                        layout=None) -> None:
    """Rank ``gone`` stays away (sleeps); the others mask it, serve, reset among themselves and
    serve again; ``gone``'s own reset is refused until every survivor unmasks it; then all reset
    together and serve every rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    op = EpDispatchCombineOp(config(rank, ws, backend, moe, layout=layout))
    checked_round(op, gen, device)
    store = _store()
    if rank == gone:
        _wait_for("survivors_reset", ws - 1)
        try:
            op.reset()
            raise AssertionError("a masked rank's reset was accepted")
        except EpStateError as e:
            assert f"rank {gone} is masked by" in str(e), e
        store.add("refused", 1)
        _wait_for("unmasked", ws - 1)
    else:
        assert op.active_ranks == tuple(range(ws))
        op.mask_rank(gone)
        assert op.active_ranks == live_of(ws, (gone,)) and op.rank_mask.tolist()[gone] == 1
        status = torch.zeros(ws, dtype=torch.int32, device=op.rank_mask.device)
        op.query_mask_buffer(status)
        assert status.tolist() == [int(r == gone) for r in range(ws)]
        for _ in range(rounds):
            checked_round(op, gen, device, masked=(gone,))
        op.reset()  # among the survivors: `gone` sleeps
        store.add("survivors_reset", 1)
        for _ in range(rounds):
            checked_round(op, gen, device, masked=(gone,))
        _wait_for("refused", 1)
        op.update_mask_buffer(gone, False)  # (DeepEP's spelling of unmask_rank)
        store.add("unmasked", 1)
    op.reset()  # every rank
    assert op.active_ranks == tuple(range(ws))
    for _ in range(rounds):
        checked_round(op, gen, device)
    op.close()


def lost_rank_job(rank: int, ws: int, backend: str, moe: bool, device, gone: int, rounds: int = 50,
                  how: str = "exit", layout=None) -> None:
    """Rank ``gone`` is lost in the middle of a run of rounds (``how``: it exits, or, with a
    harness that stops it, it is stopped); every survivor raises naming a peer's failure
    (EpPeerError from a host collective, EpDeviceError naming ``gone`` from a kernel's wait), masks
    it, resets, and its next ``rounds`` rounds pass the golden check over the live ranks."""
    gen = torch.Generator().manual_seed(200 + rank)
    op = EpDispatchCombineOp(config(rank, ws, backend, moe, layout=layout))
    for _ in range(2):
        checked_round(op, gen, device)
    if rank == gone:
        if how == "stop":  # stalled: it resumes (SIGCONT from a survivor) only to leave
            _store().set("stopped", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)  # (no cleanup, as after kill -9: its connections close, its GPU context goes)
    from mori_jit.ops.ep import knobs
    bound = 2 * knobs.ep.timeout_s
    start = time.monotonic()
    try:
        cfg = op.cfg
        x, w, idx = make_inputs(rank, cfg.max_num_inp_token_per_rank, cfg.hidden_dim, cfg.num_experts_per_token,
                                cfg.num_experts, cfg.dispatch_dtype, device, gen, index_dtype=cfg.index_dtype)
        op.dispatch(x, w, None, idx)  # (a host collective fails here; a kernel's wait gives up later)
        while time.monotonic() - start < bound + 5:
            op.check()  # (a host-mapped word: no sync, so the first timed-out wait is seen at once)
            time.sleep(0.01)
        raise AssertionError("no survivor call failed after a peer was lost")
    except EpDeviceError as e:
        assert e.peer == gone and f"from rank {gone}" in str(e), e
    except EpPeerError:
        pass
    assert time.monotonic() - start < bound, "the survivors did not learn of the loss within 2 x MORI_EP_TIMEOUT_S"
    op.mask_rank(gone)
    op.reset()
    for _ in range(rounds):
        checked_round(op, gen, device, masked=(gone,))
    op.close()  # (among the survivors; the arena is let go of, not released: its release is collective)
    if how == "stop" and rank == min(live_of(ws, (gone,))):
        _wait_for_key("stopped")
        os.kill(int(_store().get("stopped")), signal.SIGCONT)


def _wait_for_key(key: str, timeout: float = 120.0) -> None:
    store, end = _store(), time.monotonic() + timeout
    while not store.check([key]):
        assert time.monotonic() < end, f"{key} never set"
        time.sleep(0.05)


def graph_after_mask_job(rank: int, ws: int, device, gone: int, layout=None) -> None:
    """A dispatch + combine captured in a graph before rank ``gone`` is masked replays correctly
    after: the kernels read the mask at every replay (hip backend)."""
    from mori_jit.testing.cuda_graph import capture

    gen = torch.Generator().manual_seed(300 + rank)
    op = EpDispatchCombineOp(config(rank, ws, "hip", False, layout=layout))
    cfg = op.cfg
    x, w, idx = make_inputs(rank, cfg.max_num_inp_token_per_rank, cfg.hidden_dim, cfg.num_experts_per_token,
                            cfg.num_experts, cfg.dispatch_dtype, device, gen)
    y = torch.empty_like(x, dtype=cfg.combine_dtype)
    y_w = torch.empty_like(w)

    def step():
        out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        op.combine(out, weights=out_w, routing=routing, out=y, out_weights=y_w)
        return out, out_w, out_idx, total, routing.recv_src

    graph, outs = capture(step)
    for masked in ((), (gone,)):
        if rank in masked:
            break
        if masked:
            op.mask_rank(gone)
        for _ in range(3):
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            op.check()
            group = survivors_group(op.group, live_of(ws, masked)) if masked else op.group
            assert int(op.masked_pairs.item()) == masked_pairs(idx, ws, cfg.num_experts_per_rank, masked)
            golden_check(group, rank, ws, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank, x, w, idx,
                         outs[0], outs[1], outs[2], outs[3], outs[4], y, y_w, masked=masked)
            _meet(group, device)  # (the next replay, on any rank, rewrites these rows)
    if rank != gone:
        _store().add("graph_done", 1)
        del graph
        op.close()
    else:
        _wait_for("graph_done", ws - 1)
        # A lost rank takes no part in its peers' collectives: its op (never closed) stays referenced
        # until the process exits, as a dead rank's would. Collected here, its NVSHMEM arena's free,
        # which is collective, would wait for the survivors forever.
        keep_until_exit(op)
