"""The training API's edges (torch backend, gloo, 2 ranks): inference calls stay the plain op's (the
training modules are not even imported); router weights in bf16/fp16; the errors, each naming the
argument, the value and what is allowed, raised on every rank alike (no rank left in an exchange)."""
from __future__ import annotations

import sys

import pytest
import torch

from mori_jit.ops.ep import (EpArgumentError, EpArgumentTypeError, EpDispatchCombineConfig, EpDispatchCombineOp,
                             EpError, EpUnsupportedError)
from mori_jit.testing.distributed import run_distributed

M, H, E, K = 6, 16, 2, 2


def _cfg(rank, ws, **kw):
    base = dict(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=E,
                num_experts_per_token=K, kernel_backend="torch", data_type=torch.float32)
    return EpDispatchCombineConfig(**{**base, **kw})


def _inputs(rank, n=4):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, H, generator=g), torch.rand(n, K, generator=g), torch.randint(0, 2 * E, (n, K), generator=g)


def _raises(kind, *words):
    """A context that expects ``kind`` (an EpError) whose message holds every word."""
    class _Expect:
        def __enter__(self):
            return self

        def __exit__(self, et, e, tb):
            assert et is not None, f"{kind.__name__} expected"
            assert issubclass(et, kind) and issubclass(et, EpError), f"{et.__name__}: {e}"
            assert all(w in str(e) for w in words), f"{words} not all in: {e}"
            return True
    return _Expect()


def _inference_job(rank, ws):
    x, w, ids = _inputs(rank)
    with EpDispatchCombineOp(_cfg(rank, ws, index_dtype=torch.int64)) as op:
        with torch.enable_grad():  # grad mode on, nothing requires grad: the plain calls
            out, out_w, _, _, total, routing = op.dispatch(x, w, None, ids, return_routing=True)
            y, _ = op.combine(out, routing=routing)
        assert not any(m.startswith("mori_jit.ops.ep.train") for m in sys.modules), "inference imported train"
        for dtype in (torch.bfloat16, torch.float16):  # a router in the model's dtype: moved as float32
            got = op.dispatch(x, w.to(dtype), None, ids)[1]
            want = op.dispatch(x, w.to(dtype).float(), None, ids)[1]
            assert got.dtype == torch.float32 and torch.equal(got[:int(total)], want[:int(total)])


def test_inference_calls_are_the_plain_ones():
    run_distributed(_inference_job, 2, timeout=120)


def _errors_job(rank, ws):
    from mori_jit.ops.ep import train

    x, w, ids = _inputs(rank)
    with EpDispatchCombineOp(_cfg(rank, ws)) as op:
        with _raises(EpArgumentTypeError, "op: expected an EpDispatchCombineOp", "str"):
            train.register("op")
        with EpDispatchCombineOp(_cfg(rank, ws, hidden_dim=2 * H)) as other:
            with _raises(EpArgumentError, "gradient_op:", f"hidden_dim={2 * H}", "allowed"):
                train.register(op, gradient_op=other)
        with _raises(EpArgumentError, "handle: 987654", "allowed"):
            torch.ops.mori_jit.ep_dispatch(987654, x, w, None, ids.int())
        h = train.register(op)
        # a differentiable combine needs a differentiable dispatch (it keeps what the backward needs)
        out, _, _, _, _, routing = op.dispatch(x, w, None, ids.int(), return_routing=True)
        with _raises(EpArgumentError, "routing:", "differentiable dispatch"):
            op.combine(out.clone().requires_grad_(), routing=routing)
        # a forward combine after the op's next dispatch: the op's own check refuses it on every rank
        both = torch.tensor([[0, E]] * 4, dtype=torch.int32)  # every token to both ranks: rows on every rank
        d = train.dispatch(h, x.requires_grad_(), w, both)
        train.dispatch(h, x[:0], w[:0], both[:0])  # (no rows anywhere: no routing equal to d's)
        with _raises(EpArgumentError, "routing:", "latest dispatch"):
            train.combine(h, d.out, d)
        with _raises(EpArgumentError, "d:", "expert_capacity"):
            train.combine_expert_major(h, d.out, d)
    fp8 = dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=torch.float8_e4m3fn,
               combine_data_type=torch.bfloat16, scale_dim=1, scale_type_size=4, hidden_dim=128)
    with EpDispatchCombineOp(_cfg(rank, ws, **fp8)) as op:  # no gradient op: refused at the combine
        h = train.register(op)
        xb = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
        d = train.dispatch(h, xb, w, ids.int())
        with _raises(EpUnsupportedError, "gradient_op=", "bfloat16"):
            train.combine(h, d.out.to(torch.bfloat16), d)
    own = dict(dispatch_data_type=torch.float8_e4m3fn, combine_data_type=torch.bfloat16, scale_dim=1,
               scale_type_size=4)
    with EpDispatchCombineOp(_cfg(rank, ws, **own)) as op:  # caller-quantized rows: no gradient reaches them
        q = torch.randn(4, H).to(torch.float8_e4m3fn).requires_grad_()
        with _raises(EpUnsupportedError, "float8_e4m3fn", "dispatch_quant_type"):
            op.dispatch(q, w, torch.ones(4, 1), ids.int())


def test_errors_name_the_argument():
    run_distributed(_errors_job, 2, timeout=120)


def test_the_op_module_names_train_by_path_only():
    """core imports no train module (the import rule); the path it names exists."""
    import importlib

    from mori_jit.ops.ep.core import legs, op

    assert importlib.import_module(legs._TRAIN).__name__ == "mori_jit.ops.ep.train.hooks"
    for module in (op, legs):
        with pytest.raises(AttributeError):
            getattr(module, "train")


@pytest.mark.parametrize("rows", [5, 8, 11], ids=["shorter", "cap", "longer"])
def test_source_ids_are_fresh_int32_and_minus_one_past_total(rows):
    """A dispatch's source ids (``TrainDispatch.src``) from a routing whose ``recv_src`` is the
    received rows only (the torch backend), the whole receive side, or longer (a view of an arena)."""
    from types import SimpleNamespace

    from mori_jit.ops.ep.train.legs import _masked, _src_of, row_mask

    cap, total = 8, torch.tensor([5], dtype=torch.int32)
    recv_src = torch.arange(100, 100 + rows, dtype=torch.int32)
    keep = row_mask(total, cap)
    src = _src_of(SimpleNamespace(recv_src=recv_src), keep)
    assert src.dtype == torch.int32 and src.tolist() == [100, 101, 102, 103, 104, -1, -1, -1]
    assert src.data_ptr() != recv_src.data_ptr()
    rows_in = torch.full((cap, 3), 7.0, dtype=torch.bfloat16)
    assert _masked(rows_in, keep, 0).float().sum(1).tolist() == [21.0] * 5 + [0.0] * 3
    fp8 = torch.full((cap, 2), 1.5).to(torch.float8_e4m3fn)
    assert _masked(fp8, keep, 0).float().tolist() == [[1.5, 1.5]] * 5 + [[0.0, 0.0]] * 3
