"""Payload rows as raw bytes: every field of a sent token packed into one ``uint8`` row, so that
dtypes a process group cannot reduce or even transport (bf16 and fp8 on gloo) move bit-exactly, and a
leg is one payload exchange (the ``torch`` backend, :mod:`.reference`)."""
from __future__ import annotations

import torch

__all__ = ["row_bytes", "from_row_bytes", "pack_rows", "unpack_rows"]


def row_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a 2-D tensor ``[rows, C]`` as its raw bytes ``[rows, C * element_size]`` (uint8)."""
    rows, cols = t.shape
    if t.numel() == 0:  # empty tensors may carry stride 0, which a dtype view rejects
        return torch.empty((rows, cols * t.element_size()), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(rows, cols * t.element_size())


def from_row_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Inverse of :func:`row_bytes`: reinterpret ``[rows, cols * elsize]`` bytes as ``dtype``."""
    if b.numel() == 0:
        return torch.empty((b.shape[0], cols), dtype=dtype, device=b.device)
    # A dtype view needs dense rows, and a storage offset and row stride that are multiples of the
    # element size. ``b`` is usually a column slice of a packed buffer: its rows are not dense, and
    # a single row (which torch calls contiguous) keeps the packed row's stride and starts where the
    # fields before it end (an int64 column after the 4-byte source id starts at offset 4). A fresh
    # dense copy (offset 0) is viewable; a tensor that already is one is viewed as it is.
    if b.stride() != (b.shape[1], 1) or b.storage_offset() % dtype.itemsize:
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(dtype).reshape(b.shape[0], cols)


def pack_rows(fields: list[torch.Tensor], rows: torch.Tensor | None) -> torch.Tensor:
    """Concatenate byte fields ``[n, w_i]`` column-wise, taking only ``rows`` (all if None)."""
    n = fields[0].shape[0] if rows is None else rows.numel()
    width = sum(f.shape[1] for f in fields)
    out = torch.empty(n, width, dtype=torch.uint8, device=fields[0].device)
    off = 0
    for f in fields:
        w = f.shape[1]
        out[:, off : off + w] = f if rows is None else f.index_select(0, rows)
        off += w
    return out


def unpack_rows(recv: torch.Tensor, outs: list, total: int) -> None:
    """Row ``i`` of the packed ``recv`` into row ``i`` of each output, field by field (each output's
    row bytes, in order; a None output has no field)."""
    off = 0
    for o in outs:
        if o is None:
            continue
        w = o.shape[1] * o.element_size()
        o[:total] = from_row_bytes(recv[:, off:off + w], o.dtype, o.shape[1])
        off += w
