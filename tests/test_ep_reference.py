"""The torch.distributed reference EP dispatch/combine against the independent golden check.

Runs on CPU with gloo and 2 or 4 processes. Spawning a process group costs seconds, so each
spawned job runs a batch of cases; a failing case names itself in the worker traceback.
"""

from __future__ import annotations

import math

import pytest
import torch

from mori_jit.testing.golden import golden_check, make_inputs
from mori_jit.ops.ep.backends.torch.reference import reference_combine, reference_dispatch
from mori_jit.testing.distributed import run_distributed

M = 48          # max tokens per rank
HIDDEN = 256
EPR = 4         # experts per rank

# (name, tokens, topk, dtype, drop_frac, all_to_rank, scales, combine out dtype or None)
# tokens: an int, "M", or "mixed" (differs per rank, some ranks 0).
CASES = [
    ("bf16_random_k4_nM", "M", 4, torch.bfloat16, 0.0, None, False, torch.bfloat16),
    ("f32_random_k2_mixed_scales", "mixed", 2, torch.float32, 0.0, None, True, torch.float32),
    ("bf16_dropped_slots", 37, 4, torch.bfloat16, 0.3, None, False, torch.bfloat16),
    ("bf16_all_to_last_rank", "M", 4, torch.bfloat16, 0.0, "last", False, torch.bfloat16),
    ("bf16_n0", 0, 4, torch.bfloat16, 0.0, None, False, torch.bfloat16),
    ("bf16_topk1", 29, 1, torch.bfloat16, 0.0, None, False, torch.bfloat16),
    ("f32_topk8_dropped", "M", 8, torch.float32, 0.2, None, False, torch.float32),
    ("bf16_all_slots_dropped", 13, 4, torch.bfloat16, 1.0, None, False, torch.bfloat16),
    ("bf16_in_f32_out", 21, 3, torch.bfloat16, 0.1, None, False, torch.float32),
    ("fp8_dispatch_only_scales", "mixed", 4, torch.float8_e4m3fn, 0.1, None, True, None),
    ("fp8_topk8_dispatch_only", "M", 8, torch.float8_e4m3fn, 0.0, None, False, None),
    ("uint8_all_to_rank0", 31, 2, torch.uint8, 0.0, 0, False, None),
]


def _tokens(spec, rank: int) -> int:
    if spec == "M":
        return M
    if spec == "mixed":
        return [M, 0, 17, 1][rank % 4]
    return spec


def _run_case(rank, ws, case_no, case, device="cpu"):
    """Dispatch + (optional) identity-expert combine of one case, then the golden check."""
    name, tokens, topk, dtype, drop, to_rank, with_scales, out_dtype = case
    gen = torch.Generator().manual_seed(7919 * case_no + 104729 * ws + rank)
    n = _tokens(tokens, rank)
    to_rank = ws - 1 if to_rank == "last" else to_rank
    x, w, idx = make_inputs(rank, n, HIDDEN, topk, EPR * ws, dtype, device, gen, drop_frac=drop,
                            all_to_rank=to_rank, world_size=ws)
    scales = (torch.rand(n, 3, generator=gen) + 0.5).to(device) if with_scales else None
    cap = ws * M
    out, ow, osc, oi, total, routing = reference_dispatch(None, rank, ws, M, EPR, x, w, scales, idx, cap)
    assert out.shape == (cap, HIDDEN) and ow.shape == (cap, topk) and oi.shape == (cap, topk)
    assert total.dtype == torch.int32 and total.shape == (1,)
    y = y_w = None
    if out_dtype is not None:
        # Identity expert; poison the rows past total_recv so reading them would show in y.
        t = int(total)
        expert_out = out.clone()
        expert_out[t:] = math.nan
        ew = ow.clone()
        ew[t:] = math.nan
        y, y_w = reference_combine(None, routing, expert_out, ew, out_dtype)
        assert y.dtype == out_dtype and y_w.dtype == torch.float32
    golden_check(None, rank, ws, M, EPR, x, w, idx, out, ow, oi, total, routing.recv_src, y, y_w,
                 scales=scales, out_scales=osc)


def _cases_job(rank, ws, device="cpu"):
    """Every case of CASES, in order, on ``device`` (also used by hand with NCCL on GPUs)."""
    for case_no, case in enumerate(CASES):
        try:
            _run_case(rank, ws, case_no, case, device)
        except Exception as e:
            raise AssertionError(f"case {case[0]} (world_size {ws}) failed on rank {rank}: {e}") from e


@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_matches_golden(world_size):
    run_distributed(_cases_job, world_size)


def _expect(exc_type, fn, *args, match: str | None = None, **kwargs):
    """Call fn and return the exception it must raise (no pytest.raises: it runs in a worker)."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        if match is not None:
            assert match in str(e), f"{exc_type.__name__} message {str(e)!r} lacks {match!r}"
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def _errors_job(rank, ws):
    gen = torch.Generator().manual_seed(4242 + rank)

    # -- too many received rows: raised on every rank from the gathered counts, before any row
    #    moves, so later collectives stay matched.
    x, w, idx = make_inputs(rank, M, HIDDEN, 2, EPR * ws, torch.bfloat16, "cpu", gen,
                            all_to_rank=0, world_size=ws)
    _expect(RuntimeError, reference_dispatch, None, rank, ws, M, EPR, x, w, None, idx, M,
            match=f"EP dispatch: rank 0 would receive {ws * M} rows, but recv_capacity is {M}; no row was sent")

    # -- input validation happens before any collective (every rank raises alike).
    xb, wb, ib = make_inputs(rank, M + 1, HIDDEN, 2, EPR * ws, torch.float32, "cpu", gen)
    _expect(ValueError, reference_dispatch, None, rank, ws, M, EPR, xb, wb, None, ib, ws * M,
            match="exceeds max_tokens_per_rank")

    # -- a valid run to corrupt.
    x, w, idx = make_inputs(rank, M, HIDDEN, 4, EPR * ws, torch.bfloat16, "cpu", gen)
    out, ow, _, oi, total, routing = reference_dispatch(None, rank, ws, M, EPR, x, w, None, idx, ws * M)
    y, y_w = reference_combine(None, routing, out, ow, torch.bfloat16)
    src = routing.recv_src
    t = int(total)
    assert t >= 2, "random routing of 48 tokens x 4 experts must reach every rank"

    # combine refuses byte dtypes (before any collective).
    _expect(ValueError, reference_combine, None, routing, out.to(torch.float8_e4m3fn), None,
            torch.bfloat16, match="cannot be summed")

    def corrupt_out():
        o = out.clone()
        o.view(torch.uint8)[t // 2, 5] ^= 0x01   # flip one bit of one received row
        return dict(out=o)

    def corrupt_y():
        yy = y.clone()
        yy[M // 2, 7] += 1.0
        return dict(y=yy)

    def corrupt_y_w():
        yy = y_w.clone()
        yy[3, 1] *= 1.5
        return dict(y_w=yy)

    def duplicate_src():
        s = src.clone()
        s[1] = s[0]
        return dict(recv_src=s)

    def wrong_total():
        return dict(total_recv=total - 1)

    def wrong_weights():
        o = ow.clone()
        o[0, 0] = -o[0, 0]
        return dict(out_weights=o)

    def wrong_indices():
        o = oi.clone()
        o[t - 1, 2] += 1
        return dict(out_indices=o)

    clean = dict(out=out, out_weights=ow, out_indices=oi, total_recv=total, recv_src=src, y=y, y_w=y_w)
    corruptions = [(corrupt_out, "out row"), (corrupt_y, "y["), (corrupt_y_w, "y_w["),
                   (duplicate_src, "not unique"), (wrong_total, "total_recv"),
                   (wrong_weights, "out_weights row"), (wrong_indices, "out_indices row")]
    # The check is collective: every rank runs every round; only rank 0 passes corrupted data.
    golden_check(None, rank, ws, M, EPR, x, w, idx, **clean)
    for make, what in corruptions:
        args = dict(clean, **make()) if rank == 0 else clean
        if rank == 0:
            _expect(AssertionError, golden_check, None, rank, ws, M, EPR, x, w, idx, **args,
                    match=what)
            e = _expect(AssertionError, golden_check, None, rank, ws, M, EPR, x, w, idx, **args)
            assert "rank 0" in str(e), str(e)
        else:
            golden_check(None, rank, ws, M, EPR, x, w, idx, **args)
            golden_check(None, rank, ws, M, EPR, x, w, idx, **args)


def test_errors_and_golden_detects_corruption():
    run_distributed(_errors_job, 2)
