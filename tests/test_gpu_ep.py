"""GPU tests of the ``hip`` EP backend (on a GPU machine: ``pytest -m gpu``).

Every check is the golden check of docs/design.md §6 on fresh random data, with outputs poisoned
first. Every test runs at world sizes 1, 2, 4 and 8 (``MORI_EP_TEST_WORLD_SIZES``): one rank per
GPU (NCCL) where there are enough GPUs, otherwise several ranks per GPU on the IPC arena provider
and gloo under CUDA MPS (``mori_jit/testing/gpu_world.py``).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from ep_gpu_checks import combine_short_and_expect_reports, dispatch_combine_step, replays_match_golden
from ep_gpu_checks import identity_expert as _expert
from ep_gpu_checks import parity_with_torch as _parity
from ep_gpu_checks import BF16, DTYPE_PAIRS, FP32
from mori_jit.testing.gpu_world import WORLD_SIZES, placement, run_ep_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]



def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _share(ws: int) -> int:
    """The SMs/CUs each rank's grid may use: the device's, split among the ranks on it."""
    return torch.cuda.get_device_properties(_dev()).multi_processor_count // placement(ws).ranks_per_gpu


def _host_or_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the default group's collectives take it (gloo: the host)."""
    return t.cpu() if torch.distributed.get_backend() == "gloo" else t


def _poison(op):
    """Poison every dispatch output view (not the sync words), then make sure no peer is mid-write."""
    a = op.arena
    for name in ("disp_out", "out_wts", "out_idx", "recv_to_src", "src_to_recv", "total_recv",
                 "comb_recv", "comb_recv_wts"):
        # NaN / -1 patterns (0xFF is also the low-latency comb_recv's empty state, kept between calls)
        a.tensor[a.offsets[name]:a.offsets[name] + a.sizes[name]].fill_(0xFF)
    torch.cuda.synchronize()
    torch.distributed.barrier()


def _round(op, cfg, rank, ws, gen, n, *, drop=0.0, all_to=None, check_parity_with=None):
    from mori_jit.testing.golden import golden_check, make_inputs

    dev = _dev()
    x, w, idx = make_inputs(rank, n, cfg.hidden_dim, cfg.num_experts_per_token, cfg.num_experts,
                            cfg.dispatch_dtype, dev, gen, drop_frac=drop, all_to_rank=all_to, world_size=ws)
    _poison(op)
    out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
    exp = _expert(out, cfg.combine_dtype)
    exp[total.item():].fill_(float("nan"))  # rows past total_recv must never be read
    y, y_w = op.combine(exp, weights=out_w, routing=routing)
    x_ref = _expert(x, cfg.combine_dtype)
    golden_check(op.group, rank, ws, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_rank,
                 x_ref, w, idx, exp, out_w, out_idx, total, routing.recv_src, y, y_w)
    if check_parity_with is not None:
        _parity(op, check_parity_with, x, w, idx, out, out_w, out_idx, total, routing, y, y_w)
    return total.item()


def _cfg(rank, ws, hidden, k, disp, comb, m, backend="hip", **pins):
    from mori_jit.ops.ep import EpDispatchCombineConfig

    same = disp == comb
    return EpDispatchCombineConfig(
        rank=rank, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=m,
        num_experts_per_rank=max(1, 16 // ws), num_experts_per_token=k, data_type=disp,
        dispatch_data_type=None if same else disp, combine_data_type=None if same else comb,
        kernel_backend=backend, **pins)


def _golden_job(rank, ws):
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(1234 + rank)
    cases = [(7168, 8, d, c) for d, c in DTYPE_PAIRS]
    cases += [(h, k, BF16, BF16) for h in (2048, 4096) for k in (1, 4, 8)]
    m = 96
    for i, (hidden, k, disp, comb) in enumerate(cases):
        if k > 16:
            continue
        # every other case with range flags, the others low latency (the default at m = 96)
        low = {"combine_low_latency": False} if i % 2 else {}
        with EpDispatchCombineOp(_cfg(rank, ws, hidden, k, disp, comb, m, **low), None) as op, \
                EpDispatchCombineOp(_cfg(rank, ws, hidden, k, disp, comb, m, "torch"), None) as ref:
            # token counts change between calls; n = M, n = 0, dropped slots, all to one rank
            for n, drop, all_to in ((m, 0.0, None), (37, 0.0, None), (0, 0.0, None), (m, 0.3, None),
                                    (m, 0.0, ws - 1), (1, 0.0, None)):
                _round(op, op.cfg, rank, ws, gen, n if rank % 2 == 0 else max(0, n - 5), drop=drop,
                       all_to=all_to, check_parity_with=ref)
    # Small combine blocks: one wave (a sender task takes 7 passes at hidden 7168) and four waves
    # (2 passes); 8 blocks, so 3 of them send and the summers claim ranges.
    for warps in (1, 4):
        with EpDispatchCombineOp(_cfg(rank, ws, 7168, 8, BF16, BF16, m, combine_block_num=8,
                                      combine_warp_num_per_block=warps), None) as op:
            for n in (m, 37, 0):
                _round(op, op.cfg, rank, ws, gen, n if rank % 2 == 0 else max(0, n - 5))
    # Ranks on different grids (each rank picks its geometry from its own token count): a rank's
    # dispatch-done count and its combine ranges must not depend on its peers' grids. At EP2 in low
    # latency, rank 1's 96 blocks hold its 96 peer-token tasks, so it takes one-token ranges and
    # rank 0 two-token ones (EpRangeTok).
    blocks = min((8, 96, 16, 40)[rank % 4], _share(ws))
    for low in (None, False):
        with EpDispatchCombineOp(_cfg(rank, ws, 7168, 8, BF16, BF16, m, dispatch_block_num=blocks,
                                      combine_block_num=blocks, combine_low_latency=low), None) as op:
            for n in (m, 37, 0, m):
                _round(op, op.cfg, rank, ws, gen, n if rank % 2 == 0 else max(0, n - 5))


def _bulk_job(rank, ws):
    """The bulk-copy dispatch (NVIDIA sm_90 and later): in one launch the blocks that own at least
    BULK_DISPATCH_MIN_TOKENS tokens move their rows with the unit and the others through their
    waves; every dispatch dtype; and a block whose tokens take two routing rounds."""
    from mori_jit.jit.toolchain import detect_arch, has_bulk_copy
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.ops.ep.backends.hip.intranode.tuning import BULK_DISPATCH_MIN_TOKENS as least
    from mori_jit.ops.ep.backends.hip.variants import ep_variants

    gen = torch.Generator().manual_seed(555 + rank)
    bulk = has_bulk_copy(detect_arch()) and ws > 1  # (one rank copies only into its own memory: no bulk path)
    blocks = 16
    m = 2 * least * blocks  # up to 2 * least tokens per block
    for i, (disp, comb) in enumerate(DTYPE_PAIRS):
        cfg = _cfg(rank, ws, 7168, 8, disp, comb, m, dispatch_block_num=blocks,
                   **({"combine_low_latency": False} if i % 2 else {}))
        assert {c.bulkMinTokens for c in ep_variants(cfg, detect_arch(), 132).dispatch} == ({least} if bulk else {0})
        with EpDispatchCombineOp(cfg, None) as op:
            # all bulk; half the blocks bulk (least tokens) and half not (least - 1); none; all, with
            # 90 % of the slots dropped (0.9^8: ~43 % of the rows go nowhere, an empty bulk group
            # each); all to one rank
            for n, drop, all_to in ((m, 0.0, None), (blocks * least - blocks // 2, 0.0, None), (37, 0.0, None),
                                    (0, 0.0, None), (m, 0.9, None), (m, 0.0, ws - 1)):
                _round(op, op.cfg, rank, ws, gen, n if rank % 2 == 0 else max(0, n - 5), drop=drop, all_to=all_to)
    # 2 blocks of 16 waves route at most 256 tokens per round (DispatchRound): 300 take two rounds
    with EpDispatchCombineOp(_cfg(rank, ws, 7168, 8, BF16, BF16, 600, dispatch_block_num=2), None) as op:
        for n in (600, 300, 600):
            _round(op, op.cfg, rank, ws, gen, n if rank % 2 == 0 else max(0, n - 5))


def _rounds_job(rank, ws):
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(99 + rank)
    for low in (None, False):  # low latency (the default at m = 64), then range flags
        with EpDispatchCombineOp(_cfg(rank, ws, 2048, 8, BF16, BF16, 64, combine_low_latency=low), None) as op:
            for i in range(200):  # no reset() between rounds: device-side epochs and counters
                _round(op, op.cfg, rank, ws, gen, int(torch.randint(0, 65, (1,), generator=gen)))
                if i % 50 == 0:
                    print(f"[rank {rank}] round {i} ok", flush=True)
            op.check()


def _graph_job(rank, ws):
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(7 + rank)
    dev = _dev()
    hidden, k = 7168, 8
    # 128 tokens: one combine task per block; 1024: dedicated senders, and summers that claim ranges
    # from a device counter, which every replay must find reset
    for m, zero_copy in ((128, False), (128, True), (1024, False)):
        with EpDispatchCombineOp(_cfg(rank, ws, hidden, k, BF16, BF16, m), None) as op:
            static = make_inputs(rank, m, hidden, k, op.cfg.num_experts, BF16, dev, gen)
            step = dispatch_combine_step(op, *static, zero_copy)
            if zero_copy:  # an output inside the symmetric arena is refused before anything launches
                out, out_w, _, _, _, routing = op.dispatch(*static[:2], None, static[2], return_routing=True)
                stage = op.get_combine_input_buffer()
                stage.copy_(out)
                with pytest.raises(ValueError, match="out: overlaps the op's symmetric buffers"):
                    op.combine(stage, weights=out_w, routing=routing, out=out[:m])
                op.combine(out, weights=out_w, routing=routing)  # the collective round completes
            replays_match_golden(op, rank, ws, step, static, gen)


def _combine_inputs_job(rank, ws):
    """Combine from every kind of input: the combine input buffer (zero-copy), a fresh tensor, and the
    dispatch output itself (in the arena, which a peer's next dispatch writes), with and without
    weights, token counts from 0 to m (one range to hundreds per rank), and two combines of one
    dispatch back to back (the second's pushes must not land while a peer still sums the first)."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import golden_check, make_inputs

    gen = torch.Generator().manual_seed(31 + rank)
    dev = _dev()
    hidden, k = 2048, 8
    # m = 40: low latency (the default there), then range flags, then range flags on 4 blocks (2
    # dedicated senders claim 20 tasks, so a peer's short input reaches claimed tasks too); 1100:
    # range flags (the default), then low latency with dedicated senders and claimed sums
    for m, low, pins in ((40, None, {}), (40, False, {}), (40, False, {"combine_block_num": 4}), (1100, None, {}),
                         (1100, True, {})):
        with EpDispatchCombineOp(_cfg(rank, ws, hidden, k, BF16, BF16, m, combine_low_latency=low, **pins), None) as op:
            print(f"[rank {rank}] m={m} combine_low_latency={op.cfg.combine_low_latency} {pins}", flush=True)
            cfg = op.cfg
            stage = op.get_combine_input_buffer()
            # one buffer for the op's life, outside the symmetric arena (only this rank reads it)
            arena = op.arena.tensor
            assert op.get_combine_input_buffer() is stage
            assert stage.data_ptr() >= arena.data_ptr() + arena.nbytes or stage.data_ptr() + stage.nbytes <= arena.data_ptr()
            for i in range(9):
                n = m if i % 4 == 0 else int(torch.randint(0, m + 1, (1,), generator=gen))
                x, w, idx = make_inputs(rank, n, hidden, k, cfg.num_experts, BF16, dev, gen)
                _poison(op)
                out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
                t = total.item()
                with_weights, kind = i % 2 == 0, ("stage", "fresh", "out")[i % 3]
                if kind == "stage":
                    stage[:t].copy_(out[:t])
                    stage[t:].fill_(float("nan"))  # rows past total_recv must never be read
                    exp = stage
                elif kind == "fresh":
                    exp = out.clone()
                    exp[t:].fill_(float("nan"))
                else:
                    exp = out
                y1 = torch.full((n, hidden), float("nan"), dtype=BF16, device=dev)
                y, y_w = op.combine(exp, weights=out_w if with_weights else None, routing=routing, out=y1)
                assert y is y1 and (y_w is None) != with_weights
                if i % 4 == 1:  # the same dispatch combined again, back to back
                    y, y_w = op.combine(exp, weights=out_w if with_weights else None, routing=routing)
                    torch.testing.assert_close(y, y1, rtol=0, atol=0)
                golden_check(op.group, rank, ws, m, cfg.num_experts_per_rank, x, w, idx, out, out_w,
                             out_idx, total, routing.recv_src, y, y_w)
            op.check()
            if m == 40:  # a short input on rank 0: reported there (nothing read past it) and on every
                # rank whose tokens lost rows by it (no silent wrong sums), then reset() recovers
                x, w, idx = make_inputs(rank, m, hidden, k, cfg.num_experts, BF16, dev, gen)
                out, out_w, _, _, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
                t = total.item()
                # rank 0 drops its rows from its last peer-sourced one on (slot order follows the
                # ranks' claim timing, so half the rows might all be its own)
                peer_rows = (routing.recv_src[:t].long() // cfg.max_num_inp_token_per_rank != 0).nonzero()
                rows = (int(peer_rows[-1]) if len(peer_rows) else t // 2) if rank == 0 else t
                lost = combine_short_and_expect_reports(op, out, out_w, routing, rows, t)
                assert rank != 0 or ws == 1 or lost[1:].any(), "the short input must drop some peer's rows"
                op.reset()  # collective
                _round(op, cfg, rank, ws, gen, m)
                op.check()


def _queued_rounds_job(rank, ws):
    """Rounds queued back to back with no host sync, so a rank can run a round ahead of its peer:
    its next dispatch must then wait on the device until the peer's combine is done reading (the
    combine-done flag). Combine inputs alternate between the dispatch output itself (in the arena,
    which that next dispatch overwrites) and a fresh tensor; every round's result is kept in its own
    poisoned output and checked at the end: y == U * x and y_w == U * w, U the number of distinct
    ranks a token went to (the identity expert), rounded once to the combine dtype."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs

    gen = torch.Generator().manual_seed(71 + rank)
    dev = _dev()
    m, hidden, k, rounds = 128, 7168, 8, 24
    for low in (None, False):  # low latency (the default at m = 128), then range flags
        with EpDispatchCombineOp(_cfg(rank, ws, hidden, k, BF16, BF16, m, combine_low_latency=low), None) as op:
            cfg = op.cfg
            ins = [make_inputs(rank, m, hidden, k, cfg.num_experts, BF16, dev, gen) for _ in range(rounds)]
            ys = [torch.full((m, hidden), float("nan"), dtype=BF16, device=dev) for _ in range(rounds)]
            yws = [torch.full((m, k), float("nan"), dtype=torch.float32, device=dev) for _ in range(rounds)]
            torch.cuda.synchronize()
            torch.distributed.barrier()
            for i, (x, w, idx) in enumerate(ins):
                out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
                exp = out if i % 2 == 0 else out.clone()
                op.combine(exp, weights=out_w, routing=routing, out=ys[i], out_weights=yws[i])
            torch.cuda.synchronize()
            op.check()
            bad = []
            for i, (x, w, idx) in enumerate(ins):
                ranks = torch.where((idx >= 0) & (idx < cfg.num_experts), idx // cfg.num_experts_per_rank, -1)
                u = torch.stack([(ranks == r).any(1) for r in range(ws)], 1).sum(1, keepdim=True).float()
                # the kernel sums in fp32 and rounds once: U * x is exact in fp32 (U <= 8), then one rounding
                if not torch.equal(ys[i], (x.float() * u).to(ys[i].dtype)):
                    bad.append(f"round {i} y ({'arena' if i % 2 == 0 else 'fresh'} input)")
                if not torch.allclose(yws[i], w * u, rtol=1e-5, atol=1e-6):
                    bad.append(f"round {i} y_w")
            torch.distributed.barrier()
            assert not bad, f"rank {rank}: {bad}"


def _empty_receiver_job(rank, ws):
    """A MoE layer's pattern: combines alternate without weights and with ``weights=out_w[:total]``,
    and in some rounds every rank has one token and one rank receives nothing (no token picks its
    experts), so that rank passes weights with no rows. Its own token's weights come back from its
    peers all the same: y_w == U * w (golden check), rounds with changing token counts between."""
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp
    from mori_jit.testing.golden import golden_check, make_inputs

    gen = torch.Generator().manual_seed(4242 + rank)
    dev = _dev()
    hidden, k, epr, m = 128, 4, 4, 32
    blocks = min(16, _share(ws))
    for dtype in (BF16, FP32):
        for low in (True, False):
            cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=hidden, max_num_inp_token_per_rank=m,
                                          num_experts_per_rank=epr, num_experts_per_token=k, data_type=dtype,
                                          dispatch_block_num=blocks, combine_block_num=blocks,
                                          combine_low_latency=low)
            with EpDispatchCombineOp(cfg, None) as op:
                print(f"[rank {rank}] {dtype} combine_low_latency={low}", flush=True)
                for i in range(12):
                    weighted, empty = i % 2 == 1, (i // 2) % ws
                    if i % 4 < 2:  # one token each; rank `empty` receives nothing
                        x, w, idx = make_inputs(rank, 1, hidden, k, cfg.num_experts, dtype, dev, gen)
                        others = torch.tensor([e for e in range(cfg.num_experts) if e // epr != empty], dtype=torch.int32)
                        pick = others[torch.randperm(len(others), generator=gen)[:k]] if len(others) >= k else \
                            torch.full((k,), -1, dtype=torch.int32)  # (one rank: every slot dropped)
                        idx = pick.view(1, k).to(dev)
                    else:
                        n = int(torch.randint(0, m + 1, (1,), generator=gen))
                        x, w, idx = make_inputs(rank, n, hidden, k, cfg.num_experts, dtype, dev, gen)
                    _poison(op)
                    out, out_w, _, out_idx, total, routing = op.dispatch(x, w, None, idx, return_routing=True)
                    t = total.item()
                    if i % 4 < 2 and rank == empty:  # (with 8 ranks another one may receive nothing too)
                        assert t == 0, f"rank {rank} received {t} rows but no token picked its experts"
                    exp = out[:t].clone()
                    if weighted:
                        y, y_w = op.combine(exp, weights=out_w[:t], routing=routing)
                    else:
                        y, y_w = op.combine(exp, routing=routing)
                        assert y_w is None
                    golden_check(op.group, rank, ws, m, epr, x, w, idx, out, out_w, out_idx, total,
                                 routing.recv_src, y, y_w)
                op.check()


def _timeout_job(rank, ws):
    from mori_jit.ops.ep import EpDeviceError, EpDispatchCombineOp

    os.environ["MORI_EP_TIMEOUT_S"] = "2"
    gen = torch.Generator().manual_seed(5 + rank)
    for low in (False, None):  # range flags, then low latency (the default at m = 32)
        with EpDispatchCombineOp(_cfg(rank, ws, 2048, 4, BF16, BF16, 32, combine_low_latency=low), None) as op:
            _round(op, op.cfg, rank, ws, gen, 32)
            # rank 1 may still be reading its outputs; they stay valid only until any rank's next dispatch
            torch.distributed.barrier()
            from mori_jit.testing.golden import make_inputs
            x, w, idx = make_inputs(rank, 32, 2048, 4, op.cfg.num_experts, BF16, _dev(), gen)
            if rank == 0:
                op.dispatch(x, w, None, idx)  # rank 1 never dispatches: rank 0's wait must give up
                torch.cuda.synchronize()
                with pytest.raises(EpDeviceError, match=r"rank 0: dispatch: .* from rank [1-9][0-9]* timed out") as err:
                    op.check()
                # the second dispatch: rank 1's blocks never added their 1048576 for epoch 2
                assert "(flag never reached 2097152 = 1048576 x dispatch epoch 2)" in str(err.value), str(err.value)
                with pytest.raises(EpDeviceError):
                    op.dispatch(x, w, None, idx)  # the next call raises too
            op.reset()  # collective
            for _ in range(3):
                _round(op, op.cfg, rank, ws, gen, 32)
            # a combine that rank 1 skips: rank 0's summers give up waiting for rank 1's rows
            torch.distributed.barrier()
            out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
            if rank == 0:
                op.combine(out, weights=out_w, routing=routing)
                torch.cuda.synchronize()
                with pytest.raises(EpDeviceError, match=r"rank 0: combine[ :].* from rank [1-9][0-9]* timed out") as err:
                    op.check()
                # every summer timed out at once; the report is one thread's, whole: the 4th combine
                # since the reset (3 rounds) waited for range flags of 2 x epoch 4, or (low latency)
                # for one of rank 0's tokens' rows from rank 1
                if low is False:
                    assert "(flag never reached 8 = 2 x combine epoch 4)" in str(err.value), str(err.value)
                else:
                    got = re.search(r"row of a token \(its words never arrived\) from rank [1-9][0-9]* timed out after "
                                    r"MORI_EP_TIMEOUT_S \(token ([0-9]+)\)", str(err.value))
                    assert got and int(got.group(1)) < 32, str(err.value)
            op.reset()  # collective
            _round(op, op.cfg, rank, ws, gen, 32)


_WS = pytest.mark.parametrize("ws", WORLD_SIZES)


@_WS
def test_golden_all_dtypes_shapes_and_parity(ws):
    run_ep_job(_golden_job, ws, timeout=900)


@_WS
def test_combine_inputs_anywhere_and_back_to_back(ws):
    run_ep_job(_combine_inputs_job, ws)


@_WS
def test_queued_rounds_without_host_sync(ws):
    run_ep_job(_queued_rounds_job, ws)


@_WS
def test_bulk_copy_dispatch_mixed_blocks_dtypes_and_rounds(ws):
    run_ep_job(_bulk_job, ws)


@_WS
def test_200_rounds_without_reset(ws):
    run_ep_job(_rounds_job, ws)


@_WS
def test_graph_capture_replay(ws):
    run_ep_job(_graph_job, ws)


@_WS
def test_ranks_that_receive_nothing_get_their_weights_summed(ws):
    run_ep_job(_empty_receiver_job, ws)


def _exception_inside_the_op_job(rank, ws):
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(17 + rank)
    with EpDispatchCombineOp(_cfg(rank, ws, 2048, 4, BF16, BF16, 32), None) as op:
        _round(op, op.cfg, rank, ws, gen, 32)
        if rank == 0:
            raise RuntimeError("rank 0 gives up inside the op")
        # the others go on to a collective of their own (as a golden check would), which no
        # collective close() on rank 0 can match; it fails once rank 0's process is gone
        parts = [_host_or_device(torch.zeros(4, device=_dev())) for _ in range(ws)]
        torch.distributed.all_gather(parts, _host_or_device(torch.ones(4, device=_dev())))


@_WS
def test_an_exception_inside_the_op_propagates_without_waiting_for_peers(ws):
    """A rank that leaves ``with op`` on an exception reports it at once; it used to wait in the
    collective close() for peers that were elsewhere (a hang that hid the exception)."""
    if ws < 2:
        pytest.skip("needs two ranks (one leaves on an exception)")
    with pytest.raises(AssertionError, match="rank 0 gives up inside the op"):
        run_ep_job(_exception_inside_the_op_job, ws, timeout=60)


def _ipc_lifetime_job(rank, ws):
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(23 + rank)
    with EpDispatchCombineOp(_cfg(rank, ws, 2048, 4, BF16, BF16, 32, symm_memory="ipc"), None) as op:
        _round(op, op.cfg, rank, ws, gen, 32)


@_WS
def test_ipc_memory_is_released_before_exit_without_producer_warnings(ws, capfd):
    """Every peer's mapping of a rank's IPC block is counted in torch's IPC bookkeeping, so the
    block is freed at close() and no rank warns at exit that it terminated before its consumers
    released it (with one share for all peers, 3 or more ranks did)."""
    if ws < 2:
        pytest.skip("needs two ranks (one rank maps no peer)")
    run_ep_job(_ipc_lifetime_job, ws, timeout=120)
    err = capfd.readouterr().err
    assert "Producer process has been terminated" not in err, err[-2000:]


@_WS
def test_timeout_records_and_raises(ws):
    if ws < 2:
        pytest.skip("needs two ranks (one skips a dispatch)")
    run_ep_job(_timeout_job, ws, timeout=300)
