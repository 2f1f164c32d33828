"""Gradient checks of the differentiable EP op against a dense single-process MoE (test helper).

Every rank builds the same problem from one seed: each rank's tokens (some ranks may have none), a
router ``gate [H, ws * E]`` and every expert's ``w_up [H, F]``, ``w_down [F, H]`` (float64 masters).
A layer routes its tokens (top-k of a softmax, renormalized: the weights differentiable in the
tokens and the gate), runs each expert ``f_e(v) = silu(v @ w_up[e]) @ w_down[e]`` on its tokens and
sums the weighted outputs. The EP layer does it across ranks through the op, in one of the
:data:`LAYOUTS`; the dense layer on one process, in float64, with the ids the ranks chose (so that
a near-tie cannot route the two differently). :func:`check_grads` compares the gradients of the
tokens, the gate (summed over ranks) and this rank's expert shard.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mori_jit.ops.ep import train

__all__ = ["Problem", "LAYOUTS", "Case", "route", "dense_layer", "ep_layer", "check_grads", "rel_err", "run_case",
           "cases_job"]

#: how the EP layer lays out the experts' work: per received row (the op's methods), the
#: expert-major layout (the op's methods), the packed layout with grouped GEMMs (the functional API)
LAYOUTS = ("rows", "expert_major", "packed")


@dataclasses.dataclass
class Problem:
    """One gradient check's sizes and data, the same on every rank (built from ``seed``)."""

    ws: int
    seed: int
    tokens: list  # tokens per rank
    H: int = 16
    F: int = 8
    E: int = 3  # experts per rank
    k: int = 2

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        n_exp = self.ws * self.E
        self.x = [torch.randn(n, self.H, generator=g, dtype=torch.float64) for n in self.tokens]
        self.cot = [torch.randn(n, self.H, generator=g, dtype=torch.float64) for n in self.tokens]
        self.gate = torch.randn(self.H, n_exp, generator=g, dtype=torch.float64)
        self.w_up = torch.randn(n_exp, self.H, self.F, generator=g, dtype=torch.float64) / self.H ** 0.5
        self.w_down = torch.randn(n_exp, self.F, self.H, generator=g, dtype=torch.float64) / self.F ** 0.5


def route(h: torch.Tensor, gate: torch.Tensor, k: int, ids: Optional[torch.Tensor] = None):
    """``(weights [n, k], ids [n, k] int64)``: the top-k of ``softmax(h @ gate)`` renormalized (``ids``
    given: those experts' weights). Differentiable in ``h`` and ``gate``."""
    probs = torch.softmax(h @ gate.to(h.dtype), dim=-1)
    if ids is None:
        ids = probs.detach().topk(k, dim=-1).indices
    w = probs.gather(1, ids)
    return w / w.sum(-1, keepdim=True), ids


def _expert(v, up, down):
    return torch.nn.functional.silu(v @ up) @ down


def dense_layer(h, gate, w_up, w_down, ids, seen: Optional[Callable] = None):
    """The MoE layer on one process over every expert: ``sum_j w[t, j] * f_{ids[t, j]}(v[t])`` where
    ``v = seen(h)`` is what an expert sees (the rows after the wire's rounding; the gradient passes
    straight through it), ``h`` without ``seen``."""
    w, _ = route(h, gate, ids.shape[1], ids)
    v = h if seen is None else h + (seen(h.detach()) - h.detach())
    y = torch.zeros_like(h)
    for e in range(w_up.shape[0]):
        coef = (w * (ids == e)).sum(1, keepdim=True)
        y = y + coef * _expert(v, w_up[e], w_down[e])
    return y


def ep_layer(op, layout: str, h, gate, up, down, ids, alignment: int = 4, on_grad: Optional[Callable] = None):
    """The MoE layer on this rank's tokens ``h`` through ``op`` (experts ``up``/``down``: this rank's
    shard), experts in float32, the legs in the op's dtypes. Returns ``[n, H]`` in ``h``'s dtype.
    ``on_grad``: a hook on the dispatch's input (it sees the gradient dispatch's backward returns)."""
    cfg, r = op.cfg, op.cfg.rank
    E, dt = cfg.num_experts_per_rank, cfg.combine_dtype
    w, _ = route(h.float(), gate, cfg.num_experts_per_token, ids)
    ids = ids.to(cfg.index_dtype)
    x = h.to(cfg.input_dtype)
    if on_grad is not None and x.requires_grad:
        x.register_hook(on_grad)
    if layout == "rows":
        out, out_w, _, out_idx, _, routing = op.dispatch(x, w.to(torch.bfloat16) if dt == torch.bfloat16 else w,
                                                         None, ids, return_routing=True)
        rows = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
        for e in range(E):
            coef = (out_w * (out_idx == r * E + e)).sum(1, keepdim=True)
            rows = rows + coef * _expert(out.float(), up[e], down[e])
        y, _ = op.combine(rows.to(dt), routing=routing)
    elif layout == "expert_major":
        res = op.dispatch(x, w, None, ids, return_result=True)
        lay = res.expert
        outs = torch.stack([_expert(lay.x[e].float(), up[e], down[e]) for e in range(E)])
        y = op.combine_expert_major((outs * lay.weights.unsqueeze(-1)).to(dt), routing=res.routing)
    elif layout == "packed":
        h_ = train.register(op)
        d = train.dispatch(h_, x, w, ids)
        p = train.pack(d, r, E, alignment)
        # each group through its expert (float32; tests/test_ep_packed_cpu.py runs torch._grouped_mm on it)
        group = torch.bucketize(torch.arange(p.row.shape[0], device=p.row.device), p.offsets, right=True)
        yp = torch.zeros(p.x.shape, dtype=torch.float32, device=p.x.device)
        for e in range(E):
            yp = torch.where((group == e).unsqueeze(1), _expert(p.x.float(), up[e], down[e]), yp)
        y = train.combine_packed(h_, (p.mask(yp) * p.weights.unsqueeze(1)).to(dt), p, d)
    else:
        raise ValueError(f"layout: {layout!r}; allowed {LAYOUTS}")
    return y.to(h.dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms, float64); 0 when both are empty or zero."""
    a, b = a.double(), b.double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def check_grads(rank: int, p: Problem, model: Callable, dense: Callable, tol: float, what: str,
                device=None) -> None:
    """Run ``model(x, gate, up, down, ids_log)`` (this rank's tokens, float32 leaves on ``device``; ``ids_log`` a list
    the model appends each layer's ids to), backward of ``sum(y * cot)``, and compare every gradient
    with ``dense(X, gate, w_up, w_down, ids_per_layer)`` (float64, every rank's tokens in rank order,
    ``ids_per_layer[l]`` the ranks' ids of layer l concatenated), relative error ``<= tol``."""
    E = p.E
    mine = slice(rank * E, (rank + 1) * E)
    leaf = lambda t: t.to(device=device, dtype=torch.float32).requires_grad_()  # noqa: E731
    x, gate, up, down = leaf(p.x[rank]), leaf(p.gate), leaf(p.w_up[mine]), leaf(p.w_down[mine])
    log: list = []
    y = model(x, gate, up, down, log)
    (y.double() * p.cot[rank].to(y.device)).sum().backward()
    layers: list = [None] * p.ws
    dist.all_gather_object(layers, [ids.cpu() for ids in log])
    ids_per_layer = [torch.cat([layers[r][i] for r in range(p.ws)]) for i in range(len(log))]
    X = torch.cat(p.x).requires_grad_()
    G, U, D = (t.clone().requires_grad_() for t in (p.gate, p.w_up, p.w_down))
    Y = dense(X, G, U, D, ids_per_layer)
    (Y * torch.cat(p.cot)).sum().backward()
    gate_sum = gate.grad.clone() if dist.get_backend() == "nccl" else gate.grad.cpu()
    dist.all_reduce(gate_sum)
    start = sum(p.tokens[:rank])
    gx = x.grad if x.grad is not None else torch.zeros_like(x)  # (a rank without tokens)
    got = {"x": (gx, X.grad[start:start + p.tokens[rank]]), "gate": (gate_sum, G.grad),
           "w_up": (up.grad, U.grad[mine]), "w_down": (down.grad, D.grad[mine]),
           "y": (y.detach(), Y.detach()[start:start + p.tokens[rank]])}
    bad = {name: rel_err(a.cpu(), b) for name, (a, b) in got.items() if rel_err(a.cpu(), b) > tol}
    assert not bad, f"{what} (seed {p.seed}) rank {rank}: relative errors above {tol}: {bad}"


@dataclasses.dataclass(frozen=True)
class Case:
    """A model of ``len(layouts)`` residual MoE layers (one layout each) sharing one op and one set of
    parameters; its gradient check's options."""

    layouts: tuple = ("rows",)
    dtype: torch.dtype = torch.float32  # both legs (bf16: "bf16 transport")
    index_dtype: torch.dtype = torch.int64
    replay: bool = False  # cfg.routing_replay (combine's backward replays while the routing is the latest)
    checkpoint: bool = False  # each layer under torch.utils.checkpoint (non-reentrant)
    fp8: bool = False  # dispatch_quant_type fp8 block-128 forward, bf16 combine, a bf16 gradient op
    backend: str = "torch"

    @property
    def tol(self) -> float:
        """fp32 legs: 1e-4; bf16 or fp8 legs: 3e-2 (relative, Frobenius)."""
        return 1e-4 if self.dtype == torch.float32 and not self.fp8 else 3e-2


def _configs(rank: int, ws: int, p: Problem, case: Case, M: int):
    from mori_jit.ops.ep import EpDispatchCombineConfig

    base = dict(rank=rank, world_size=ws, hidden_dim=p.H, max_num_inp_token_per_rank=M, num_experts_per_rank=p.E,
                num_experts_per_token=p.k, index_dtype=case.index_dtype, kernel_backend=case.backend,
                expert_counts=True, expert_capacity=ws * M * p.k if "expert_major" in case.layouts else 0)
    if not case.fp8:
        return EpDispatchCombineConfig(data_type=case.dtype, routing_replay=case.replay, **base), None
    fp8 = EpDispatchCombineConfig(dispatch_quant_type="fp8_e4m3_block128", dispatch_data_type=torch.float8_e4m3fn,
                                  combine_data_type=torch.bfloat16, scale_dim=p.H // 128, scale_type_size=4,
                                  routing_replay=case.replay, **base)
    return fp8, EpDispatchCombineConfig(data_type=torch.bfloat16, routing_replay=case.replay, **base)


def _fp8_seen(h: torch.Tensor) -> torch.Tensor:
    from mori_jit.testing.golden_moe import golden_quantize

    q, s = golden_quantize(h.to(torch.bfloat16), 4)
    n, H = q.shape
    return (q.double().reshape(n, H // 128, 128) * s.double().unsqueeze(2)).reshape(n, H).to(torch.bfloat16).double()


def run_case(rank: int, ws: int, seed: int, case: Case, tokens: list, M: int = 8) -> None:
    """One gradient check of ``case`` on this rank (collective)."""
    from mori_jit.ops.ep import EpDispatchCombineOp
    from mori_jit.ops.ep.train.registry import entry

    p = Problem(ws, seed, tokens, H=128 if case.fp8 else 16)
    cfg, gcfg = _configs(rank, ws, p, case, M)
    with EpDispatchCombineOp(cfg) as op:
        gop = EpDispatchCombineOp(gcfg) if gcfg is not None else None
        handle = train.register(op, gradient_op=gop)
        grad_dtypes: list = []

        def model(x, gate, up, down, log):
            h = x
            for layer, layout in enumerate(case.layouts):
                def block(h, layer=layer, layout=layout):
                    _, ids = route(h.detach(), gate, p.k)
                    if len(log) == layer:  # (a checkpoint's recompute routes again, alike)
                        log.append(ids)
                    return h + ep_layer(op, layout, h, gate, up, down, ids,
                                        on_grad=lambda g: grad_dtypes.append(g.dtype))
                if case.checkpoint:
                    h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
                else:
                    h = block(h)
            return h

        def dense(X, G, U, D, ids_per_layer):
            h = X
            for ids in ids_per_layer:
                seen = _fp8_seen if case.fp8 else (lambda v: v.to(torch.bfloat16).double()) \
                    if case.dtype == torch.bfloat16 else None
                h = h + dense_layer(h, G, U, D, ids, seen)
            return h

        try:
            check_grads(rank, p, model, dense, case.tol, f"{case} tokens {tokens}", device=op.device)
            # the gradient reaching each dispatch's input is in that input's dtype (bf16 behind fp8)
            assert grad_dtypes and set(grad_dtypes) == {cfg.input_dtype}, (grad_dtypes, cfg.input_dtype)
            rerouted = entry(handle).reroute
            if case.fp8:  # combine's backward rode the bf16 gradient op
                assert rerouted is not None and rerouted.op is gop
            elif not case.replay:  # combine's backward re-routes without a replay
                assert rerouted is not None
            elif len(case.layouts) == 1 or case.checkpoint:  # each backward found its routing the latest
                assert rerouted is None, "a backward re-routed although its routing was the latest"
        finally:
            if gop is not None:
                gop.close()


def cases_job(rank: int, ws: int, seed: int, cases: list, tokens: list) -> None:
    """:func:`run_case` for each case, in one process (a job for ``run_distributed``)."""
    for case in cases:
        run_case(rank, ws, seed, case, tokens[:ws])
