"""Jobs that check the split legs (``dispatch_send``/``dispatch_recv``, ``combine_send``/
``combine_recv`` and the ``return_recv_hook`` spelling; docs/design.md §6, "Send and receive") on
any backend and device: ``tests/test_ep_overlap_cpu.py`` runs them on the torch backend over gloo,
``tests/test_gpu_ep_overlap.py`` on the hip kernels.

Every split call is held against two independent answers: the golden checks (``golden.py``,
``golden_moe.py``, from every rank's inputs) and the same op's unsplit legs on the same inputs
(received rows matched by source, sums bit for bit: both sum each token's rows in the same order).
Outputs are poisoned first: the torch backend's between the send and the receive (the receive
fills them), the hip backend's arena regions before the send (peers write them during it).
"""
from __future__ import annotations

import pytest
import torch

from ep_gpu_checks import identity_expert
from test_ep_moe_cpu import CONFIGS as MOE_CONFIGS, EPR, H, K, M, _calls, _check_expert_major_combine, _received, \
    _scales, _values
from mori_jit.testing.golden import experts_per_rank_at, golden_check, make_inputs
from mori_jit.testing.golden_moe import golden_check_experts

FP8 = torch.float8_e4m3fn
#: (name, config fields) of the split checks: dtype pairs and both combine protocols, then every
#: MoE config of the MoE checks (with expert counts)
CONFIGS = [("bf16", {}), ("bf16_flags", dict(combine_low_latency=False)), ("fp32", dict(data_type=torch.float32)),
           ("fp8_bf16", dict(dispatch_data_type=FP8, combine_data_type=torch.bfloat16))]
CONFIGS += [(name, dict(fields, expert_counts=True)) for name, fields in MOE_CONFIGS]
#: arena regions a dispatch or combine writes (the hip backend's, poisoned before a send)
OUTPUT_REGIONS = ("disp_out", "out_wts", "out_idx", "recv_to_src", "src_to_recv", "total_recv", "out_scales",
                  "expert_counts", "exp_x", "exp_scales", "exp_wts", "exp_maps")


def experts_per_rank(ws: int) -> int:
    return experts_per_rank_at(ws, EPR, K)


def config(rank, ws, backend, fields=None, split=True):
    from mori_jit.ops.ep import EpDispatchCombineConfig

    fields = dict(fields or {})
    if fields.get("expert_capacity") == -1:  # room for every pair a rank can receive
        fields["expert_capacity"] = ws * M * K
    return EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                   num_experts_per_rank=experts_per_rank(ws), num_experts_per_token=K, kernel_backend=backend,
                                   split_send_recv=split, **fields)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t[:1].numel() * t.element_size())


def poison_arena(op) -> None:
    """The hip backend: every output region its arena has (the internode arena has fewer) to 0xFF
    bytes (NaN, -1), once no peer is mid-write."""
    if op.arena is None:
        return
    torch.cuda.synchronize()
    torch.distributed.barrier()
    a = op.arena
    for name in (r for r in OUTPUT_REGIONS if r in a.offsets):
        a.tensor[a.offsets[name]:a.offsets[name] + a.sizes[name]].fill_(0xFF)
    torch.cuda.synchronize()
    torch.distributed.barrier()


def poison_outputs(op, res, replay: bool) -> None:
    """The torch backend: a send's outputs to 0xFF bytes before its receive fills them (the hip
    backend's are being written by peers: poisoned before the send instead). A replay's ids,
    count and routing are its dispatch's, not the receive's."""
    if op.arena is not None:
        return
    tensors = [res.out, res.out_weights, res.out_scales, res.expert_counts, *(res.expert or ())]
    if not replay:
        tensors += [res.out_indices, res.total_recv, res.routing.recv_src]
    for t in tensors:
        if t is not None and t.numel():
            t.view(torch.uint8).fill_(0xFF)


def dispatch_split(op, hook: bool, *args, **kwargs):
    """One dispatch through the split legs (``hook``: DeepEP's spelling); the received result."""
    if hook:
        res, receive = op.dispatch(*args, return_result=True, return_recv_hook=True, **kwargs)
    else:
        res, receive = op.dispatch_send(*args, return_result=True, **kwargs), op.dispatch_recv
    poison_outputs(op, res, kwargs.get("routing") is not None)
    assert receive() is None
    return res


def combine_split(op, hook: bool, inp, weights, routing, out=None, out_weights=None):
    """One combine through the split legs; ``(y, y_w)`` once received (fresh ones poisoned first)."""
    if hook:
        y, y_w, receive = op.combine(inp, weights=weights, routing=routing, out=out, out_weights=out_weights,
                                     return_recv_hook=True)
    else:
        (y, y_w), receive = op.combine_send(inp, weights=weights, routing=routing, out=out,
                                            out_weights=out_weights), op.combine_recv
    assert (out is None or y is out) and (out_weights is None or y_w is out_weights)
    if out is None:  # (stream order: after the send, which never writes them, before the receive)
        for t in (y, y_w):
            if t is not None:
                t.fill_(float("nan"))
    receive()
    return y, y_w


def received(res) -> list[torch.Tensor]:
    """A dispatch's received rows in source order (the hip backend's arrival order varies), and its
    expert counts: what two dispatches of the same inputs must agree on, byte for byte."""
    t = int(res.total_recv)
    src = res.routing.recv_src[:t].long()
    order = torch.argsort(src)
    rows = [src[order]] + [_bytes(v[:t])[order] for v in (res.out, res.out_weights, res.out_scales, res.out_indices)
                           if v is not None]
    return [r.clone() for r in rows] + ([res.expert_counts.clone()] if res.expert_counts is not None else [])


def _golden(op, rank, ws, x, w, idx, s, res, y=None, y_w=None, recv_src=None):
    """The golden checks of ``res`` (a dispatch of ``x, w, s, idx``) and of the identity expert's sums."""
    cfg = op.cfg
    epr = cfg.num_experts_per_rank
    xq, sq = _received(cfg, x, s)
    wg = w if w is not None else torch.zeros(x.shape[0], K, device=x.device)
    src = res.routing.recv_src if recv_src is None else recv_src
    golden_check(op.group, rank, ws, M, epr, xq, wg, idx, res.out, res.out_weights, res.out_indices, res.total_recv,
                 src, None, None, scales=sq, out_scales=res.out_scales)
    if cfg.expert_counts:
        golden_check_experts(op.group, rank, ws, M, epr, xq, w, idx, res.expert_counts, res.expert, scales=sq,
                             out=res.out, recv_src=src)
    if y is not None:
        golden_check(op.group, rank, ws, M, epr, identity_expert(xq, cfg.combine_dtype), wg, idx,
                     identity_expert(res.out, cfg.combine_dtype), None, None, res.total_recv, src, y,
                     y_w if w is not None else None)


def split_call(op, rank, ws, gen, call, n, drop, to, with_w):
    """One call of :func:`_calls`: the unsplit legs, then the split ones on the same inputs (the
    hook spelling on odd calls), each against the golden checks and the split against the unsplit."""
    cfg, dev, hook = op.cfg, op.device, bool(call % 2)
    x, w, idx = make_inputs(rank, n, H, K, cfg.num_experts, cfg.input_dtype, dev, gen, drop_frac=drop,
                            all_to_rank=to, world_size=ws, index_dtype=cfg.index_dtype)
    w = w if with_w else None
    s = _scales(cfg, n, gen, dev)
    a = op.dispatch(x, w, s, idx, return_result=True)
    want = received(a)
    ya, ya_w = (t.clone() if t is not None else None for t in op.combine(
        identity_expert(a.out, cfg.combine_dtype), weights=a.out_weights, routing=a.routing))

    poison_arena(op)
    b = dispatch_split(op, hook, x, w, s, idx)
    got = received(b)
    assert len(got) == len(want) and all(torch.equal(g, h) for g, h in zip(got, want)), \
        f"rank {rank}: the split dispatch received other rows than the unsplit one"
    inp = identity_expert(b.out, cfg.combine_dtype)
    y = torch.full((n, H), float("nan"), dtype=cfg.combine_dtype, device=dev)
    y_w = torch.full((n, K), float("nan"), device=dev) if w is not None else None
    combine_split(op, hook, inp, b.out_weights, b.routing, out=y, out_weights=y_w)
    _golden(op, rank, ws, x, w, idx, s, b, y, y_w)
    assert torch.equal(y.view(torch.uint8), ya.view(torch.uint8)), f"rank {rank}: split and unsplit sums differ"
    assert (y_w is None) == (ya_w is None) and (y_w is None or torch.equal(y_w, ya_w))
    y2, y2_w = combine_split(op, not hook, inp, b.out_weights, b.routing)  # fresh outputs
    assert torch.equal(y2.view(torch.uint8), ya.view(torch.uint8)) and (y2_w is None or torch.equal(y2_w, ya_w))
    if cfg.expert_capacity and not cfg.routing_replay:
        _check_expert_major_combine(op, b, _values(*_received(cfg, x, s), bool(cfg.dispatch_quant_type)), w, idx, rank, ws)
    if not cfg.routing_replay:
        return
    # a replay through the split legs: the new payload lands where the split dispatch put the first
    src = b.routing.recv_src.clone()
    x2, w2, _ = make_inputs(rank, n, H, K, cfg.num_experts, cfg.input_dtype, dev, gen)
    s2 = _scales(cfg, n, gen, dev)
    r = dispatch_split(op, not hook, x2, w2, s2, None, routing=b.routing)
    assert r.routing is b.routing and int(r.total_recv) == int(b.total_recv)
    y3, y3_w = combine_split(op, hook, identity_expert(r.out, cfg.combine_dtype), r.out_weights, r.routing)
    _golden(op, rank, ws, x2, w2, idx, s2, r, y3, y3_w, recv_src=src)
    if cfg.expert_capacity:
        _check_expert_major_combine(op, r, _values(*_received(cfg, x2, s2), bool(cfg.dispatch_quant_type)), w2, idx, rank, ws)


def split_job(rank, ws, backend, names=None, layout=None):
    """Every config of :data:`CONFIGS` (or those ``names``), every call of :func:`_calls`;
    ``layout``: fields every op takes too (internode: ``gpu_per_node``, ``internode_kernel``)."""
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(4242 + 31 * rank + ws)
    for name, fields in CONFIGS:
        if names is not None and name not in names:
            continue
        with EpDispatchCombineOp(config(rank, ws, backend, {**fields, **(layout or {})})) as op:
            for call, (n, drop, to, with_w) in enumerate(_calls(rank, ws)):
                try:
                    split_call(op, rank, ws, gen, call, n, drop, to, with_w)
                except Exception as e:
                    raise AssertionError(f"{name} call {call} (rank {rank} of {ws}, {n} tokens): {e}") from e


def inputs(op, rank, ws, gen, n=None):
    cfg = op.cfg
    return make_inputs(rank, M if n is None else n, H, K, cfg.num_experts, cfg.input_dtype, op.device, gen,
                       world_size=ws, index_dtype=cfg.index_dtype)


def expect_state_error(match: str):
    from mori_jit.ops.ep import EpStateError

    return pytest.raises(EpStateError, match=match)
