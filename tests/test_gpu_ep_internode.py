"""GPU tests of the internode EP kernels (``v2_ll``, ``v2`` and ``auto`` on NVSHMEM; on a GPU machine:
``pytest -m gpu``).

Nodes are made by ``gpu_per_node``: a peer on another "node" is reached only by NVSHMEM puts, one on
the same node by plain stores, so with several PEs on one GPU every network put still goes through
the engine's API (carried by its P2P transport, not RDMA). Ranks that share a GPU run under CUDA MPS
with each rank's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set (``mori_jit/testing/gpu_world_shmem.py``).
Every check is the golden check (``mori_jit/testing/golden.py``) on fresh random data with the
outputs poisoned first, most also against the ``torch`` backend. The split legs (send and receive
kernels) run the intranode split's jobs (``ep_overlap_checks``, ``ep_overlap_jobs``,
``ep_overlap_gpu_jobs``) on the internode layouts.
"""
from __future__ import annotations

import os
import time
from unittest import mock

import pytest
import torch

from ep_gpu_checks import combine_short_and_expect_reports, dispatch_combine_step, replays_match_golden
from ep_gpu_checks import identity_expert as _expert
from ep_gpu_checks import parity_with_torch as _parity
from ep_gpu_checks import BF16, DTYPE_PAIRS
from ep_overlap_checks import split_job
from ep_overlap_gpu_jobs import graph_job, send_alone_job
from ep_overlap_jobs import misuse_job
from mori_jit.testing.gpu_world import WORLD_SIZES
from mori_jit.testing.gpu_world_shmem import run_shmem_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


#: (world_size, gpu_per_node): every world size with two or more nodes
LAYOUTS = [(ws, g) for ws, g in ((4, 2), (4, 1), (8, 4), (8, 2), (8, 1)) if ws in WORLD_SIZES]
_POISONED = ("disp_out", "out_wts", "out_idx", "recv_to_src", "total_recv", "comb_recv", "comb_recv_wts", "recv_relay",
             "comb_relay", "comb_relay_wts")
FAMILIES = ("v2_ll", "v2")
#: (family, world_size, gpu_per_node) of the split legs' checks: v2 with several ranks per node, so
#: that its receive kernels forward
SPLIT_CASES = [(f, ws, g) for f, ws, g in (("v2_ll", 4, 1), ("v2", 4, 2), ("v2_ll", 8, 2), ("v2", 8, 4))
               if ws in WORLD_SIZES]
#: the split checks' dtype configs (ep_overlap_checks.CONFIGS; no MoE options internode)
SPLIT_CONFIGS = ("bf16", "fp32", "fp8_bf16")


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _cfg(rank, ws, gpn, hidden, k, disp, comb, m, backend="hip", **kw):
    from mori_jit.ops.ep import EpDispatchCombineConfig

    same = disp == comb
    kw.setdefault("internode_kernel", "v2_ll")
    return EpDispatchCombineConfig(
        rank=rank, world_size=ws, gpu_per_node=gpn, hidden_dim=hidden, max_num_inp_token_per_rank=m,
        num_experts_per_rank=max(1, 16 // ws), num_experts_per_token=k, data_type=disp,
        dispatch_data_type=None if same else disp, combine_data_type=None if same else comb,
        kernel_backend=backend, **kw)


def _poison(op):
    a = op.arena
    for name in _POISONED:
        a.tensor[a.offsets[name]:a.offsets[name] + a.sizes[name]].fill_(0xFF)
    torch.cuda.synchronize()
    torch.distributed.barrier()


def _round(op, rank, ws, gen, n, *, drop=0.0, all_to=None, ref=None):
    from mori_jit.testing.golden import golden_check, make_inputs

    cfg = op.cfg
    x, w, idx = make_inputs(rank, n, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts,
                            cfg.dispatch_dtype, _dev(), gen, drop_frac=drop, all_to_rank=all_to, world_size=ws)
    _poison(op)
    out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
    exp = _expert(out, cfg.combine_dtype)
    exp[total.item():].fill_(float("nan"))  # rows past total_recv must never be read
    y, y_w = op.combine(exp, weights=out_w, routing=routing)
    golden_check(op.group, rank, ws, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank,
                 _expert(x, cfg.combine_dtype), w, idx, exp, out_w, out_idx, total, routing.recv_src, y, y_w)
    if ref is not None:
        _parity(op, ref, x, w, idx, out, out_w, out_idx, total, routing, y, y_w)
    op.check()
    return total.item()


def _golden_job(rank, ws, gpn, family):
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(4321 + rank)
    m = 64
    cases = [(2048, 8, d, c) for d, c in DTYPE_PAIRS] + [(7168, 8, BF16, BF16), (4096, 1, BF16, BF16)]
    for hidden, k, disp, comb in cases:
        kw = {"internode_kernel": family}
        with EpDispatchCombineOp(_cfg(rank, ws, gpn, hidden, k, disp, comb, m, **kw), None) as op, \
                EpDispatchCombineOp(_cfg(rank, ws, gpn, hidden, k, disp, comb, m, "torch"), None) as ref:
            assert op.memory_kind == "nvshmem"
            for n, drop, all_to in ((m, 0.0, None), (37, 0.0, None), (0, 0.0, None), (m, 0.3, None),
                                    (m, 0.0, ws - 1), (1, 0.0, None)):
                _round(op, rank, ws, gen, n if rank % 2 == 0 else max(0, n - 5), drop=drop, all_to=all_to, ref=ref)


def _auto_job(rank, ws, gpn):
    """``auto`` switching family between calls (every rank's call on the same side of the threshold):
    ``v2_ll`` up to 96 tokens, ``v2`` above; the device-side epochs of both stay in step."""
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(77 + rank)
    m = 256
    kw = {"internode_kernel": "auto", "internode_auto_ll_max_tokens": 96}
    with EpDispatchCombineOp(_cfg(rank, ws, gpn, 2048, 8, BF16, BF16, m, **kw), None) as op, \
            EpDispatchCombineOp(_cfg(rank, ws, gpn, 2048, 8, BF16, BF16, m, "torch"), None) as ref:
        assert op.kernels.schedule.edges == (96, 128, None), op.kernels.schedule
        for n in (256, 96, 97, 5, 200, 1, 128, 129, 96, 0, 256):
            _round(op, rank, ws, gen, n, ref=ref)


def _rounds_job(rank, ws, gpn, family):
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(99 + rank)
    with EpDispatchCombineOp(_cfg(rank, ws, gpn, 2048, 8, BF16, BF16, 64, internode_kernel=family), None) as op:
        for i in range(200):  # no reset() between rounds: device-side epochs and counters
            _round(op, rank, ws, gen, int(torch.randint(0, 65, (1,), generator=gen)))
            if i % 50 == 0:
                print(f"[rank {rank}] round {i} ok", flush=True)
        # dispatches with no combine between them: each waits for the peers to free their slots
        for _ in range(3):
            _round(op, rank, ws, gen, 64)
            torch.distributed.barrier()
            from mori_jit.testing.golden import make_inputs
            x, w, idx = make_inputs(rank, 64, 2048, 8, op.cfg.num_experts, BF16, _dev(), gen)
            op.dispatch(x, w, None, idx)
            torch.cuda.synchronize()
            op.check()
            torch.distributed.barrier()


def _graph_job(rank, ws, gpn, family):
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(7 + rank)
    hidden, k, m = 2048, 8, 96
    for zero_copy in (False, True):
        with EpDispatchCombineOp(_cfg(rank, ws, gpn, hidden, k, BF16, BF16, m, internode_kernel=family), None) as op:
            static = make_inputs(rank, m, hidden, k, op.cfg.num_experts, BF16, _dev(), gen)
            replays_match_golden(op, rank, ws, dispatch_combine_step(op, *static, zero_copy), static, gen)


def _timeout_job(rank, ws, gpn, family):
    from mori_jit.ops.ep import EpDeviceError, EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(5 + rank)
    with mock.patch.dict(os.environ, {"MORI_EP_TIMEOUT_S": "2"}):  # (read when the op is built)
        op = EpDispatchCombineOp(_cfg(rank, ws, gpn, 2048, 4, BF16, BF16, 32, internode_kernel=family), None)
    with op:
        _round(op, rank, ws, gen, 32)
        torch.distributed.barrier()
        x, w, idx = make_inputs(rank, 32, 2048, 4, op.cfg.num_experts, BF16, _dev(), gen)
        if rank == 0:
            op.dispatch(x, w, None, idx)  # no other rank dispatches: rank 0's wait must give up
            torch.cuda.synchronize()
            with pytest.raises(EpDeviceError, match=r"rank 0: dispatch: waiting for a (peer's rows|forwarder).* from "
                                                    r"rank [0-9]+ timed out"):
                op.check()
            with pytest.raises(EpDeviceError):
                op.dispatch(x, w, None, idx)  # the next call raises too
        op.reset()  # collective
        for _ in range(3):
            _round(op, rank, ws, gen, 32)
        torch.distributed.barrier()
        out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
        if rank == 0:  # a combine no other rank joins
            op.combine(out, weights=out_w, routing=routing)
            torch.cuda.synchronize()
            with pytest.raises(EpDeviceError, match=r"rank 0: combine: waiting for a (peer's rows|forwarder's partial "
                                                    r"sums).* from rank [0-9]+ timed out"):
                op.check()
        op.reset()
        _round(op, rank, ws, gen, 32)


def _short_input_job(rank, ws, gpn, family):
    """Rank 0 combines fewer rows than it received: reported there, and on every rank whose tokens
    lost rows by it (never a silent wrong sum); reset() recovers."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(31 + rank)
    m, hidden, k = 40, 2048, 8
    with EpDispatchCombineOp(_cfg(rank, ws, gpn, hidden, k, BF16, BF16, m, internode_kernel=family), None) as op:
        _round(op, rank, ws, gen, m)
        torch.distributed.barrier()
        x, w, idx = make_inputs(rank, m, hidden, k, op.cfg.num_experts, BF16, _dev(), gen)
        out, out_w, _, _, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
        t = total.item()
        rows = t // 2 if rank == 0 else t
        combine_short_and_expect_reports(op, out, out_w, routing, rows, t)
        op.reset()
        _round(op, rank, ws, gen, m)


def _family_job(rank, ws, gpn, family):
    """Every check of one family in one world (a world's start-up, NVSHMEM's included, is most of a
    short check's time); each check builds its own ops and prints when it passes."""
    checks = (("golden, every dtype pair, parity with torch", _golden_job), ("200 rounds", _rounds_job),
              ("graph replay", _graph_job), ("timeout and reset", _timeout_job), ("short combine input", _short_input_job))
    for name, job in checks:
        t0 = time.perf_counter()
        job(rank, ws, gpn, family)
        torch.distributed.barrier()
        if rank == 0:
            print(f"[ws{ws}-gpn{gpn} {family}] {name}: ok ({time.perf_counter() - t0:.0f} s)", flush=True)


_LAYOUT = pytest.mark.parametrize("ws, gpn", LAYOUTS, ids=[f"ws{ws}-gpn{g}" for ws, g in LAYOUTS])


@_LAYOUT
@pytest.mark.parametrize("family", FAMILIES)
def test_internode_family_golden_rounds_graph_timeout_short_input(ws, gpn, family):
    run_shmem_job(_family_job, ws, gpn, family, timeout=1200)


@_LAYOUT
def test_internode_auto_switches_family_between_calls(ws, gpn):
    run_shmem_job(_auto_job, ws, gpn)


def _split_family_job(rank, ws, gpn, family):
    """The split legs of one family in one world: every split call against the same op's unsplit
    legs and the golden checks, each misuse refused, each half captured in its own graph and a whole
    step in one, and a rank's send kernels ending without its peers' rows."""
    layout = dict(gpu_per_node=gpn, internode_kernel=family)
    checks = (("split against unsplit, golden", lambda: split_job(rank, ws, "hip", SPLIT_CONFIGS, layout)),
              ("misuse", lambda: misuse_job(rank, ws, "hip", layout, moe=False)),
              ("graph capture of each half and of a step", lambda: graph_job(rank, ws, [layout])),
              ("a send alone ends, its receive reports", lambda: send_alone_job(rank, ws, [layout])))
    for name, check in checks:
        t0 = time.perf_counter()
        check()
        torch.distributed.barrier()
        if rank == 0:
            print(f"[ws{ws}-gpn{gpn} {family} split] {name}: ok ({time.perf_counter() - t0:.0f} s)", flush=True)


@pytest.mark.parametrize("family, ws, gpn", SPLIT_CASES, ids=[f"{f}-ws{ws}-gpn{g}" for f, ws, g in SPLIT_CASES])
def test_internode_split_legs_golden_misuse_graph_send_alone(family, ws, gpn):
    run_shmem_job(_split_family_job, ws, gpn, family, timeout=1200)
