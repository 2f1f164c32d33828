"""CPU tests of the EP op's MoE features on the torch backend (gloo, 2 and 4 ranks; the jobs are
device-generic: ``test_gpu_ep_moe.py`` runs them on NCCL): per-token scales,
in-op fp8 block quantization, int64 ids, local expert counts, the expert-major layout and its
combine, routing replay. Every result is checked against the independent golden checks
(``golden.py``, ``golden_moe.py``), computed from the inputs of every rank."""
from __future__ import annotations


import pytest
import torch

from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpUnsupportedError
from mori_jit.testing.golden import golden_check, make_inputs
from mori_jit.testing.golden_moe import golden_check_experts, golden_quantize
from mori_jit.ops.ep.results import EpDispatchResult
from mori_jit.testing.distributed import run_distributed

FP8, E8M0 = torch.float8_e4m3fn, getattr(torch, "float8_e8m0fnu", torch.uint8)
M, H, EPR, K = 24, 256, 3, 4
QUANT = dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8, combine_data_type=torch.bfloat16,
             scale_dim=H // 128)

#: (name, config fields); every config has expert counts
CONFIGS = [
    ("bf16_f32_scales_int64_layout_replay", dict(scale_dim=3, scale_type_size=4, index_dtype=torch.int64,
                                                 expert_capacity=-1, routing_replay=True)),
    ("bf16_ue8m0_scales_layout", dict(scale_dim=H // 128, scale_type_size=1, expert_capacity=-1)),
    ("quant_f32_int64_layout_replay", dict(QUANT, scale_type_size=4, index_dtype=torch.int64,
                                           expert_capacity=-1, routing_replay=True)),
    ("quant_ue8m0_layout", dict(QUANT, scale_type_size=1, expert_capacity=-1)),
    ("f32_counts_only", dict(data_type=torch.float32)),
]


def _config(rank, ws, fields) -> EpDispatchCombineConfig:
    cap = ws * M * K if fields.get("expert_capacity") == -1 else fields.get("expert_capacity", 0)
    return EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=H, max_num_inp_token_per_rank=M,
                                   num_experts_per_rank=EPR, num_experts_per_token=K, kernel_backend="torch",
                                   expert_counts=True, **{**fields, "expert_capacity": cap})


def _calls(rank, ws):
    """(tokens, drop_frac, all_to_rank, with_weights) per call: token counts change every call, some
    ranks send nothing, and in one call every token goes to the last rank (the others receive nothing)."""
    return [(M, 0.0, None, True), ([0, M - 1, 5, 17][rank % 4], 0.3, None, True),
            (M - 2 * rank - 1, 0.0, ws - 1, True), (7 + rank, 0.2, None, False), (0, 0.0, None, True)]


def _scales(cfg, n, gen, device):
    if not cfg.scale_dim or cfg.dispatch_quant_type:
        return None
    if cfg.scale_type_size == 1:
        s = torch.randint(100, 150, (n, cfg.scale_dim), generator=gen, dtype=torch.int32).to(torch.uint8).view(E8M0)
    else:
        s = torch.rand(n, cfg.scale_dim, generator=gen) + 0.5
    return s.to(device)


def _received(cfg, x, s):
    """What the receiver must get for input rows ``x`` and scales ``s``: the golden quantization
    under dispatch_quant_type."""
    return golden_quantize(x, cfg.scale_type_size) if cfg.dispatch_quant_type else (x, s)


def _values(q, s, quant: bool) -> torch.Tensor:
    """float32 values of received rows (fp8 rows times their block scales under quant)."""
    if not quant:
        return q.float()
    return (q.float().reshape(*q.shape[:-1], q.shape[-1] // 128, 128) * s.float().unsqueeze(-1)).reshape(q.shape)


def _check_expert_major_combine(op, res, xv, w, idx, rank, ws):
    """Experts e(v) = (global id + 1) * v, weighted on the expert side; the padding is NaN. Compares
    with the dense sum over this rank's own tokens, within the bound of one bf16 rounding per entry
    and one at the end."""
    cfg, lay, dev = op.cfg, res.expert, op.device
    E, C = cfg.num_experts_per_rank, cfg.expert_capacity
    vals = _values(lay.x, lay.scales, bool(cfg.dispatch_quant_type))
    lw = lay.weights if lay.weights is not None else torch.ones(E, C, device=dev)
    gid = rank * E + torch.arange(E, dtype=torch.float32, device=dev)
    expert_out = (lw[..., None] * (gid[:, None, None] + 1) * vals).to(torch.bfloat16)
    valid = torch.arange(C, device=dev)[None, :] < res.expert_counts[:, None]
    expert_out[~valid] = float("nan")
    y = torch.full((xv.shape[0], H), float("nan"), dtype=torch.bfloat16, device=dev)
    assert op.combine_expert_major(expert_out, routing=res.routing, out=y) is y
    ids = idx.long()
    ok = (ids >= 0) & (ids < cfg.num_experts)
    ww = (w if w is not None else torch.ones(ids.shape, device=dev)) * ok * (ids + 1).clamp(min=0)
    terms = ww[:, :, None] * xv[:, None, :]  # [n, k, H]
    want = terms.sum(1)
    bound = terms.abs().sum(1) * 2.0 ** -7 + want.abs() * 2.0 ** -8 + 1e-6
    err = (y.float() - want).abs()
    assert bool((err <= bound).all()), f"rank {rank}: expert-major combine off by {float((err - bound).max())}"


def _replay_refusals(op, other, res, x, w, s, rank):
    """Every rank passes the same kind of bad replay, so every rank raises (nothing is exchanged)."""
    n, dev = x.shape[0], op.device
    m = n + 1 if n < M else n - 1
    with pytest.raises(ValueError, match=f"routing was made for {n}"):
        op.dispatch(torch.zeros(m, H, dtype=x.dtype, device=dev), None,
                    None if s is None else torch.zeros(m, s.shape[1], device=dev).to(s.dtype), None, routing=res.routing)
    with pytest.raises(ValueError, match="another op's or an earlier dispatch's"):
        op.dispatch(x, w, s, None, routing=other)
    with pytest.raises(ValueError, match=r"input: expected shape"):
        op.dispatch(x[:, :128].contiguous(), w, s, None, routing=res.routing)


def _features_job(rank, ws):
    gen = torch.Generator().manual_seed(977 + 31 * rank + ws)
    for name, fields in CONFIGS:
        cfg = _config(rank, ws, fields)
        with EpDispatchCombineOp(cfg) as op, EpDispatchCombineOp(cfg) as other:
            for call, (n, drop, to, with_w) in enumerate(_calls(rank, ws)):
                try:
                    _one_call(op, other, cfg, rank, ws, gen, n, drop, to, with_w)
                except Exception as e:
                    raise AssertionError(f"{name} call {call} (rank {rank} of {ws}, {n} tokens): {e}") from e


def _one_call(op, other, cfg, rank, ws, gen, n, drop, to, with_w):
    dev = op.device
    x, w, idx = make_inputs(rank, n, H, K, cfg.num_experts, cfg.input_dtype, dev, gen, drop_frac=drop,
                            all_to_rank=to, world_size=ws, index_dtype=cfg.index_dtype)
    w = w if with_w else None
    s = _scales(cfg, n, gen, dev)
    res = op.dispatch(x, w, s, idx, return_result=True)
    assert isinstance(res, EpDispatchResult) and res.out_indices.dtype == cfg.index_dtype
    assert res.out.shape == (cfg.recv_capacity, H) and res.out.dtype == cfg.dispatch_dtype
    if cfg.scale_dim:
        assert res.out_scales.shape == (cfg.recv_capacity, cfg.scale_dim)
        assert res.out_scales.element_size() == cfg.scale_type_size
    xq, sq = _received(cfg, x, s)
    wg = w if w is not None else torch.zeros(n, K, device=dev)
    golden_check(op.group, rank, ws, M, EPR, xq, wg, idx, res.out, res.out_weights, res.out_indices,
                 res.total_recv, res.routing.recv_src, None, None, scales=sq, out_scales=res.out_scales)
    golden_check_experts(op.group, rank, ws, M, EPR, xq, w, idx, res.expert_counts, res.expert, scales=sq,
                         out=res.out, recv_src=res.routing.recv_src)
    assert (res.expert is None) == (cfg.expert_capacity == 0)
    if not cfg.dispatch_quant_type and cfg.dispatch_dtype != FP8:  # the arrival-order combine still holds
        y, y_w = op.combine(res.out, weights=res.out_weights, routing=res.routing)
        golden_check(op.group, rank, ws, M, EPR, x, wg, idx, res.out, None, None, res.total_recv,
                     res.routing.recv_src, y, y_w if w is not None else None)
    if not cfg.routing_replay:
        if res.expert is not None:
            _check_expert_major_combine(op, res, _values(xq, sq, bool(cfg.dispatch_quant_type)), w, idx, rank, ws)
        with pytest.raises(EpUnsupportedError, match="routing_replay=True"):
            op.dispatch(x, w, s, None, routing=res.routing)
        return
    # ---- replay: a new payload lands where the first one did --------------------------------------
    before = [t.clone() for t in (res.routing.recv_src, res.out_indices, res.expert_counts, *res.expert[3:])]
    x2, w2, _ = make_inputs(rank, n, H, K, cfg.num_experts, cfg.input_dtype, dev, gen)
    s2 = _scales(cfg, n, gen, dev)
    res2 = op.dispatch(x2, w2, s2, None, routing=res.routing, return_result=True)
    assert res2.routing is res.routing and int(res2.total_recv) == int(res.total_recv)
    after = (res.routing.recv_src, res2.out_indices, res2.expert_counts, *res2.expert[3:])
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a replay moved rows or entries"
    x2q, s2q = _received(cfg, x2, s2)
    golden_check(op.group, rank, ws, M, EPR, x2q, w2, idx, res2.out, res2.out_weights, res2.out_indices,
                 res2.total_recv, before[0], None, None, scales=s2q, out_scales=res2.out_scales)
    golden_check_experts(op.group, rank, ws, M, EPR, x2q, w2, idx, res2.expert_counts, res2.expert, scales=s2q,
                         out=res2.out, recv_src=before[0])
    _check_expert_major_combine(op, res2, _values(x2q, s2q, bool(cfg.dispatch_quant_type)), w2, idx, rank, ws)
    other_routing = other.dispatch(x, w, s, idx, return_routing=True)[5]
    _replay_refusals(op, other_routing, res, x2, w2, s2, rank)
    op.dispatch(x, w, s, idx)  # a new dispatch: the routing of the first one is stale now
    with pytest.raises(ValueError, match="another op's or an earlier dispatch's"):
        op.dispatch(x2, w2, s2, None, routing=res.routing)


@pytest.mark.parametrize("ws", [2, 4])
def test_moe_features_match_the_golden_checks(ws):
    run_distributed(_features_job, ws, timeout=300)
