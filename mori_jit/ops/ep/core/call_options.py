"""What mori's op API adds to a call, beyond the tensors: the group given as a communicator, the
local expert counts asked for, the combine input's mode and reset flag, and the registered combine
input buffer's request. Each check names the argument, the value and what is allowed; the default of
every option costs the caller nothing (the op tests it before calling here)."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError, EpUnsupportedError

__all__ = ["COMMUNICATOR_ATTR", "resolve_group", "check_combine_options", "check_call_options",
           "check_buffer_request"]

#: The attribute of a communicator-like object (mori's ``mori.cco.Communicator`` as
#: :mod:`mori_jit.compat.mori.cco` makes it) that holds the torch process group it runs on.
COMMUNICATOR_ATTR = "process_group"
#: The values of ``combine(use_external_inp_buf=)``: mori's -1 (the config's), 0 (zero copy) and 1.
_INPUT_MODES = (-1, 0, 1)


def resolve_group(group: Any):
    """The torch process group an op runs on: WORLD for None, the group of a communicator-like
    object (one with a ``process_group`` attribute), else ``group`` itself."""
    if group is None:
        return dist.group.WORLD
    inner = getattr(group, COMMUNICATOR_ATTR, None)
    return inner if inner is not None else group


def check_combine_options(use_external_inp_buf: Any, call_reset: Any) -> None:
    """mori's ``combine(use_external_inp_buf=, call_reset=)``. Both modes of the input are served as
    they are (the combine reads its input in place, wherever it lies), and no reset is needed
    between steps (the kernels leave the op ready for the next dispatch), so a valid value changes
    nothing; an invalid one is refused."""
    if isinstance(use_external_inp_buf, bool):
        use_external_inp_buf = int(use_external_inp_buf)
    if use_external_inp_buf not in _INPUT_MODES:
        raise EpArgumentError(f"use_external_inp_buf={use_external_inp_buf!r}: allowed -1 (the config's), 0 (the "
                              f"input is the registered combine input buffer) or 1 (any tensor)")
    if not isinstance(call_reset, bool):
        raise EpArgumentTypeError(f"call_reset={call_reset!r}: expected True or False")


def check_call_options(op, count: bool = False, options: Optional[tuple] = None) -> None:
    """The mori options of one call of ``op`` (part of the call's checks, so that a backend whose
    ranks agree on their arguments first refuses them on every rank): ``count`` (dispatch's
    ``call_local_expert_count``), combine's ``options`` ``(use_external_inp_buf, call_reset)``
    when not the defaults."""
    if count and not op.cfg.expert_counts:
        raise EpUnsupportedError("call_local_expert_count=True: the op counts local experts only with "
                                 "EpDispatchCombineConfig.expert_counts=True")
    if options is not None:
        check_combine_options(*options)


def check_buffer_request(cfg, dtype, hidden_dim: Any) -> None:
    """mori's ``get_registered_combine_input_buffer(dtype, hidden_dim=-1)``: the buffer holds
    combine-dtype rows of ``cfg.hidden_dim`` elements; any other request is refused."""
    if dtype != cfg.combine_dtype:
        raise EpArgumentTypeError(f"dtype={dtype}: the combine input buffer holds the combine dtype "
                                  f"{cfg.combine_dtype} (what combine reads)")
    if hidden_dim not in (-1, None, cfg.hidden_dim):
        raise EpArgumentError(f"hidden_dim={hidden_dim!r}: the combine input buffer's rows are the op's hidden_dim "
                              f"{cfg.hidden_dim}; pass -1 or {cfg.hidden_dim}")
