"""Errors outside the ranks' agreement make every peer raise within a bound instead of waiting for
the process group's timeout (the ``torch`` backend on gloo; core/watch.py says how and why):

* a close that meets a peer's dispatch: both raise at once (``close`` is agreed), and the group
  stays usable;
* a rank that raises inside an exchange (out of memory while packing, injected): its peers raise
  within a poll of the group's failure record, naming it, and the group refuses every later call;
* a rank that never makes the call, or never constructs its op: its peer gives up after twice
  ``MORI_EP_TIMEOUT_S``;
* a rank killed with SIGKILL: its peer raises as soon as the connection closes.
"""
from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpPeerError, EpStateError
from mori_jit.ops.ep.backends.torch import reference
from mori_jit.ops.ep.core.watch import FAILED_KEY
from mori_jit.testing.distributed import free_port, run_distributed
from mori_jit.testing.golden import golden_check, make_inputs

M, H, K, E = 8, 64, 2, 2
TIMEOUT_S = 2  # MORI_EP_TIMEOUT_S of the test that waits for it (a host wait gives up after twice that)


def _op(rank, ws):
    return EpDispatchCombineOp(EpDispatchCombineConfig(
        rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=E,
        num_experts_per_token=K, kernel_backend="torch"))


def _inputs(rank, ws, seed=0, device=torch.device("cpu")):
    return make_inputs(rank, M, H, K, E * ws, torch.bfloat16, device, torch.Generator().manual_seed(seed + rank))


def _valid_round(op, rank, ws):
    x, w, idx = _inputs(rank, ws, 3, op.device)
    out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
    y, y_w = op.combine(out, weights=out_w, routing=routing)
    golden_check(op.group, rank, ws, M, E, x, w, idx, out, out_w, out_idx, total, routing.recv_src, y, y_w)


def _close_meets_dispatch_job(rank, ws):
    op = _op(rank, ws)
    x, w, idx = _inputs(rank, ws, device=op.device)
    start = time.monotonic()
    steps = r"\(rank 0 in close of op #1; ranks? [\d, ]+ in dispatch 1 of op #1\)"
    if rank == 0:
        with pytest.raises(EpStateError, match=steps):
            op.close()
        with pytest.raises(EpStateError, match="EpDispatchCombineOp is closed"):
            op.dispatch(x, w, None, idx)  # (refused here: its peers know)
    else:
        with pytest.raises(EpStateError, match=steps):
            op.dispatch(x, w, None, idx)
    assert time.monotonic() - start < 10  # (a host wait's timeout is 60 s by default: nobody waited for it)
    with _op(rank, ws) as second:  # nothing was left in a collective: the group serves a new op
        _valid_round(second, rank, ws)


def test_a_close_that_meets_a_dispatch_fails_both_at_once():
    run_distributed(_close_meets_dispatch_job, 2, timeout=90)


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("out of memory while packing (injected)")


def _exchange_failure_job(rank, ws):
    op = _op(rank, ws)
    _valid_round(op, rank, ws)
    x, w, idx = _inputs(rank, ws)
    start = time.monotonic()
    if rank == 0:
        reference.pack_rows = _out_of_memory  # (this process only: a fault on one rank, after the counts)
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            op.dispatch(x, w, None, idx)
    else:
        with pytest.raises(EpPeerError, match=r"dispatch of op #1: a peer failed \(rank 0 raised OutOfMemoryError in "
                                              r"dispatch of op #1, where its peers wait in the exchange it left "
                                              r"\(out of memory while packing \(injected\)\)\); destroy the process "
                                              r"group"):
            op.dispatch(x, w, None, idx)
        assert time.monotonic() - start < 5  # a poll of the record, not the timeout (60 s)
    # a collective is left unfinished: every later call, and a new op, is refused at once
    for call in (lambda: op.dispatch(x, w, None, idx), op.reset, lambda: _op(rank, ws)):
        with pytest.raises(EpStateError, match=r"the process group's EP calls failed earlier \(rank 0 raised "
                                               r"OutOfMemoryError"):
            call()
    op.close()  # (lets go of the op without a collective: the group's failure was raised already)


def test_an_exception_inside_an_exchange_fails_every_peer_at_once():
    run_distributed(_exchange_failure_job, 2, timeout=90)


def _absent_peer_job(rank, ws):
    op = _op(rank, ws)
    x, w, idx = _inputs(rank, ws)
    store = dist.distributed_c10d._get_process_group_store(op.group)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(EpPeerError, match=rf"agreement on dispatch 1 of op #1: rank 0 waited {2 * TIMEOUT_S} s "
                                              rf"\(2 x MORI_EP_TIMEOUT_S\) for its peers, which did not join it"):
            op.dispatch(x, w, None, idx)
        assert 2 * TIMEOUT_S <= time.monotonic() - start < 2 * TIMEOUT_S + 5
    else:  # makes the call only once its peer has given up on it, then fails at once
        store.wait([FAILED_KEY], datetime.timedelta(seconds=60))
        start = time.monotonic()
        with pytest.raises(EpPeerError, match=rf"rank 0 waited {2 * TIMEOUT_S} s"):
            op.dispatch(x, w, None, idx)
        assert time.monotonic() - start < 5
    with pytest.raises(EpStateError, match="failed earlier"):
        op.combine(x, routing=None)


def test_a_peer_that_never_makes_the_call_is_given_up_on_after_the_timeout(monkeypatch):
    monkeypatch.setenv("MORI_EP_TIMEOUT_S", str(TIMEOUT_S))
    run_distributed(_absent_peer_job, 2, timeout=90)


def _absent_constructor_job(rank, ws):
    store = dist.distributed_c10d._get_process_group_store(dist.group.WORLD)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(EpPeerError, match=rf"the exchange of the ranks' cards at construction: rank 0 waited "
                                              rf"{2 * TIMEOUT_S} s \(2 x MORI_EP_TIMEOUT_S\) for its peers"):
            _op(rank, ws)
        assert 2 * TIMEOUT_S <= time.monotonic() - start < 2 * TIMEOUT_S + 5
    else:  # constructs only once its peer has given up on it, and is refused at once
        store.wait([FAILED_KEY], datetime.timedelta(seconds=60))
        start = time.monotonic()
        with pytest.raises(EpStateError, match="failed earlier"):
            _op(rank, ws)
        assert time.monotonic() - start < 5


def test_a_peer_that_never_constructs_its_op_is_given_up_on_after_the_timeout(monkeypatch):
    """The first collective of a construction (the ranks' cards) is bounded like a call's."""
    monkeypatch.setenv("MORI_EP_TIMEOUT_S", str(TIMEOUT_S))
    run_distributed(_absent_constructor_job, 2, timeout=90)


def _gather_objects_job(rank, ws):
    from mori_jit.ops.ep.core.watch import watch_of
    from mori_jit.ops.ep.memory.peers import gather_objects

    mine = {"rank": rank, "blob": "x" * (100 * rank)}  # (pickles of different sizes: the padding is cut off)
    assert gather_objects(dist.group.WORLD, mine, watch_of(dist.group.WORLD).wait, "a test exchange") == \
        [{"rank": r, "blob": "x" * (100 * r)} for r in range(ws)]


def test_gather_objects_returns_every_ranks_object_by_rank():
    run_distributed(_gather_objects_job, 3, timeout=90)


class _CpuPeersProvider:
    """An arena provider on the CPU that reports a peer block per rank (the barrier runs)."""

    kind = "cpu"

    def allocate(self, nbytes, device, group, wait=None):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, [buf.data_ptr()] * dist.get_world_size(group)

    def release(self, tensor, wait=None):
        pass


def _absent_arena_peer_job(rank, ws):
    from mori_jit.ops.ep.core.watch import watch_of
    from mori_jit.ops.ep.memory.arena import SymmArena

    group = dist.group.WORLD
    store = dist.distributed_c10d._get_process_group_store(group)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(EpPeerError, match=rf"the barrier after zeroing the arena at construction: rank 0 waited "
                                              rf"{2 * TIMEOUT_S} s"):
            SymmArena.create({"a": 512}, group, torch.device("cpu"), _CpuPeersProvider(), wait=watch_of(group).wait)
        assert 2 * TIMEOUT_S <= time.monotonic() - start < 2 * TIMEOUT_S + 5
    else:  # never makes its arena
        store.wait([FAILED_KEY], datetime.timedelta(seconds=60))


def test_a_peer_that_never_makes_its_arena_is_given_up_on_after_the_timeout(monkeypatch):
    """The arena's barrier at construction is bounded by the group's watch."""
    monkeypatch.setenv("MORI_EP_TIMEOUT_S", str(TIMEOUT_S))
    run_distributed(_absent_arena_peer_job, 2, timeout=90)


def _failed_construction_job(rank, ws):
    from mori_jit.ops.ep.backends.torch.backend import EpDispatchCombineOpTorch

    if rank == 1:
        def broken(self, cfg, arena):
            raise RuntimeError("a build that fails on one rank (injected)")

        EpDispatchCombineOpTorch._build_kernels = broken  # (this process only)
        with pytest.raises(RuntimeError, match="injected"):
            _op(rank, ws)
        return
    op = _op(rank, ws)  # (its construction has no collective after the cards: it completes)
    x, w, idx = _inputs(rank, ws)
    start = time.monotonic()
    with pytest.raises(EpPeerError, match=r"construction of op #1: rank 1 raised RuntimeError: a build that fails "
                                          r"on one rank \(injected\)"):
        op.dispatch(x, w, None, idx)
    assert time.monotonic() - start < 5


def test_a_construction_that_fails_on_one_rank_fails_its_peers_next_call_naming_it():
    run_distributed(_failed_construction_job, 2, timeout=90)


def _killed_peer_worker(rank, ws, port, path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60))
    op = _op(rank, ws)
    _valid_round(op, rank, ws)
    x, w, idx = _inputs(rank, ws)
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        op.dispatch(x, w, None, idx)
        report = "the dispatch returned"
    except EpPeerError as e:
        report = f"{time.monotonic() - start - 0.5:.3f}\n{e}"
    with open(path, "w") as f:
        f.write(report)
    os._exit(0)  # (the group's peer is gone: no teardown)


def test_a_peer_killed_with_sigkill_fails_the_waiting_rank_at_once(tmp_path):
    ctx, port, path = mp.get_context("spawn"), free_port(), str(tmp_path / "report")
    procs = [ctx.Process(target=_killed_peer_worker, args=(r, 2, port, path)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(90)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    report = open(path).read() if os.path.exists(path) else "no report"
    took, _, message = report.partition("\n")
    assert "agreement on dispatch" in message and "a collective of the group failed on rank 0" in message, report
    assert float(took) < 2.0, report  # (about 0.05 s on a quiet machine)
