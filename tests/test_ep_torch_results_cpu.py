"""Results the ``torch`` backend got wrong (gloo, CPU): received fields read back from a packed
row whatever their dtype, offset and row count (one received row of int64 ids included), and a
combine whose ``out`` and ``out_weights`` share bytes is refused instead of corrupting ``y``."""
from __future__ import annotations

import itertools

import pytest
import torch

from mori_jit.ops.ep import EpArgumentError, EpDispatchCombineConfig, EpDispatchCombineOp
from mori_jit.ops.ep.backends.torch.rows import from_row_bytes, pack_rows, row_bytes
from mori_jit.testing.distributed import run_distributed
from mori_jit.testing.golden import golden_check

H, K = 64, 2
DTYPES = [torch.int64, torch.int32, torch.float64, torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8]


def _values(dtype, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols * dtype.itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)  # every bit pattern, NaN payloads included: compared as bytes below


@pytest.mark.parametrize("rows", [0, 1, 2, 3])
@pytest.mark.parametrize("before,after", list(itertools.product(DTYPES[:5:2] + [torch.uint8], DTYPES[1::3])))
def test_every_field_reads_back_at_any_offset_and_row_count(rows, before, after):
    """A packed row is [lead (1 column of ``before``), field, tail]; the field starts at the lead's
    width, which need not be a multiple of its element size (a view of such a storage is refused)."""
    for i, dtype in enumerate(DTYPES):
        lead, field, tail = _values(before, rows, 1, i), _values(dtype, rows, 3, 10 + i), _values(after, rows, 1, 20)
        packed = pack_rows([row_bytes(lead), row_bytes(field), row_bytes(tail)], None)
        w0, w1 = before.itemsize, 3 * dtype.itemsize
        for sl in (packed[:, w0:w0 + w1], packed[1:, w0:w0 + w1] if rows else packed[:, w0:w0 + w1]):
            got = from_row_bytes(sl, dtype, 3)
            want = field[-sl.shape[0]:] if sl.shape[0] else field[:0]
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(row_bytes(got), row_bytes(want)), (dtype, before, rows)


def _one_row_job(rank, ws):
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=4,
                                  num_experts_per_rank=2, num_experts_per_token=K, kernel_backend="torch",
                                  index_dtype=torch.int64, scale_dim=1, scale_type_size=8)
    with EpDispatchCombineOp(cfg) as op:
        # one token per rank, both of its experts on the next rank: every rank receives one row
        dest, src = (rank + 1) % ws, (rank - 1) % ws
        x = torch.randn(1, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        w = torch.tensor([[0.25, 0.75]])
        idx = torch.tensor([[2 * dest, 2 * dest + 1]], dtype=torch.int64)
        scales = torch.tensor([[1.5 + rank]], dtype=torch.float64)
        out, out_w, out_s, out_idx, total, routing = op.dispatch(x, w, scales, idx, return_routing=True)
        assert int(total) == 1
        assert out_idx.dtype == torch.int64 and out_idx[:1].tolist() == [[2 * rank, 2 * rank + 1]]
        assert out_s[:1].tolist() == [[1.5 + src]] and out_w[:1].tolist() == [[0.25, 0.75]]
        y, y_w = op.combine(out, weights=out_w, routing=routing)
        golden_check(op.group, rank, ws, 4, 2, x, w, idx, out, out_w, out_idx, total, routing.recv_src, y, y_w)


@pytest.mark.parametrize("ws", [1, 2])
def test_int64_ids_of_a_rank_that_receives_one_row(ws):
    run_distributed(_one_row_job, ws, timeout=120)


def _overlap_job(rank, ws):
    n = 4
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=n,
                                  num_experts_per_rank=2, num_experts_per_token=K, kernel_backend="torch")
    with EpDispatchCombineOp(cfg) as op:
        x = torch.ones(n, H, dtype=torch.bfloat16)
        w = torch.ones(n, K)
        idx = torch.tensor([[0, 1]] * n, dtype=torch.int32)
        out, out_w, _, _, _, routing = op.dispatch(x, w, None, idx, return_routing=True)
        raw = torch.zeros(n * H * 2 + 64, dtype=torch.uint8)
        start = (16 - raw.data_ptr() % 16) % 16
        y = raw[start:start + n * H * 2].view(torch.bfloat16).view(n, H)
        tail = start + n * H * 2 - 16  # the last 16 bytes of y are the first 4 weights
        y_w = raw[tail:tail + n * K * 4].view(torch.float32).view(n, K)
        with pytest.raises(EpArgumentError, match="out_weights: overlaps out; pass a separate tensor"):
            op.combine(out, weights=out_w, routing=routing, out=y, out_weights=y_w)
        assert not raw.any()  # nothing was written
        y, y_w = op.combine(out, weights=out_w, routing=routing, out=y, out_weights=torch.empty(n, K))
        assert torch.equal(y, torch.ones(n, H, dtype=torch.bfloat16)) and torch.equal(y_w, torch.ones(n, K))


def test_out_and_out_weights_that_share_bytes_are_refused():
    run_distributed(_overlap_job, 1, timeout=120)
