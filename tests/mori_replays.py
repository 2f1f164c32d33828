"""The serving engines' mori adapters, replayed through ``mori_jit.compat.mori.install()`` and
``import mori`` (device-generic: the CPU tests run them on the torch backend over gloo, the GPU
tests on the hip backend, eagerly, in a captured graph and on a side stream).

Each replay is written from how the adapter uses mori's API (the names, the order of the calls,
the arguments it passes and what it reads back), not from its code:

* SGLang ``moriepv2.py`` (mori's v2 op): a ``mori.cco.Communicator`` from a broadcast unique id,
  the v2 config, ``EpDispatchCombineOp(cfg, comm)``, ``comm.barrier()``, ``cfg.effective_max_recv``,
  ``prepare_recv_cap`` looked up with ``hasattr``; per step ids cast to int32 and weights to
  float32, ``dispatch(..., return_routing=True)``, ``combine(out, None, recv_ids, routing=r)``;
* SGLang ``moriep.py`` (mori's v1 op, normal mode): the group registered by name and
  ``mori.shmem.shmem_torch_process_group_init``, the v1 config built from keywords filtered through
  ``dataclasses.fields``, ``dispatch(x, w, scale, ids, call_local_expert_count=...)``,
  ``op.local_expert_count``, ``combine(out, None, ids)[0][:n]``;
* vLLM ``moriep_ht.py`` / ``mori.py``: one v1 op per micro-batch, ``dispatch(a1, w, scale, ids)``
  (the 5-tuple), ``combine(out, None, ids)[0]`` copied into the caller's output;
* vLLM ``moriep_ll.py``: ``dispatch_send`` then the ``dispatch_recv`` hook, ``combine_send`` then
  the ``combine_recv`` hook (AsyncLL itself is refused by name).

The expert applies the top-k weights on its side, as the engines' experts do (each received row's
local slots); the combine sums; every result is checked against the dense result each rank computes
from its own inputs alone.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mori_jit.ops.ep.quant import DISPATCH_QUANT_TYPES, dequantize, quantize

M, H, EPR, K = 16, 256, 4, 4
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
FP8_BLOCK = DISPATCH_QUANT_TYPES["fp8_e4m3_block128"]


def install_mori():
    """``mori_jit.compat.mori.install()`` then ``import mori``, as a process of an engine does."""
    import mori_jit.compat.mori as compat

    assert compat.install()
    import mori
    return mori


# -- the model side: router, expert, dense result -------------------------------------------------
def route(rank: int, ws: int, n: int, gen: torch.Generator, device, avoid_last: bool = False):
    """``n`` tokens of this rank: bf16 rows, softmax top-k weights (float32) and int64 ids (what a
    model's router makes); ``avoid_last``: no token picks an expert of the last rank (the other
    ranks hold at least ``K`` experts)."""
    x = torch.randn(n, H, generator=gen).to(BF16)
    logits = torch.randn(n, EPR * ws, generator=gen)
    if avoid_last and ws > 1:
        logits[:, (ws - 1) * EPR:] = float("-inf")
    w, ids = torch.topk(logits.softmax(-1), K, dim=-1)
    return x.to(device), (w / w.sum(-1, keepdim=True)).to(device), ids.to(device)


def _expert_terms(ids: torch.Tensor, w: torch.Tensor, mask: torch.Tensor):
    """The weighted coefficient and bias each row's slots add: expert e maps v to v * (1 + e/8) + e/16."""
    gid = ids.to(torch.float32)
    coef = torch.where(mask, w * (1 + gid / 8), torch.zeros_like(w)).sum(-1, keepdim=True)
    bias = torch.where(mask, w * gid / 16, torch.zeros_like(w)).sum(-1, keepdim=True)
    return coef, bias


def expert(rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """The experts of this rank over every received row (rows past ``total_recv`` give garbage the
    combine never reads): each of a row's slots naming a local expert adds its weighted output."""
    lo = rank * EPR
    coef, bias = _expert_terms(ids, weights, (ids >= lo) & (ids < lo + EPR))
    return (rows.to(torch.float32) * coef + bias).to(BF16)


def dense(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The MoE output of this rank's tokens computed here, from its own inputs only."""
    coef, bias = _expert_terms(ids, w, ids >= 0)
    return x.to(torch.float32) * coef + bias


def check(y: torch.Tensor, x, w, ids) -> None:
    """``y`` (bf16) is the dense result within a bf16 rounding per destination rank and one at the end."""
    assert y.shape == x.shape and y.dtype == BF16, (y.shape, y.dtype)
    torch.testing.assert_close(y.float(), dense(x, w, ids), rtol=2e-2, atol=3e-2)


def expected_local_counts(ids: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """The (token, local expert) pairs every rank sends this one, from every rank's ids (gathered)."""
    every = [None] * ws
    dist.all_gather_object(every, ids.cpu())
    counts = torch.zeros(EPR, dtype=torch.int32)
    for t in every:
        local = t[(t >= rank * EPR) & (t < (rank + 1) * EPR)] - rank * EPR
        counts += torch.bincount(local.flatten(), minlength=EPR).to(torch.int32)
    return counts


def calls(rank: int, ws: int):
    """(tokens, avoid_last) per step: full, rank 1 empty and the others uneven, nobody routes to the
    last rank, every rank empty."""
    return [(M, False), ([M - 3, 0, 5, 11][rank % 4], False), (M - 1 - rank % M, True), (0, False)]


# -- SGLang -----------------------------------------------------------------------------------------
def sglang_v2_op(mori, rank: int, ws: int, group=None):
    """SGLang's v2 init: a communicator from rank 0's unique id, the v2 config, the op, a barrier."""
    from mori.cco import Communicator
    from mori.ops.dispatch_combine_v2 import EpDispatchCombineConfig, EpDispatchCombineOp

    box = [Communicator.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)  # (SGLang: group.broadcast_object)
    comm = Communicator.init(ws, rank, box[0], per_rank_vmm=4 * (1 << 30))
    cfg = EpDispatchCombineConfig(
        rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M, num_experts_per_rank=EPR,
        num_experts_per_token=K, data_type=BF16, dispatch_data_type=None, combine_data_type=None, scale_dim=0,
        scale_type_size=0, combine_mode="gather", max_total_recv_tokens=0, dispatch_block_num=None,
        combine_block_num=None, warp_num_per_block=None, combine_warp_num_per_block=None)
    op = EpDispatchCombineOp(cfg, comm)
    comm.barrier()
    assert cfg.effective_max_recv == cfg.recv_capacity == ws * M
    assert not hasattr(op, "prepare_recv_cap")  # (so SGLang passes no recv_cap)
    return op


def sglang_v2_step(op, rank: int, x, w, ids, stream=None):
    """SGLang's v2 dispatch_a/dispatch_b/combine_a/combine_b; ``stream``: both legs on that side
    stream between events (its two-batch-overlap path)."""
    w32, ids32 = w.to(torch.float32), ids.to(torch.int32)
    if stream is None:
        out, out_w, _, out_ids, _, routing = op.dispatch(x, w32, None, ids32, return_routing=True)
        y, _ = op.combine(expert(out, out_w, out_ids, rank), None, out_ids, routing=routing)
        return y[:x.shape[0]]
    compute = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(compute)
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        out, out_w, _, out_ids, _, routing = op.dispatch(x, w32, None, ids32, return_routing=True)
        done = torch.cuda.Event()
        done.record(stream)
    compute.wait_event(done)
    expert_out = expert(out, out_w, out_ids, rank)  # (on the compute stream, as the MoE runner)
    ready = torch.cuda.Event()
    ready.record(compute)
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        y, _ = op.combine(expert_out, None, out_ids, routing=routing)
        done = torch.cuda.Event()
        done.record(stream)
    compute.wait_event(done)
    return y[:x.shape[0]]


def register_group(mori, group=None) -> None:
    """What SGLang's and vLLM's v1 inits do first: the group registered as "mori", mori.shmem on it."""
    try:
        torch._C._distributed_c10d._register_process_group("mori", group or dist.group.WORLD)
    except RuntimeError as e:  # (a second op in one process: the engines ignore this one)
        assert "already registered" in str(e), e
    assert mori.shmem.shmem_torch_process_group_init("mori") == 0


def v1_op(mori, rank: int, ws: int, data_type=BF16, **engine_fields):
    """A v1 op from the keywords an engine passes, filtered as SGLang filters them."""
    fields = dict(data_type=data_type, rank=rank, world_size=ws, hidden_dim=H,
                  scale_dim=H // 128 if data_type == FP8 else 0, scale_type_size=4, max_token_type_size=2,
                  max_num_inp_token_per_rank=M, num_experts_per_rank=EPR, num_experts_per_token=K,
                  warp_num_per_block=16, block_num=80, max_total_recv_tokens=0, use_external_inp_buf=True,
                  kernel_type=mori.ops.EpDispatchCombineKernelType.IntraNode, gpu_per_node=min(8, ws),
                  rdma_block_num=0, num_qp_per_pe=2, quant_type="none")
    fields.update(engine_fields)
    known = {f.name for f in dataclasses.fields(mori.ops.EpDispatchCombineConfig)}
    return mori.ops.EpDispatchCombineOp(mori.ops.EpDispatchCombineConfig(**{k: v for k, v in fields.items()
                                                                            if k in known}))


def sglang_v1_step(op, rank: int, ws: int, x, w, ids, record: bool = True):
    """SGLang's v1 normal-mode step (fp8 rows with their block scales when the op moves fp8: the
    adapter quantizes first); returns ``(y, local counts)`` and the values the experts saw."""
    fp8 = op.cfg.dispatch_dtype == FP8
    xs, scale = quantize(x, FP8_BLOCK, 4) if fp8 else (x, None)
    out, out_w, out_s, out_ids, _ = op.dispatch(xs, w, scale, ids, call_local_expert_count=record)
    counts = op.local_expert_count if record else None
    rows = dequantize(out, out_s, FP8_BLOCK.block) if fp8 else out
    y = op.combine(expert(rows, out_w, out_ids, rank), None, ids)[0]
    seen = dequantize(xs, scale, FP8_BLOCK.block) if fp8 else x
    return y[:x.shape[0]], counts, seen


# -- vLLM -------------------------------------------------------------------------------------------
def vllm_ht_step(op, rank: int, x, w, ids, output: torch.Tensor) -> None:
    """vLLM's high-throughput prepare/finalize: dispatch, the expert on the prepare result, combine
    copied into ``output``."""
    a1, weights, _, dispatch_ids, expert_num_tokens = op.dispatch(x, w, None, ids)
    assert expert_num_tokens.dtype == torch.int32 and expert_num_tokens.numel() == 1
    fused = expert(a1, weights, dispatch_ids, rank)
    output.copy_(op.combine(fused, None, ids)[0][:output.shape[0]])


def vllm_ll_step(op, rank: int, x, w, ids, output: torch.Tensor) -> None:
    """vLLM's low-latency prepare/finalize: the send calls, then the receive hooks, then the
    receivers (the prepare result, the copy into ``output``)."""
    dispatch_out = op.dispatch_send(x, w, None, ids)
    op.dispatch_recv()
    a1, weights, _, dispatch_ids, _ = dispatch_out
    combine_out = op.combine_send(expert(a1, weights, dispatch_ids, rank), None, ids)
    op.combine_recv()
    output.copy_(combine_out[0][:output.shape[0]])
