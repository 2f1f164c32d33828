"""The packed expert-sorted layout (``mori_jit.ops.ep.train.packed``): golden checks (every pair once,
in its expert's group, receive row then slot ascending; groups aligned; offsets, counts and the map back
right; padding zero), from synthetic dispatch outputs and through the torch backend at 1, 3 and 8 ranks;
``torch._grouped_mm`` with its offsets equal to the dense MoE; prefill sizes (4096 tokens per rank)
with no capacity error; its argument errors."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from mori_jit.ops.ep import EpArgumentError, EpDispatchCombineConfig, EpDispatchCombineOp, train
from mori_jit.ops.ep.train.packed import rows_bound
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.moe_grads import rel_err


def golden_check_packed(lay, d, rank: int, E: int, A: int) -> None:
    """Assert ``lay`` is the packed layout of dispatch outputs ``d`` (recomputed with Python loops;
    on the CPU, from either backend's tensors)."""
    cap, k = d.indices.shape
    total = int(d.total_recv)
    indices, out, x = d.indices.tolist(), d.out.cpu(), lay.x.cpu()
    want = {e: [] for e in range(E)}
    for i, j in itertools.product(range(total), range(k)):
        e = indices[i][j] - rank * E
        if 0 <= e < E:
            want[e].append((i, j))
    counts = [len(want[e]) for e in range(E)]
    ends = list(itertools.accumulate(-(-c // A) * A for c in counts))
    P = rows_bound(cap, k, E, A)
    assert lay.x.shape == (P, d.out.shape[1]) and lay.row.shape == (P,) and lay.slot.shape == (P,)
    assert lay.counts.tolist() == counts and lay.offsets.tolist() == ends
    assert lay.offsets.dtype == torch.int32 and all(end % A == 0 for end in ends)
    row, slot = lay.row.tolist(), lay.slot.tolist()
    pairs = [None] * P
    for e in range(E):
        start = ends[e] - -(-counts[e] // A) * A
        for q, pair in enumerate(want[e]):
            pairs[start + q] = pair
    for p in range(P):
        if pairs[p] is None:
            assert (row[p], slot[p]) == (-1, -1), f"packed row {p}: padding expected, got {row[p], slot[p]}"
        else:
            assert (row[p], slot[p]) == pairs[p], f"packed row {p}: {pairs[p]} expected, got {row[p], slot[p]}"
    pair_at = [[-1] * k for _ in range(cap)]
    for p, pair in enumerate(pairs):
        if pair is not None:
            pair_at[pair[0]][pair[1]] = p
    assert lay.pair_at.dtype == torch.int32 and lay.pair_at.tolist() == pair_at
    used = torch.tensor([q is not None for q in pairs])
    src_row = torch.tensor([q[0] if q else 0 for q in pairs])
    assert torch.equal(x[used], out[src_row[used]]) and not x[~used].any()
    if d.weights is not None:
        weights = d.weights.cpu()
        w = torch.tensor([float(weights[q]) if q else 0.0 for q in pairs])
        assert torch.equal(lay.weights.cpu(), w)
    y = torch.randn(P, d.out.shape[1])
    y[~used] = float("nan")  # padding may hold anything: it never reaches a sum
    back = train.unpack(lay, y.to(lay.x.device), cap).cpu()
    want_back = torch.zeros(cap, d.out.shape[1])
    for p in range(P):
        if pairs[p] is not None:
            want_back[pairs[p][0]] += y[p]
    assert torch.allclose(back, want_back, atol=1e-6)


def _synthetic(cap, k, H, ws, E, total, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, ws * E + 1, (cap, k), generator=g)  # out-of-range and negative ids drop their slot
    idx[: cap // 3, 1] = idx[: cap // 3, 0]  # a token naming one expert twice has two pairs
    return train.TrainDispatch(torch.randn(cap, H, generator=g), torch.rand(cap, k, generator=g), None, idx,
                               torch.tensor([total], dtype=torch.int32), None, None, None, None)


@pytest.mark.parametrize("A", [1, 4, 16])
def test_packed_layout_golden_on_synthetic_dispatches(A):
    seed = random.SystemRandom().randrange(2 ** 31)
    for rank, total in ((0, 37), (2, 0), (1, 40)):
        d = _synthetic(40, 3, 8, 3, 4, total, seed + rank)
        golden_check_packed(train.pack(d, rank, 4, A), d, rank, 4, A)


def test_pack_refuses_bad_arguments():
    d = _synthetic(4, 2, 8, 2, 2, 4, 0)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(EpArgumentError, match="alignment"):
            train.pack(d, 0, 2, bad)
    with pytest.raises(EpArgumentError, match="experts_per_rank"):
        train.pack(d, 0, 0, 1)
    lay = train.pack(d, 0, 2, 1)
    with pytest.raises(EpArgumentError, match=r"y: shape \[3, 8\]"):
        train.unpack(lay, torch.zeros(3, 8), 4)
    with pytest.raises(EpArgumentError, match=r"num_rows: 5; allowed: 4 \(the dispatch's receive rows\)"):
        train.unpack(lay, torch.zeros(lay.row.shape[0], 8), 5)


def _op(rank, ws, M, H, E, k, backend="torch", **kw):
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=E, num_experts_per_token=k, kernel_backend=backend, **kw)
    return EpDispatchCombineOp(cfg)


def _golden_job(rank, ws, seed, backend="torch"):
    """Three calls (M tokens, none, 5) with int64 ids, each packed at another alignment: the golden check."""
    M, H, E, k = 12, 16, 3, 3
    g = torch.Generator().manual_seed(seed + rank)
    with _op(rank, ws, M, H, E, k, backend, data_type=torch.float32, index_dtype=torch.int64) as op:
        h, on = train.register(op), op.device
        for n, A in ((M, 1), (0, 4), (5, 8)):
            ids = torch.randint(-1, ws * E, (n, k), generator=g)
            x, w = torch.randn(n, H, generator=g), torch.rand(n, k, generator=g)
            d = train.dispatch(h, x.to(on), w.to(on), ids.to(on))
            golden_check_packed(train.pack(d, rank, E, A), d, rank, E, A)


@pytest.mark.parametrize("ws", [1, 3, 8])
def test_packed_layout_golden_through_the_op(ws):
    run_distributed(_golden_job, ws, random.SystemRandom().randrange(2 ** 31), timeout=200)


def _grouped_mm_job(rank, ws, seed, M, backend="torch"):
    """Every rank routes M tokens; the packed layout through torch._grouped_mm (bf16), against the
    dense MoE of every rank's tokens in float64."""
    H, F, E, k, A = 16, 8, 4, 2, 8
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(H, ws * E, generator=g, dtype=torch.float64)
    up = torch.randn(ws * E, H, F, generator=g, dtype=torch.float64) / 4
    down = torch.randn(ws * E, F, H, generator=g, dtype=torch.float64) / 3
    xs = [torch.randn(M, H, generator=g, dtype=torch.float64) for _ in range(ws)]
    mine = slice(rank * E, (rank + 1) * E)
    bf = torch.bfloat16
    with _op(rank, ws, M, H, E, k, backend, data_type=bf) as op:
        h, on = train.register(op), op.device
        probs = torch.softmax(xs[rank] @ gate, -1)
        w, ids = probs.topk(k, -1)
        w = (w / w.sum(-1, keepdim=True)).float()
        d = train.dispatch(h, xs[rank].to(device=on, dtype=bf), w.to(on), ids.int().to(on))
        lay = train.pack(d, rank, E, A)
        v = torch.nn.functional.silu(torch._grouped_mm(lay.x, up[mine].to(on, bf), offs=lay.offsets).float())
        yp = torch._grouped_mm(v.to(bf), down[mine].to(on, bf), offs=lay.offsets).float()
        y = train.combine_packed(h, lay.mask(yp) * lay.weights[:, None], lay, d, dtype=bf).cpu()
    x = xs[rank].to(bf).double()
    want = torch.zeros(M, H, dtype=torch.float64)
    for j in range(k):
        for e in range(ws * E):
            sel = ids[:, j] == e
            want[sel] += w[sel, j, None].double() * (torch.nn.functional.silu(x[sel] @ up[e]) @ down[e])
    assert rel_err(y, want) <= 3e-2, f"rank {rank} (seed {seed}) M {M}: {rel_err(y, want)}"


@pytest.mark.parametrize("M", [24, 4096])
def test_grouped_mm_over_the_packed_layout_matches_the_dense_moe(M):
    """4096 tokens per rank: prefill sizes, no capacity to choose and none exceeded."""
    run_distributed(_grouped_mm_job, 2, random.SystemRandom().randrange(2 ** 31), M, timeout=300)
