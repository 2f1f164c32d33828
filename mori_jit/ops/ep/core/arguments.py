"""What the op's calls accept: the checks of a tensor argument, each raising TypeError/ValueError
that names the argument, the value and what is allowed (the common, valid case costs a few
attribute reads: they run on every call, inside a host budget of a few microseconds). The ranks'
agreement on a call's arguments is :mod:`.agreement`'s."""
from __future__ import annotations

from typing import Any, Optional

import torch

from mori_jit.ops.ep.contract import ROW_ALIGN
from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError

__all__ = ["ROW_ALIGN", "expect_tensor", "expect_latest_routing", "byte_span", "refuse_overlaps"]


#: Router dtypes the dispatch accepts for ``weights`` besides float32 (moved as float32).
ROUTER_DTYPES = (torch.bfloat16, torch.float16)


def router_weights(weights: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``weights`` as the kernels take them: a bf16/fp16 router's as float32, others unchanged."""
    return weights.float() if getattr(weights, "dtype", None) in ROUTER_DTYPES else weights


def expect_tensor(name: str, t: Any, dtype, shape: tuple, device, align: int = 1) -> None:
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a contiguous ``dtype`` tensor of
    ``shape`` (None = any) on ``device`` whose data starts on an ``align``-byte boundary. The
    common, valid case costs a few attribute reads."""
    try:
        if (t.dtype is dtype and t.shape == shape and t.device == device and t.is_contiguous()
                and (align == 1 or t.data_ptr() % align == 0)):
            return
    except AttributeError:
        pass
    if not isinstance(t, torch.Tensor):
        raise EpArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise EpArgumentTypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise EpArgumentError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise EpArgumentError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise EpArgumentError(f"{name}: expected a contiguous tensor")
    if t.data_ptr() % align:
        raise EpArgumentError(f"{name}: data at {t.data_ptr():#x} is not {align}-byte aligned (the kernels move rows "
                         f"as {align}-byte vectors); pass a tensor whose storage starts on such a boundary")


def expect_latest_routing(routing: Any, latest: Any) -> None:
    """Raise ValueError unless ``routing`` is ``latest``, the routing of the op's latest dispatch (an
    identity test: it runs on every call). Another op's routing, or an earlier dispatch's, describes
    rows and slots the latest dispatch replaced: combining or replaying along it is wrong."""
    if routing is not latest:
        raise EpArgumentError("routing: expected the routing returned by this op's latest dispatch(return_routing=True), "
                         "not another op's or an earlier dispatch's (whose rows the latest one replaced)")


def byte_span(t: Optional[torch.Tensor]) -> tuple[int, int]:
    """The byte range [start, end) of a contiguous tensor (empty for None)."""
    if t is None:
        return 0, 0
    start = t.data_ptr()
    return start, start + t.nbytes


def refuse_overlaps(outputs: tuple, inputs: tuple, region: tuple[str, tuple[int, int]]) -> None:
    """Raise ValueError naming the first output (``(name, tensor | None)``) whose bytes overlap an
    input's (same form), ``region`` (``(name, byte span)``) or an output named before it (each
    output is written whole, so a shared byte holds whichever write lands last). Empty ranges
    overlap nothing; touching ranges do not overlap. Inlined int compares: it runs on every
    ``combine(out=)`` call."""
    spans = [(name, start, start + t.nbytes) for name, t in inputs if t is not None for start in (t.data_ptr(),)]
    spans.append((region[0], *region[1]))
    for name, t in outputs:
        if t is None:
            continue
        a = t.data_ptr()
        b = a + t.nbytes
        for what, s, e in spans:
            if a < e and s < b and a < b and s < e:
                raise EpArgumentError(f"{name}: overlaps {what}; pass a separate tensor")
        spans.append((name, a, b))
