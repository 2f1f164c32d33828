"""A small MoE transformer trained with expert parallelism on the EP op, and the same model trained
densely on one process: the worked training example (``scripts/train_moe_ep.py`` runs and compares
them).

The model: token embedding, ``layers`` blocks of (RMSNorm, causal self-attention, residual, RMSNorm,
top-k MoE feed-forward, residual), a final RMSNorm and an LM head. Each expert is
``f_e(v) = silu(v @ up[e]) @ down[e]``; the router's top-k weights are renormalized to sum 1.

Data parallel over sequences, expert parallel over experts: each step every rank takes its share of
the global batch (the same sequences the dense run takes whole), holds every parameter but the
experts (replicated: their gradients are summed over the ranks) and its ``experts / world_size``
experts (their gradients arrive whole through the op's backward: every token that reached them, from
every rank). The loss is the mean next-token cross entropy over the global batch. Adam, fp32.

Data: sequences of a fixed random Markov chain (each token has a few likely successors), drawn from a
seed per (step, sequence): the loss falls from ``ln(vocab)`` towards the chain's entropy.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["TinyConfig", "init_params", "batch", "route", "forward", "dense_moe", "EpMoe", "train_dense", "train_ep_job",
           "max_gap"]


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """The model, the data and the optimizer; the same for the dense and the EP run."""

    vocab: int = 48
    hidden: int = 32
    heads: int = 2
    layers: int = 2
    seq: int = 16
    batch: int = 8  # sequences per step, over all ranks
    experts: int = 8  # over all ranks
    top_k: int = 2
    ffn: int = 32
    lr: float = 3e-3
    seed: int = 0
    layout: str = "packed"  # the EP layers' layout: packed, rows or expert_major
    alignment: int = 4  # the packed layout's expert alignment


def init_params(cfg: TinyConfig) -> dict[str, torch.Tensor]:
    """Every parameter (all experts), float32, from ``cfg.seed``."""
    g = torch.Generator().manual_seed(cfg.seed)
    H, X, Fh = cfg.hidden, cfg.experts, cfg.ffn
    p = {"emb": torch.randn(cfg.vocab, H, generator=g) * 0.5, "lnf": torch.ones(H),
         "head": torch.randn(H, cfg.vocab, generator=g) / H ** 0.5}
    for i in range(cfg.layers):
        p.update({f"{i}.ln1": torch.ones(H), f"{i}.ln2": torch.ones(H),
                  f"{i}.qkv": torch.randn(H, 3 * H, generator=g) / H ** 0.5,
                  f"{i}.wo": torch.randn(H, H, generator=g) / H ** 0.5,
                  f"{i}.gate": torch.randn(H, X, generator=g) / H ** 0.5,
                  f"{i}.up": torch.randn(X, H, Fh, generator=g) / H ** 0.5,
                  f"{i}.down": torch.randn(X, Fh, H, generator=g) / Fh ** 0.5})
    return p


def batch(cfg: TinyConfig, step: int, first: int, count: int) -> torch.Tensor:
    """Sequences ``first ... first + count - 1`` of ``step``'s global batch: int64 ``[count, seq + 1]``."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    logits = torch.randn(cfg.vocab, cfg.vocab, generator=g) * 3  # the chain: a few likely successors per token
    probs = torch.softmax(logits, -1)
    out = torch.empty(count, cfg.seq + 1, dtype=torch.int64)
    for s in range(count):
        gs = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + first + s)
        tok = torch.randint(cfg.vocab, (1,), generator=gs)
        for t in range(cfg.seq + 1):
            out[s, t] = tok
            tok = torch.multinomial(probs[tok], 1, generator=gs).reshape(1)
    return out


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _attention(h: torch.Tensor, qkv: torch.Tensor, wo: torch.Tensor, heads: int) -> torch.Tensor:
    B, T, H = h.shape
    q, k, v = (h @ qkv).reshape(B, T, 3, heads, H // heads).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(1, 2).reshape(B, T, H) @ wo


def route(x: torch.Tensor, gate: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [n, k], ids [n, k] int64)``: top-k of the router's softmax, renormalized."""
    probs = torch.softmax(x @ gate, -1)
    w, ids = probs.topk(k, -1)
    return w / w.sum(-1, keepdim=True), ids


def _expert(v, up, down):
    return F.silu(v @ up) @ down


def dense_moe(p: dict, layer: int, x: torch.Tensor, k: int) -> torch.Tensor:
    """The MoE feed-forward on one process over every expert: ``[n, H]``."""
    w, ids = route(x, p[f"{layer}.gate"], k)
    up, down = p[f"{layer}.up"], p[f"{layer}.down"]
    y = torch.zeros_like(x)
    for e in range(up.shape[0]):
        coef = (w * (ids == e)).sum(-1, keepdim=True)
        y = y + coef * _expert(x, up[e], down[e])
    return y


def forward(cfg: TinyConfig, p: dict, tokens: torch.Tensor, moe: Callable) -> torch.Tensor:
    """The summed next-token cross entropy of ``tokens [B, seq + 1]``; ``moe(layer, x [n, H])``."""
    x = p["emb"][tokens[:, :-1]]
    B, T, H = x.shape
    for i in range(cfg.layers):
        x = x + _attention(_rms(x, p[f"{i}.ln1"]), p[f"{i}.qkv"], p[f"{i}.wo"], cfg.heads)
        x = x + moe(i, _rms(x, p[f"{i}.ln2"]).reshape(B * T, H)).reshape(B, T, H)
    logits = _rms(x, p["lnf"]) @ p["head"]
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1), reduction="sum")


class EpMoe:
    """The MoE feed-forward on this rank's tokens through the op (its handle), on this rank's experts
    ``p[f"{layer}.up"]``/``down`` (``[E, ...]``, E = experts per rank), in the layout of ``cfg.layout``."""

    def __init__(self, cfg: TinyConfig, op, p: dict):
        from mori_jit.ops.ep import train

        self.cfg, self.op, self.p, self.train = cfg, op, p, train
        self.handle = train.register(op)
        self.rank, self.E = op.cfg.rank, op.cfg.num_experts_per_rank

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``[n, H]``: the layer's MoE output for this rank's tokens ``x [n, H]`` (collective)."""
        cfg, train, E, r = self.cfg, self.train, self.E, self.rank
        up, down = self.p[f"{layer}.up"], self.p[f"{layer}.down"]
        w, ids = route(x, self.p[f"{layer}.gate"], cfg.top_k)
        d = train.dispatch(self.handle, x, w, ids)
        if cfg.layout == "rows":
            rows = torch.zeros_like(d.out)
            for e in range(E):
                coef = (d.weights * (d.indices == r * E + e)).sum(-1, keepdim=True)
                rows = rows + coef * _expert(d.out, up[e], down[e])
            return train.combine(self.handle, rows, d)[0]
        if cfg.layout == "expert_major":
            lay = d.expert
            out = torch.stack([_expert(lay.x[e], up[e], down[e]) for e in range(E)])
            return train.combine_expert_major(self.handle, out * lay.weights.unsqueeze(-1), d)
        lay = train.pack(d, r, E, cfg.alignment)
        group = torch.bucketize(torch.arange(lay.row.shape[0], device=lay.row.device), lay.offsets, right=True)
        y = torch.zeros_like(lay.x)
        for e in range(E):  # (in float32, exactly; torch._grouped_mm(lay.x, up, offs=lay.offsets) in bf16)
            y = torch.where((group == e).unsqueeze(1), _expert(lay.x, up[e], down[e]), y)
        return train.combine_packed(self.handle, lay.mask(y) * lay.weights.unsqueeze(1), lay, d)


def train_dense(cfg: TinyConfig, steps: int) -> list[float]:
    """The model trained on one process, every expert local: the mean loss of each step."""
    p = {n: t.clone().requires_grad_() for n, t in init_params(cfg).items()}
    opt = torch.optim.Adam(p.values(), lr=cfg.lr)
    losses = []
    for step in range(steps):
        tokens = batch(cfg, step, 0, cfg.batch)
        loss = forward(cfg, p, tokens, lambda i, x: dense_moe(p, i, x, cfg.top_k)) / tokens[:, 1:].numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_ep_job(rank: int, ws: int, cfg: TinyConfig, steps: int, out_path: str, backend: str = "torch") -> None:
    """The model trained on ``ws`` ranks through the EP op (a ``run_distributed`` job): rank 0 writes
    each step's mean loss over the global batch to ``out_path`` (JSON)."""
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

    if cfg.batch % ws or cfg.experts % ws:
        raise ValueError(f"batch {cfg.batch} and experts {cfg.experts} must divide by world_size {ws}")
    local, E = cfg.batch // ws, cfg.experts // ws
    M = local * cfg.seq
    ep = EpDispatchCombineConfig(rank=rank, world_size=ws, hidden_dim=cfg.hidden, max_num_inp_token_per_rank=M,
                                 num_experts_per_rank=E, num_experts_per_token=cfg.top_k, data_type=torch.float32,
                                 index_dtype=torch.int64, kernel_backend=backend, expert_counts=True,
                                 expert_capacity=ws * M if cfg.layout == "expert_major" else 0)
    mine = slice(rank * E, (rank + 1) * E)
    losses = []
    with EpDispatchCombineOp(ep) as op:
        full = init_params(cfg)
        p = {n: (t[mine] if n.endswith((".up", ".down")) else t).to(op.device).clone().requires_grad_()
             for n, t in full.items()}
        shared = [t for n, t in p.items() if not n.endswith((".up", ".down"))]
        opt = torch.optim.Adam(p.values(), lr=cfg.lr)
        moe = EpMoe(cfg, op, p)
        for step in range(steps):
            tokens = batch(cfg, step, rank * local, local).to(op.device)
            loss = forward(cfg, p, tokens, moe) / (cfg.batch * cfg.seq)
            opt.zero_grad()
            loss.backward()
            for t in shared:  # replicated parameters: every rank's share of the gradient
                dist.all_reduce(t.grad)
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)


def max_gap(a: list[float], b: list[float]) -> float:
    """The largest ``|a[i] - b[i]|`` (inf when the lengths differ or a value is not finite)."""
    if len(a) != len(b) or not all(math.isfinite(v) for v in a + b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
