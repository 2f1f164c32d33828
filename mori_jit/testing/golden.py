"""Independent golden check of an EP dispatch/combine result (docs/design.md §6).

The check recomputes everything from the *inputs of every rank* (gathered with ``all_gather``)
and never calls the implementation under test (nor ``reference.py``): with an identity expert,

* ``total_recv`` equals the number of (srcRank, srcTok) pairs on all ranks with this rank among
  their destinations, and ``recv_src[0:total_recv]`` is exactly that set, without duplicates;
* every received row ``out[i]`` equals the source row bit for bit, and ``out_weights[i]`` /
  ``out_indices[i]`` equal the source's weights / indices (and ``out_scales`` its scales);
* ``y[t] == U[t] * x[t]`` and ``y_w[t] == U[t] * weights[t]``, ``U[t]`` = number of distinct valid
  destination ranks of token t.

With ``masked`` ranks (the op's rank masking), the same check with those ranks' experts removed: a
masked rank's ids count as invalid for the routing (they still travel in the rows' ids), it passes
no tokens, and ``group`` is the survivors' (its ranks are the live ones, ascending).

It works with any process group (gloo gathers raw bytes, so bf16/fp8 are fine) and any device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# (the checks' inputs live in .inputs; their callers import them from here too)
from mori_jit.testing.inputs import experts_per_rank_at, make_inputs

__all__ = ["golden_check", "make_inputs", "experts_per_rank_at", "default_tolerance", "live_of", "masked_pairs"]


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for comparing a combine output of ``dtype`` with the float32 expectation.

    The implementation sums in float32 and rounds once to ``dtype``, so the error is about one
    rounding of the output dtype.
    """
    if dtype == torch.bfloat16:
        return 1e-2, 1e-2
    if dtype == torch.float16:
        return 1e-3, 1e-3
    if dtype == torch.float64:
        return 1e-9, 1e-9
    return 1e-6, 1e-5


def _bytes2d(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a 2-D tensor, one uint8 row per tensor row."""
    rows, cols = t.shape
    if t.numel() == 0:  # empty tensors may carry stride 0, which a dtype view rejects
        return torch.empty((rows, cols * t.element_size()), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(rows, cols * t.element_size())


def live_of(world_size: int, masked=()) -> tuple[int, ...]:
    """The ranks of ``range(world_size)`` not in ``masked``."""
    return tuple(r for r in range(world_size) if r not in set(masked))


def masked_pairs(indices: torch.Tensor, world_size: int, epr: int, masked=()) -> int:
    """How many (token, expert) pairs of ``indices`` name a valid expert of a ``masked`` rank."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < epr * world_size)
    dest = idx.div(epr, rounding_mode="floor")
    return int((valid & torch.isin(dest, torch.tensor(list(masked), dtype=torch.int64, device=idx.device))).sum())


def _all_gather(group, world_size: int, t: torch.Tensor, masked=()) -> list[torch.Tensor]:
    """``all_gather`` of ``t`` on ``t``'s device; through the host where the group is gloo (whose
    gather takes host tensors), e.g. ranks that share a GPU. A ``masked`` rank is not in ``group``
    (the survivors'): its part is zeros."""
    via = t.cpu() if dist.get_backend(group) == "gloo" else t
    live = live_of(world_size, masked)
    parts = [torch.zeros_like(via) for _ in range(world_size)]
    dist.all_gather([parts[r] for r in live], via, group=group)
    return [p.to(t.device) for p in parts]


def _gather_padded(group, world_size: int, rows_max: int, t: torch.Tensor, masked=()) -> torch.Tensor:
    """all_gather ``t [n <= rows_max, C]`` from every rank as bytes; returns uint8 ``[ws, rows_max, C*es]``."""
    b = _bytes2d(t)
    pad = torch.zeros(rows_max, b.shape[1], dtype=torch.uint8, device=t.device)
    pad[: b.shape[0]] = b
    return torch.stack(_all_gather(group, world_size, pad, masked))


def _as_dtype(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret bytes ``[..., C*es]`` as ``dtype`` ``[..., C]``."""
    return b.contiguous().view(dtype)


def _dest_hits(idx: torch.Tensor, rank: int, world_size: int, epr: int, masked=()) -> torch.Tensor:
    """bool ``[rows]``: does any valid slot of each token have an expert on ``rank`` (none on a
    ``masked`` rank: its experts are removed)?"""
    if rank in masked:
        return torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    idx = idx.long()
    valid = (idx >= 0) & (idx < epr * world_size)
    return (valid & (idx.div(epr, rounding_mode="floor") == rank)).any(dim=1)


def _fmt_row(t: torch.Tensor, limit: int = 8) -> str:
    """Short printable form of a row (first ``limit`` values)."""
    vals = t.flatten()[:limit]
    if vals.dtype.is_floating_point and vals.dtype.itemsize == 1:
        vals = vals.float()  # fp8 prints poorly; show the decoded numbers
    return str(vals.tolist()) + (" ..." if t.numel() > limit else "")


def _fail(rank: int, msg: str) -> None:
    raise AssertionError(f"golden_check rank {rank}: {msg}")


def _check_rows_bitwise(rank, what, got_b, want_b, src, M, dtype, cols):
    """Assert byte rows equal; on mismatch name the row, its source and the first differing column."""
    if got_b.shape != want_b.shape:
        _fail(rank, f"{what}: shape {tuple(got_b.shape)} != expected {tuple(want_b.shape)}")
    bad = (got_b != want_b).any(dim=1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        s = int(src[i])
        got = _as_dtype(got_b[i : i + 1], dtype).reshape(cols)
        want = _as_dtype(want_b[i : i + 1], dtype).reshape(cols)
        esz = torch.empty((), dtype=dtype).element_size()
        col = int((got_b[i] != want_b[i]).nonzero()[0, 0]) // esz
        _fail(rank, f"{what} row {i} (from rank {s // M} token {s % M}) differs from the source "
                    f"({int(bad.sum())} bad rows); first at column {col}: got {got[col].item()!r}, "
                    f"want {want[col].item()!r}; row got {_fmt_row(got)} want {_fmt_row(want)}")


def golden_check(
    group,
    rank: int,
    world_size: int,
    max_tokens_per_rank: int,
    num_experts_per_rank: int,
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    out_weights: torch.Tensor | None,
    out_indices: torch.Tensor | None,
    total_recv: torch.Tensor,
    recv_src: torch.Tensor,
    y: torch.Tensor | None,
    y_w: torch.Tensor | None,
    *,
    scales: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    masked=(),
) -> None:
    """Check one rank's dispatch (and optionally combine) result against the inputs of all ranks.

    Collective (all_gathers the inputs): every rank must call it, with the same ``H``, ``k``,
    dtypes and the same choice of ``scales`` being None or not. The gathers happen before any
    assertion, so a failing rank never leaves its peers inside a collective.

    Args:
        x, weights, indices: this rank's dispatch inputs ``[n, H]``, ``[n, k]`` f32, ``[n, k]``.
        out, out_weights, out_indices: dispatch outputs; rows ``[0, total_recv)`` are checked.
            ``out_weights`` / ``out_indices`` may be None to skip them.
        total_recv: 1-element integer tensor.
        recv_src: flat source id ``srcRank * M + srcTok`` of each received row (``>= total`` rows).
        y, y_w: combine outputs of an identity expert (``expert_out = out``), or None to skip.
        scales, out_scales: per-token scales and their dispatched copy (checked bitwise if given).
        atol, rtol: tolerance for ``y`` (default by ``y.dtype``, see :func:`default_tolerance`);
            ``y_w`` is float32 and always uses ``(1e-6, 1e-5)``.
        masked: ranks whose experts are removed (the module's last paragraph); ``group`` is then
            the live ranks' group and only they call this.

    Raises:
        AssertionError: naming the rank, the row/token, and what differs.
    """
    M, ws, epr = max_tokens_per_rank, world_size, num_experts_per_rank
    n, H = x.shape
    k = indices.shape[1]
    device = x.device
    if n > M:
        _fail(rank, f"n = {n} > max_tokens_per_rank = {M}")
    # The dispatch's outputs are views of the op's receive buffers, valid until any rank's next
    # dispatch: a peer that finishes this check first may dispatch again and overwrite them while
    # this rank still reads them. Copies made before the first gather are safe: no peer gets past
    # it before this rank's copies are done (the gather follows them on this rank's stream).
    out, out_weights, out_indices, out_scales, total_recv, recv_src = (
        None if t is None else t.clone() for t in (out, out_weights, out_indices, out_scales, total_recv, recv_src))

    # ---- gather every rank's inputs (all collectives first) -------------------------------------
    n_t = torch.tensor([n], dtype=torch.int64, device=device)
    ns = _all_gather(group, ws, n_t, masked)
    all_n = [int(v.item()) for v in ns]
    all_x = _gather_padded(group, ws, M, x, masked).reshape(ws * M, -1)           # bytes
    all_w = _gather_padded(group, ws, M, weights.to(torch.float32), masked).reshape(ws * M, -1)
    all_i = _gather_padded(group, ws, M, indices.to(torch.int64), masked).reshape(ws * M, -1)  # (int64 ids: no wrap)
    all_s = None
    if scales is not None:
        all_s = _gather_padded(group, ws, M, scales, masked).reshape(ws * M, -1)

    # ---- the set of rows this rank must receive -------------------------------------------------
    idx_all = _as_dtype(all_i, torch.int64).reshape(ws * M, k)
    exist = torch.zeros(ws * M, dtype=torch.bool, device=device)
    for s in range(ws):
        exist[s * M : s * M + all_n[s]] = True
    expected = (exist & _dest_hits(idx_all, rank, ws, epr, masked)).nonzero().flatten()  # sorted ids

    if total_recv.numel() != 1:
        _fail(rank, f"total_recv must have 1 element, has shape {tuple(total_recv.shape)}")
    total = int(total_recv.reshape(-1)[0].item())
    if total != expected.numel():
        _fail(rank, f"total_recv = {total}, expected {expected.numel()} "
                    f"(received-token count of all ranks' routing)")
    if out.shape[0] < total or recv_src.numel() < total:
        _fail(rank, f"outputs too short for total_recv = {total}: out {tuple(out.shape)}, "
                    f"recv_src {tuple(recv_src.shape)}")

    # ---- received positions: unique and exactly the expected set --------------------------------
    src = recv_src.reshape(-1)[:total].to(device=device, dtype=torch.int64)
    out_of_range = (src < 0) | (src >= ws * M)
    if bool(out_of_range.any()):
        i = int(out_of_range.nonzero()[0, 0])
        _fail(rank, f"recv_src row {i} = {int(src[i])} outside [0, {ws * M})")
    srt, order = src.sort()
    dup = srt[1:] == srt[:-1]
    if bool(dup.any()):
        j = int(dup.nonzero()[0, 0])
        s = int(srt[j])
        _fail(rank, f"recv_src is not unique: rows {int(order[j])} and {int(order[j + 1])} both "
                    f"come from rank {s // M} token {s % M}")
    if not torch.equal(srt, expected):
        missing = expected[~torch.isin(expected, srt)]
        extra = srt[~torch.isin(srt, expected)]
        desc = []
        if missing.numel():
            s = int(missing[0])
            desc.append(f"{missing.numel()} expected rows missing, first rank {s // M} token {s % M}")
        if extra.numel():
            s = int(extra[0])
            i = int(order[(srt == s).nonzero()[0, 0]])
            desc.append(f"{extra.numel()} unexpected rows, first row {i} from rank {s // M} token {s % M}")
        _fail(rank, "received set differs: " + "; ".join(desc))

    # ---- payloads bitwise -----------------------------------------------------------------------
    if out.dim() != 2 or out.shape[1] != H or out.dtype != x.dtype:
        _fail(rank, f"out must be [*, {H}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    _check_rows_bitwise(rank, "out", _bytes2d(out[:total]), all_x[src], src, M, x.dtype, H)
    if out_weights is not None:
        _check_rows_bitwise(rank, "out_weights", _bytes2d(out_weights[:total].to(torch.float32)),
                            all_w[src], src, M, torch.float32, k)
    if out_indices is not None:
        if out_indices.dtype != indices.dtype:
            _fail(rank, f"out_indices dtype {out_indices.dtype} differs from the ids' {indices.dtype}")
        _check_rows_bitwise(rank, "out_indices", _bytes2d(out_indices[:total].to(torch.int64)),
                            all_i[src], src, M, torch.int64, k)
    if all_s is not None:
        if out_scales is None:
            _fail(rank, "scales were given but out_scales is None")
        _check_rows_bitwise(rank, "out_scales", _bytes2d(out_scales[:total]), all_s[src], src, M,
                            scales.dtype, scales.shape[1])

    if y is None and y_w is None:
        return

    # ---- combine: U[t] * x[t] -------------------------------------------------------------------
    U = torch.zeros(n, dtype=torch.float32, device=device)
    for r in range(ws):
        U += _dest_hits(indices.to(device), r, ws, epr, masked).float()

    def close(what: str, got: torch.Tensor, want: torch.Tensor, a: float, r: float) -> None:
        if tuple(got.shape) != tuple(want.shape):
            _fail(rank, f"{what} shape {tuple(got.shape)} != expected {tuple(want.shape)}")
        got32 = got.float()
        ok = torch.isclose(got32, want, atol=a, rtol=r)
        if not bool(ok.all()):
            t, c = (int(v) for v in (~ok).nonzero()[0])
            _fail(rank, f"{what}[{t}, {c}] = {got32[t, c].item()!r}, expected U*src = "
                        f"{int(U[t])} * {want[t, c].item() / max(int(U[t]), 1)!r} = "
                        f"{want[t, c].item()!r} (atol {a}, rtol {r}; {int((~ok).sum())} bad "
                        f"elements); token {t} row got {_fmt_row(got32[t])} want {_fmt_row(want[t])}")

    if y is not None:
        if x.dtype.itemsize == 1:
            _fail(rank, f"combine of byte dtype {x.dtype} cannot be checked (cannot be summed)")
        a0, r0 = default_tolerance(y.dtype)
        close("y", y, U[:, None] * x.float(), a0 if atol is None else atol, r0 if rtol is None else rtol)
    if y_w is not None:
        close("y_w", y_w, U[:, None] * weights.float(), 1e-6, 1e-5)
