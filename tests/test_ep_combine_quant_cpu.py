"""The combine wire's fp8 casts (mori's ``quant_type``: ``"fp8_direct_cast"``, ``"fp8_blockwise"``)
on the torch backend, 2 and 4 gloo ranks: the cast's rule (a table), the blockwise scale rule, and
the op against an exact golden (identity experts: each token's sum is its own cast row, added once
per destination rank), against the bf16 combine (relative L2 within e4m3's bound, and not zero),
saturation, zero-token ranks, int64 ids, weights, the expert-major combine and the split legs. The
jobs are device-generic: ``test_gpu_ep_combine_quant.py`` runs them on the hip kernels."""
from __future__ import annotations

import math

import pytest
import torch

from mori_jit.ops.ep import EpConfigError, EpDispatchCombineConfig, EpDispatchCombineOp
from mori_jit.ops.ep.quant import (COMBINE_WIRE_QUANTS, DISPATCH_QUANT_TYPES, cast_e4m3, combine_wire_decode,
                                   combine_wire_encode, float32_reciprocal, quantize)
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.golden import experts_per_rank_at, make_inputs

M, H, EPR, K = 16, 256, 3, 4


def epr(ws: int) -> int:
    return experts_per_rank_at(ws, EPR, K)
#: (quant_type, combine_scale_type_size): every wire this file runs
WIRES = [("fp8_direct_cast", 4), ("fp8_blockwise", 4), ("fp8_blockwise", 1)]

#: value -> e4m3fn byte of the direct cast: signed zeros, saturation (finite, infinite), NaN (no 0xff
#: byte ever), ties to even at 1 and at the denormal edge, the smallest denormal
CAST_TABLE = [(0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (1.0625, 0x38), (1.1875, 0x3A), (448.0, 0x7E), (463.9, 0x7E),
              (464.0, 0x7E), (1000.0, 0x7E), (-1e30, 0xFE), (math.inf, 0x7E), (-math.inf, 0xFE),
              (math.nan, 0x7F), (-math.nan, 0x7F), (2.0 ** -9, 0x01), (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02),
              (-(2.0 ** -6), 0x88)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_direct_cast_rounds_to_even_and_saturates(dtype):
    vals = torch.tensor([v for v, _ in CAST_TABLE], dtype=dtype)
    got = cast_e4m3(vals)
    want = torch.tensor([b for _, b in CAST_TABLE], dtype=torch.uint8)
    assert got.dtype == torch.uint8 and torch.equal(got, want), (got, want)
    # every finite float32 below the fp8 max converts as torch does; none of them gives 0xff
    x = torch.randn(20000, generator=torch.Generator().manual_seed(5)) * 100
    assert torch.equal(cast_e4m3(x), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert not bool((cast_e4m3(torch.cat([x, vals.float()])) == 0xFF).any())


@pytest.mark.parametrize("scale_bytes", [4, 1])
def test_the_blockwise_wire_uses_the_dispatch_casts_scale_rule(scale_bytes):
    """Scales: amax (floored at 1e-4) times fl32(1/448), or (UE8M0) the next power of two; rows:
    the dispatch cast's bytes; decode: q * sf."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, H, generator=gen) * torch.tensor([1e-6, 1e-2, 1.0, 30.0, 1e4])[:, None]).to(torch.bfloat16)
    x[0, :128] = 0.0  # an all-zero block: the floor
    q, s = combine_wire_encode(x, "fp8_blockwise", scale_bytes)
    dq, ds = quantize(x, DISPATCH_QUANT_TYPES["fp8_e4m3_block128"], scale_bytes)
    assert torch.equal(q, dq.view(torch.uint8)) and torch.equal(s, ds.contiguous().view(torch.uint8).reshape(5, -1))
    amax = x.float().reshape(5, 2, 128).abs().amax(2).clamp_min(1e-4)
    sf = amax * float32_reciprocal(448.0)
    if scale_bytes == 4:
        assert torch.equal(s.view(torch.float32), sf)
    else:
        got = torch.exp2(s.to(torch.float32) - 127)
        assert bool((got >= sf).all()) and bool((got / 2 < sf).all())
    back = combine_wire_decode([q, s], "fp8_blockwise", scale_bytes, torch.bfloat16, H)
    assert float((back - x.float()).norm() / x.float().norm()) < 0.05


@pytest.mark.parametrize("fields, match", [
    (dict(quant_type="fp8_blockwise", hidden_dim=192), "quant_type='fp8_blockwise' makes one scale per 128"),
    (dict(quant_type="fp8_blockwise", combine_scale_type_size=2), "combine_scale_type_size=2: allowed 4"),
    (dict(quant_type="fp8_direct_cast", hidden_dim=24), "needs hidden_dim a multiple of 16, got 24"),
    (dict(combine_scale_type_size=-1), "combine_scale_type_size=-1: expected an int >= 0"),
])
def test_the_wire_fields_are_checked(fields, match):
    base = dict(rank=0, world_size=2, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=EPR,
                num_experts_per_token=K)
    with pytest.raises(EpConfigError, match=match):
        EpDispatchCombineConfig(**{**base, **fields})


def quant_cfg(rank, ws, backend, quant, scale_bytes, **fields):
    """The config of the jobs below (``quant``: the combine wire; "none" for the bf16 reference)."""
    return EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                   num_experts_per_rank=epr(ws), num_experts_per_token=K, kernel_backend=backend,
                                   quant_type=quant, combine_scale_type_size=scale_bytes, **fields)


def cast_values(x: torch.Tensor, quant: str, scale_bytes: int) -> torch.Tensor:
    """float32 values of rows ``x`` after the wire's cast (what the home rank adds)."""
    return combine_wire_decode(combine_wire_encode(x, quant, scale_bytes), quant, scale_bytes, x.dtype, x.shape[1])


def golden_identity_sum(x, idx, ws, quant, scale_bytes, dtype, experts_per_rank=None):
    """y for identity experts: the token's cast row added once per distinct destination rank, from +0
    (every term is the same, so the order does not matter), rounded once (``experts_per_rank``:
    this file's ``epr(ws)`` unless given)."""
    v = cast_values(x, quant, scale_bytes)
    ids, e = idx.long(), experts_per_rank or epr(ws)
    ok = (ids >= 0) & (ids < e * ws)
    dest = torch.where(ok, ids // e, torch.full_like(ids, ws))
    hits = torch.zeros(x.shape[0], ws + 1, dtype=torch.bool, device=x.device).scatter_(1, dest, True)[:, :ws]
    acc = torch.zeros_like(v)
    for r in range(ws):
        acc = torch.where(hits[:, r:r + 1], acc + v, acc)
    return acc.to(dtype)


def calls(rank, ws):
    """(tokens, scale of the values, with weights) per call: ranks with no tokens, values past the
    fp8 maximum (the direct cast saturates them), no weights."""
    return [(M, 1.0, True), ([0, M - 1, 5, 11][rank % 4], 1.0, True), (M - rank, 2000.0, True), (3 + rank, 1.0, False),
            (0, 1.0, True)]


def wire_job(rank, ws, backend, quant, scale_bytes, index_dtype=torch.int32, low=None):
    """Each call: the fp8 combine against the exact golden and against the bf16 combine of the same
    rows; then the expert-major combine and the split legs against the whole leg (``low``: the
    config's ``combine_low_latency``)."""
    gen = torch.Generator().manual_seed(101 + 7 * rank + ws)
    fields = dict(index_dtype=index_dtype, expert_counts=True, expert_capacity=ws * M * K, split_send_recv=True,
                  combine_low_latency=low)
    with EpDispatchCombineOp(quant_cfg(rank, ws, backend, quant, scale_bytes, **fields)) as op, \
            EpDispatchCombineOp(quant_cfg(rank, ws, "torch", "none", 4, index_dtype=index_dtype)) as ref:
        dev = op.device
        for call, (n, scale, with_w) in enumerate(calls(rank, ws)):
            x, w, idx = make_inputs(rank, n, H, K, epr(ws) * ws, torch.bfloat16, dev, gen, drop_frac=0.2, world_size=ws,
                                    index_dtype=index_dtype)
            x = (x.float() * scale).to(torch.bfloat16)
            w = w if with_w else None
            res = op.dispatch(x, w, None, idx, return_result=True)
            y, y_w = op.combine(res.out, weights=res.out_weights, routing=res.routing)
            want = golden_identity_sum(x, idx, ws, quant, scale_bytes, torch.bfloat16)
            where = f"{quant}/{scale_bytes} call {call} (rank {rank} of {ws}, {n} tokens)"
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), \
                f"{where}: {int((y.view(torch.int16) != want.view(torch.int16)).sum())} elements differ from the golden"
            on = ref.device
            r = ref.dispatch(x.to(on), None if w is None else w.to(on), None, idx.to(on), return_result=True)
            yr, yr_w = ref.combine(r.out, weights=r.out_weights, routing=r.routing)
            assert (y_w is None) == (w is None)
            if w is not None:  # the weights are summed alongside, not quantized
                assert torch.equal(y_w.cpu(), yr_w.cpu()), f"{where}: the summed weights differ"
            if scale == 1.0 and n:
                err = float((y.float().cpu() - yr.float().cpu()).norm() / yr.float().norm())
                assert 1e-3 < err < 0.06, f"{where}: relative L2 error {err} against the bf16 combine"
            if scale > 448 and quant == "fp8_direct_cast":  # saturated: +-448 once per destination
                big = y.float().abs()[x.float().abs().to(y.device) > 464]
                assert bool((big % 448 == 0).all()) and bool((big <= 448 * ws).all()), f"{where}: not saturated"
            # the split legs: the same sums
            ys, ys_w = op.combine_send(res.out, weights=res.out_weights, routing=res.routing)
            op.combine_recv()
            assert torch.equal(ys, y) and (ys_w is None or torch.equal(ys_w, y_w)), f"{where}: split legs differ"
            expert_major_check(op, res, x, idx, ws, quant, scale_bytes, where)


def expert_major_check(op, res, x, idx, ws, quant, scale_bytes, where):
    """Identity experts on the expert-major layout, weight 1: each receive row's local sum (its
    entries: one per top-k slot on this rank) is cast once on the wire, from float32."""
    lay = res.expert
    y = op.combine_expert_major(lay.x.clone(), routing=res.routing)
    ids = idx.long()
    ok = (ids >= 0) & (ids < epr(ws) * ws)
    dest = torch.where(ok, ids // epr(ws), torch.full_like(ids, ws))
    xf = x.float()
    acc = torch.zeros_like(xf)
    for r in range(ws):  # per destination: its entries' local sum (m copies of the row), then the cast
        m = (dest == r).sum(1, keepdim=True).float()
        local = torch.zeros_like(xf)
        for c in range(K):
            local = torch.where(m > c, local + xf, local)
        cast = cast_values(local, quant, scale_bytes)
        acc = torch.where(m > 0, acc + cast, acc)
    want = acc.to(torch.bfloat16)
    # (the order of a token's destinations changes the float32 sum of different terms: compare within
    # one rounding of each term)
    assert torch.allclose(y.float(), want.float(), rtol=2 ** -6, atol=1e-6), f"{where}: expert-major combine"


@pytest.mark.parametrize("quant, scale_bytes", WIRES)
@pytest.mark.parametrize("ws", [2, 4])
def test_the_fp8_wire_on_the_torch_backend(ws, quant, scale_bytes):
    run_distributed(wire_job, ws, "torch", quant, scale_bytes, torch.int64 if ws == 4 else torch.int32, timeout=300)


def test_every_cast_has_a_wire():
    assert set(COMBINE_WIRE_QUANTS) == {q for q, _ in WIRES}
