"""The torch backend's MoE features and the worked MoE block on NCCL, one rank per GPU (on a GPU
machine: ``pytest -m gpu``): the CPU suite's jobs, on the GPUs."""
from __future__ import annotations

import pytest
import torch

from mori_jit.testing.distributed import run_distributed
from test_ep_moe_cpu import _features_job
from test_ep_moe_layer_cpu import MODES, _layer_job

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


def _gpus_for(ws: int) -> None:
    if torch.cuda.device_count() < ws:
        pytest.skip(f"NCCL needs a GPU per rank: {ws} ranks, {torch.cuda.device_count()} GPUs")


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_torch_backend_moe_features_on_nccl(ws):
    _gpus_for(ws)
    run_distributed(_features_job, ws, backend="nccl", timeout=600)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ws", [2, 4, 8])
def test_moe_block_on_nccl_matches_the_dense_block(ws, mode):
    _gpus_for(ws)
    run_distributed(_layer_job, ws, mode, backend="nccl", timeout=600)


# ---- the hip backend's MoE features, against the torch backend and the golden checks -----------------
# One job per feature config runs at every world size of MORI_EP_TEST_WORLD_SIZES (ranks share a GPU
# under MPS where there are fewer GPUs); shapes are small (hidden 256, 32 tokens) to keep builds and
# runs cheap.

from mori_jit.testing.cuda_graph import capture  # noqa: E402
from mori_jit.testing.gpu_world import WORLD_SIZES, run_ep_job  # noqa: E402


HIP_M, HIP_H, HIP_EPR, HIP_K = 32, 256, 4, 4
FP8, E8M0 = torch.float8_e4m3fn, getattr(torch, "float8_e8m0fnu", torch.uint8)
#: feature -> the configs (their fields) that exercise it, on the hip and torch backends alike
HIP_FEATURES = {
    "int64_ids": [dict(index_dtype=torch.int64)],
    "scales": [dict(scale_dim=3, scale_type_size=4, dispatch_data_type=FP8, combine_data_type=torch.bfloat16),
               dict(scale_dim=2, scale_type_size=1, index_dtype=torch.int64)],
    "expert_counts": [dict(expert_counts=True),
                      dict(expert_counts=True, index_dtype=torch.int64, scale_dim=2, scale_type_size=4)],
    "routing_replay": [dict(routing_replay=True),
                       dict(routing_replay=True, expert_counts=True, index_dtype=torch.int64, scale_dim=3,
                            scale_type_size=1)],
    # bf16 input cast in the kernel, compared byte for byte with quant.py (the torch backend)
    "fp8_cast": [dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8,
                      combine_data_type=torch.bfloat16, scale_dim=HIP_H // 128, scale_type_size=4, expert_counts=True),
                 dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8,
                      combine_data_type=torch.bfloat16, scale_dim=HIP_H // 128, scale_type_size=1,
                      routing_replay=True, index_dtype=torch.int64)],
    # the expert-major layout (with replay: refilled along the same entries) and its combine; an overflow
    "expert_layout": [dict(expert_counts=True, expert_capacity=-1, scale_dim=2, scale_type_size=4, routing_replay=True),
                      dict(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=FP8,
                           combine_data_type=torch.bfloat16, scale_dim=HIP_H // 128, scale_type_size=1,
                           expert_counts=True, expert_capacity=-1, index_dtype=torch.int64)],
}
#: the graph-replay case: every feature above at once (bf16 rows, so the combine takes them as they are)
HIP_GRAPH_FIELDS = dict(index_dtype=torch.int64, scale_dim=2, scale_type_size=4, expert_counts=True,
                        routing_replay=True, expert_capacity=-1)
#: payload regions a dispatch writes (poisoned before each call); the sync words are left alone
_OUTPUT_REGIONS = ("disp_out", "out_wts", "out_idx", "recv_to_src", "src_to_recv", "total_recv", "comb_recv",
                   "comb_recv_wts", "out_scales", "expert_counts", "exp_x", "exp_scales", "exp_wts", "exp_maps")


def _hip_cfg(rank, ws, backend, fields):
    from mori_jit.ops.ep import EpDispatchCombineConfig

    if fields.get("expert_capacity") == -1:  # room for every pair a rank can receive
        fields = {**fields, "expert_capacity": ws * HIP_M * HIP_K}
    return EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=HIP_H, max_num_inp_token_per_rank=HIP_M,
                                   num_experts_per_rank=HIP_EPR, num_experts_per_token=HIP_K, kernel_backend=backend,
                                   **fields)


def _poison_regions(op, names):
    """Fill the op's regions ``names`` with 0xFF bytes (NaN, -1), then make sure no peer is mid-call."""
    a = op.arena
    for name in names:
        if name in a.offsets:
            a.tensor[a.offsets[name]:a.offsets[name] + a.sizes[name]].fill_(0xFF)
    torch.cuda.synchronize()
    torch.distributed.barrier()


def _identity_expert(out, dtype):
    """Byte payloads map byte value -> number (exact in bf16); others are cast."""
    return out.view(torch.uint8).to(dtype) if out.element_size() == 1 else out.to(dtype)


def _sorted_by_source(res, t):
    """Rows ``[0, total)`` of ``t`` ordered by their source token (arrival order differs by backend)."""
    total = int(res.total_recv.item())
    src = res.routing.recv_src[:total].long().to(t.device)
    return t[:total][torch.argsort(src)]


def _bytes(t):
    """Each row's bytes (``[rows, bytes per row]``; zero rows too)."""
    b = t.contiguous().view(torch.uint8)
    return b.flatten(1) if b.dim() > 1 else b.unsqueeze(1)


def _hip_parity(res, ref):
    """hip vs torch: the same received rows (bytes), weights, ids and scales per source, the same counts."""
    dev = res.out.device
    for what in ("out", "out_weights", "out_indices", "out_scales"):
        got, want = getattr(res, what), getattr(ref, what)
        assert (got is None) == (want is None), what
        if got is not None:
            assert got.dtype == want.dtype, f"{what}: {got.dtype} != {want.dtype}"
            assert torch.equal(_bytes(_sorted_by_source(res, got)), _bytes(_sorted_by_source(ref, want.to(dev)))), what
    assert (res.expert_counts is None) == (ref.expert_counts is None)
    if res.expert_counts is not None:
        assert torch.equal(res.expert_counts, ref.expert_counts.to(dev)), "expert_counts"


def _hip_call(op, ref, rank, ws, gen, n, drop, to, with_w):
    """One dispatch (+ replay, + combine) on both backends: golden checks and parity."""
    from test_ep_moe_cpu import H, _check_expert_major_combine, _received, _scales, _values

    from mori_jit.testing.golden import golden_check, make_inputs
    from mori_jit.testing.golden_moe import golden_check_experts

    assert H == HIP_H  # (_check_expert_major_combine's hidden size)
    cfg, dev = op.cfg, _hip_dev()
    x, w, idx = make_inputs(rank, n, HIP_H, HIP_K, cfg.num_experts, cfg.input_dtype, dev, gen, drop_frac=drop,
                            all_to_rank=to, world_size=ws, index_dtype=cfg.index_dtype)
    w = w if with_w else None
    s = _scales(cfg, n, gen, dev)
    _poison_regions(op, _OUTPUT_REGIONS)
    res = op.dispatch(x, w, s, idx, return_result=True)
    on = ref.device
    r = ref.dispatch(x.to(on), None if w is None else w.to(on), None if s is None else s.to(on), idx.to(on),
                     return_result=True)
    xq, sq = _received(cfg, x, s)
    wg = w if w is not None else torch.zeros(n, HIP_K, device=dev)
    golden_check(op.group, rank, ws, HIP_M, HIP_EPR, xq, wg, idx, res.out, res.out_weights, res.out_indices,
                 res.total_recv, res.routing.recv_src, None, None, scales=sq, out_scales=res.out_scales)
    if cfg.expert_counts:
        golden_check_experts(op.group, rank, ws, HIP_M, HIP_EPR, xq, w, idx, res.expert_counts, res.expert, scales=sq,
                             out=res.out, recv_src=res.routing.recv_src)
    assert (res.expert is None) == (cfg.expert_capacity == 0)
    _hip_parity(res, r)
    if cfg.expert_capacity:
        _check_expert_major_combine(op, res, _values(xq, sq, bool(cfg.dispatch_quant_type)), w, idx, rank, ws)
    if cfg.routing_replay:
        recv_src = res.routing.recv_src.clone()
        maps = [t.clone() for t in res.expert[3:]] if res.expert is not None else []
        x2, w2, _ = make_inputs(rank, n, HIP_H, HIP_K, cfg.num_experts, cfg.input_dtype, dev, gen)
        w2 = w2 if with_w else None
        s2 = _scales(cfg, n, gen, dev)
        _poison_regions(op, ("disp_out", "out_wts", "out_scales", "exp_x", "exp_scales", "exp_wts"))  # rewritten
        res = op.dispatch(x2, w2, s2, None, routing=res.routing, return_result=True)
        r = ref.dispatch(x2.to(on), None if w2 is None else w2.to(on), None if s2 is None else s2.to(on), None,
                         routing=r.routing, return_result=True)
        assert torch.equal(res.routing.recv_src, recv_src), "a replay moved rows"
        assert all(torch.equal(a, b) for a, b in zip(maps, res.expert[3:] if maps else [])), "a replay moved entries"
        x, w, s = x2, w2, s2
        xq, sq = _received(cfg, x, s)
        wg = w if w is not None else torch.zeros(n, HIP_K, device=dev)
        golden_check(op.group, rank, ws, HIP_M, HIP_EPR, xq, wg, idx, res.out, res.out_weights, res.out_indices,
                     res.total_recv, recv_src, None, None, scales=sq, out_scales=res.out_scales)
        _hip_parity(res, r)
        if cfg.expert_counts:
            golden_check_experts(op.group, rank, ws, HIP_M, HIP_EPR, xq, w, idx, res.expert_counts, res.expert,
                                 scales=sq, out=res.out, recv_src=recv_src)
        if cfg.expert_capacity:
            _check_expert_major_combine(op, res, _values(xq, sq, bool(cfg.dispatch_quant_type)), w, idx, rank, ws)
    exp = _identity_expert(res.out, cfg.combine_dtype)
    exp[int(res.total_recv.item()):].fill_(float("nan"))  # rows past total_recv must never be read
    y, y_w = op.combine(exp, weights=res.out_weights, routing=res.routing)
    golden_check(op.group, rank, ws, HIP_M, HIP_EPR, _identity_expert(xq, cfg.combine_dtype), wg, idx, exp, None,
                 None, res.total_recv, res.routing.recv_src, y, y_w)


def _hip_dev():
    return torch.device("cuda", torch.cuda.current_device())


def _hip_replay_refusals(op, rank, gen):
    """Every rank passes the same bad replay, so each raises before launching (no peer waits)."""
    from test_ep_moe_cpu import _scales

    from mori_jit.testing.golden import make_inputs

    cfg, dev = op.cfg, _hip_dev()
    x, w, idx = make_inputs(rank, 8, HIP_H, HIP_K, cfg.num_experts, cfg.input_dtype, dev, gen,
                            index_dtype=cfg.index_dtype)
    s = _scales(cfg, 8, gen, dev)
    first = op.dispatch(x, w, s, idx, return_result=True)
    with pytest.raises(ValueError, match="routing was made for 8"):
        op.dispatch(x[:7].contiguous(), w[:7].contiguous(), None if s is None else s[:7].contiguous(), None,
                    routing=first.routing)
    op.dispatch(x, w, s, idx)  # a new dispatch: the first one's routing is stale now
    with pytest.raises(ValueError, match="another op's or an earlier dispatch's"):
        op.dispatch(x, w, s, None, routing=first.routing)


def _hip_capacity_overflow(rank, ws, gen):
    """Every token of every rank names expert 0 (rank 0's), more often than its capacity holds:
    rank 0's check() raises EpCapacityError naming the expert and the count; the others do not; the
    counts stay whole and the layout holds the first entries; after reset() the op works again."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import make_inputs
    from mori_jit.ops.ep import EpCapacityError

    n, cap = 6, 4
    with EpDispatchCombineOp(_hip_cfg(rank, ws, "hip", dict(expert_counts=True, expert_capacity=cap))) as op:
        x, w, idx = make_inputs(rank, n, HIP_H, HIP_K, op.cfg.num_experts, torch.bfloat16, _hip_dev(), gen)
        idx[:, 0], idx[:, 1:] = 0, -1  # (only expert 0 receives: its count is ws * n)
        res = op.dispatch(x, w, None, idx, return_result=True)
        torch.cuda.synchronize()
        if rank == 0:
            with pytest.raises(EpCapacityError, match=f"rank 0: local expert 0 received {ws * n} .* "
                                                      f"expert_capacity={cap}"):
                op.check()
            assert int(res.expert_counts[0]) == ws * n
            assert bool((res.expert.recv_row[0] >= 0).all())  # the first cap entries are laid out
        else:
            op.check()
        op.reset()  # collective
        x, w, idx = make_inputs(rank, 1, HIP_H, HIP_K, op.cfg.num_experts, torch.bfloat16, _hip_dev(), gen)
        op.dispatch(x, w, None, idx)
        torch.cuda.synchronize()
        op.check()


def _hip_features_job(rank, ws, feature):
    from mori_jit.ops.ep import EpDispatchCombineOp

    gen = torch.Generator().manual_seed(313 + rank)
    # token counts change every call; dropped slots; every token to the last rank; nothing sent
    calls = [(HIP_M, 0.0, None, True), ([0, HIP_M - 1, 5, 17][rank % 4], 0.3, None, True),
             (HIP_M - rank % 3, 0.0, ws - 1, True), (7 + rank % 5, 0.2, None, False), (0, 0.0, None, True)]
    for fields in HIP_FEATURES[feature]:
        print(f"[rank {rank}] {feature}: {fields}", flush=True)
        with EpDispatchCombineOp(_hip_cfg(rank, ws, "hip", fields)) as op, \
                EpDispatchCombineOp(_hip_cfg(rank, ws, "torch", fields)) as ref:
            for i, call in enumerate(calls):
                try:
                    _hip_call(op, ref, rank, ws, gen, *call)
                except Exception as e:
                    raise AssertionError(f"{feature} {fields} call {i} (rank {rank} of {ws}, {call[0]} tokens): "
                                         f"{e}") from e
            if op.cfg.routing_replay:
                _hip_replay_refusals(op, rank, gen)
            op.check()
    if feature == "expert_layout":
        _hip_capacity_overflow(rank, ws, gen)


@pytest.mark.parametrize("feature", list(HIP_FEATURES))
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_moe_feature_matches_torch_and_golden(ws, feature):
    run_ep_job(_hip_features_job, ws, feature)


def _hip_graph_job(rank, ws):
    """dispatch + routing replay + combine with every feature, captured once and replayed on fresh
    inputs; the outputs (rows, scales, counts, layout, sums) are poisoned before each graph replay."""
    from test_ep_moe_cpu import _scales

    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.testing.golden import golden_check, make_inputs
    from mori_jit.testing.golden_moe import golden_check_experts

    gen = torch.Generator().manual_seed(808 + rank)
    dev = _hip_dev()
    with EpDispatchCombineOp(_hip_cfg(rank, ws, "hip", HIP_GRAPH_FIELDS)) as op:
        cfg = op.cfg

        def inputs():
            x, w, idx = make_inputs(rank, HIP_M, HIP_H, HIP_K, cfg.num_experts, cfg.input_dtype, dev, gen,
                                    drop_frac=0.2, index_dtype=cfg.index_dtype)
            return x, w, _scales(cfg, HIP_M, gen, dev), idx

        static, static2 = inputs(), inputs()

        def step():  # a dispatch, a replay of a second payload along it, the combine of the second
            first = op.dispatch(*static, return_result=True)
            x2, w2, s2, _ = static2
            res = op.dispatch(x2, w2, s2, None, routing=first.routing, return_result=True)
            y, y_w = op.combine(res.out, weights=res.out_weights, routing=res.routing)
            return res, y, y_w

        graph, (res, y, y_w) = capture(step)
        for _ in range(6):
            torch.distributed.barrier()  # peers must be done checking before the next dispatch
            for dst, src in zip(static, inputs()):
                dst.copy_(src)
            for dst, src in zip(static2[:3], inputs()[:3]):  # (the replay's ids are the dispatch's)
                dst.copy_(src)
            _poison_regions(op, _OUTPUT_REGIONS)
            y.fill_(float("nan")), y_w.fill_(float("nan"))
            graph.replay()
            (x, w, sc, _), idx = static2, static[3]
            golden_check(op.group, rank, ws, HIP_M, HIP_EPR, x, w, idx, res.out, res.out_weights, res.out_indices,
                         res.total_recv, res.routing.recv_src, y, y_w, scales=sc, out_scales=res.out_scales)
            golden_check_experts(op.group, rank, ws, HIP_M, HIP_EPR, x, w, idx, res.expert_counts, res.expert,
                                 scales=sc, out=res.out, recv_src=res.routing.recv_src)
        op.check()


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_moe_features_in_a_graph_replay(ws):
    run_ep_job(_hip_graph_job, ws)


def _hip_layer_job(rank, ws):
    """The worked MoE block on the hip backend (every payload mode) against the dense block."""
    for mode in MODES:
        print(f"[rank {rank}] MoE block, {mode}", flush=True)
        _layer_job(rank, ws, mode, "hip")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_hip_moe_block_matches_the_dense_block(ws):
    run_ep_job(_hip_layer_job, ws)
