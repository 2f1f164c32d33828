"""Independent golden checks of the MoE outputs (docs/design.md §6, "MoE outputs"): block fp8
quantization, local expert counts and the expert-major layout.

Like :mod:`.golden`, everything is recomputed from the *inputs of every rank* (gathered) and nothing
calls the implementation under test (neither ``quant.py`` nor ``reference*.py``). The layout check
fixes no order among an expert's entries (a kernel places them by atomics): it compares, per local
expert, the set of (source token, top-k slot) pairs with the one the inputs imply, then each
entry's row, scales and weight with its source's.
"""
from __future__ import annotations

import torch

from mori_jit.testing.golden import _all_gather, _bytes2d, _fail, _gather_padded

__all__ = ["golden_quantize", "golden_check_experts"]


def golden_quantize(x: torch.Tensor, scale_type_size: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's ``per_token_cast_to_fp8`` written out: ``(q [n, H] float8_e4m3fn, scales [n, H/block])``.

    ``amax = max(|x| per block, 1e-4)``, ``sf = amax / 448`` as torch on CUDA computes it (times
    the float32 reciprocal of 448, on any device), UE8M0 (``scale_type_size=1``):
    ``sf = 2 ** ceil(log2 sf)`` stored as the byte ``log2(sf) + 127``; ``q = e4m3(x * (1 / sf))``.
    """
    n, H = x.shape
    view = x.float().reshape(n, H // block, block)
    inv448 = torch.tensor(1.0, dtype=torch.float32, device=x.device) / torch.tensor(448.0, dtype=torch.float32,
                                                                                     device=x.device)
    sf = view.abs().amax(dim=2).clamp(min=1e-4) * inv448
    if scale_type_size == 1:
        mantissa, exponent = torch.frexp(sf)  # sf = mantissa * 2**exponent, mantissa in [0.5, 1)
        log2_ceil = torch.where(mantissa == 0.5, exponent - 1, exponent)
        sf = torch.pow(2.0, log2_ceil.double()).float()
        scales = (log2_ceil + 127).to(torch.uint8)
        scales = scales.view(getattr(torch, "float8_e8m0fnu", torch.uint8))
    else:
        scales = sf
    q = (view * (1.0 / sf)[:, :, None]).to(torch.float8_e4m3fn).reshape(n, H)
    return q, scales


def golden_check_experts(group, rank: int, world_size: int, max_tokens_per_rank: int, num_experts_per_rank: int,
                         x: torch.Tensor, weights: torch.Tensor | None, indices: torch.Tensor,
                         counts: torch.Tensor, layout, *, scales: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, recv_src: torch.Tensor | None = None, masked=()) -> None:
    """Check one rank's expert counts and (``layout`` not None) expert-major layout.

    Collective (gathers every rank's ``x``/``weights``/``indices``/``scales``; every rank passes the
    same choices of None). ``x`` and ``scales`` are what the receiver must get (under in-op
    quantization: :func:`golden_quantize` of the input). ``out``/``recv_src`` (the receive rows
    and their sources), if given, must agree with the layout's ``recv_row`` map. ``masked``: as
    :func:`.golden.golden_check`'s (the survivors' group; a masked rank passes no tokens).

    Raises:
        AssertionError naming the rank, the expert, the entry and what differs.
    """
    M, ws, E = max_tokens_per_rank, world_size, num_experts_per_rank
    n, k, device = x.shape[0], indices.shape[1], x.device
    all_n = [int(v.item()) for v in _all_gather(group, ws, torch.tensor([n], device=device), masked)]
    all_x = _gather_padded(group, ws, M, x, masked).reshape(ws * M, -1)
    all_w = None if weights is None else _gather_padded(group, ws, M, weights.float(), masked).reshape(
        ws * M, -1).view(torch.float32)
    all_i = _gather_padded(group, ws, M, indices.to(torch.int64), masked).reshape(ws * M, -1).view(torch.int64)
    all_s = None if scales is None else _gather_padded(group, ws, M, scales, masked).reshape(ws * M, -1)

    # ---- expected (source, slot) pairs of each local expert -------------------------------------
    exist = torch.zeros(ws * M, dtype=torch.bool, device=device)
    for s in range(ws):
        exist[s * M: s * M + all_n[s]] = True
    mine = exist[:, None] & (all_i >= rank * E) & (all_i < (rank + 1) * E)  # [ws*M, k]
    src_of, slot_of = mine.nonzero(as_tuple=True)
    expert_of = all_i[src_of, slot_of] - rank * E
    want_counts = torch.zeros(E, dtype=torch.int64, device=device).index_add_(0, expert_of, torch.ones_like(expert_of))
    if counts.dtype != torch.int32 or tuple(counts.shape) != (E,):
        _fail(rank, f"expert_counts must be int32 [{E}], got {counts.dtype} {list(counts.shape)}")
    if not torch.equal(counts.long(), want_counts):
        e = int((counts.long() != want_counts).nonzero()[0, 0])
        _fail(rank, f"expert_counts[{e}] = {int(counts[e])}, expected {int(want_counts[e])} (token, expert) pairs "
                    f"from all ranks' routing; counts {counts.tolist()} expected {want_counts.tolist()}")
    if layout is None:
        return

    C = layout.recv_row.shape[1]
    for name in ("recv_row", "src", "slot"):
        t = getattr(layout, name)
        if t.dtype != torch.int32 or tuple(t.shape) != (E, C):
            _fail(rank, f"layout.{name} must be int32 [{E}, {C}], got {t.dtype} {list(t.shape)}")
    valid = torch.arange(C, device=device)[None, :] < want_counts[:, None]  # [E, C]
    for name in ("recv_row", "src", "slot"):
        pad = getattr(layout, name)[~valid]
        if bool((pad != -1).any()):
            e, c = (int(v) for v in ((getattr(layout, name) != -1) & ~valid).nonzero()[0])
            _fail(rank, f"layout.{name}[{e}, {c}] = {int(getattr(layout, name)[e, c])} is padding "
                        f"(expert {e} has {int(want_counts[e])} entries) and must be -1")

    # ---- the same (source, slot) set per expert, as sorted keys expert*ws*M*k + src*k + slot -------
    e_idx, c_idx = valid.nonzero(as_tuple=True)
    src = layout.src[e_idx, c_idx].long()
    slot = layout.slot[e_idx, c_idx].long()
    bad = (src < 0) | (src >= ws * M) | (slot < 0) | (slot >= k)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        _fail(rank, f"layout entry ({int(e_idx[i])}, {int(c_idx[i])}): src {int(src[i])} / slot {int(slot[i])} "
                    f"out of range")
    got_keys = (e_idx * ws * M + src) * k + slot
    want_keys = (expert_of * ws * M + src_of) * k + slot_of
    if not torch.equal(got_keys.sort().values, want_keys.sort().values):
        missing = want_keys[~torch.isin(want_keys, got_keys)]
        extra = got_keys[~torch.isin(got_keys, want_keys)]
        what = []
        for label, keys in (("missing", missing), ("unexpected", extra)):
            if keys.numel():
                v = int(keys[0])
                s = v // k % (ws * M)
                what.append(f"{keys.numel()} {label}, first expert {v // k // (ws * M)} rank {s // M} token {s % M} "
                            f"slot {v % k}")
        _fail(rank, "layout entries differ from all ranks' routing: " + "; ".join(what or ["duplicates"]))

    # ---- each entry's payload is its source's --------------------------------------------------------
    got_x = _bytes2d(layout.x.reshape(E * C, -1))[e_idx * C + c_idx]
    if not torch.equal(got_x, all_x[src]):
        i = int((got_x != all_x[src]).any(dim=1).nonzero()[0, 0])
        _fail(rank, f"layout.x[{int(e_idx[i])}, {int(c_idx[i])}] differs from its source row (rank "
                    f"{int(src[i]) // M} token {int(src[i]) % M})")
    if all_s is not None:
        got_s = _bytes2d(layout.scales.reshape(E * C, -1))[e_idx * C + c_idx]
        if not torch.equal(got_s, all_s[src]):
            i = int((got_s != all_s[src]).any(dim=1).nonzero()[0, 0])
            _fail(rank, f"layout.scales[{int(e_idx[i])}, {int(c_idx[i])}] differ from the source's scales")
    if all_w is not None:
        got_w, want_w = layout.weights[e_idx, c_idx], all_w[src, slot]
        if not torch.equal(got_w, want_w):
            i = int((got_w != want_w).nonzero()[0, 0])
            _fail(rank, f"layout.weights[{int(e_idx[i])}, {int(c_idx[i])}] = {float(got_w[i])}, expected the "
                        f"source's slot-{int(slot[i])} weight {float(want_w[i])}")
        if bool((layout.weights[~valid] != 0).any()):
            _fail(rank, "layout.weights must be 0 on padding entries")
    if out is not None:
        rows = layout.recv_row[e_idx, c_idx].long()
        if bool(((rows < 0) | (rows >= out.shape[0])).any()):
            i = int(((rows < 0) | (rows >= out.shape[0])).nonzero()[0, 0])
            _fail(rank, f"layout.recv_row[{int(e_idx[i])}, {int(c_idx[i])}] = {int(rows[i])} is outside the "
                        f"{out.shape[0]} receive rows")
        bad_x = (_bytes2d(out)[rows] != got_x).any(dim=1)
        bad_src = recv_src.long()[rows] != src
        if bool((bad_x | bad_src).any()):
            i = int((bad_x | bad_src).nonzero()[0, 0])
            _fail(rank, f"layout.recv_row does not point at the receive row of each entry's source token: "
                        f"{int(bad_x.sum())} entries' rows and {int(bad_src.sum())} entries' sources differ, "
                        f"first entry ({int(e_idx[i])}, {int(c_idx[i])}) -> row {int(rows[i])}, whose source is "
                        f"{int(recv_src[rows[i]])} (the entry's: {int(src[i])})")
