"""What mori's op API adds to a call, beyond the tensors: the group given as a communicator, a
geometry named per call, the combine input's mode and reset flag, and the registered combine input
buffer's request. Each check names the argument, the value and what is allowed; the default of
every option costs the caller nothing (the op tests for it inline before calling here)."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from mori_jit.ops.ep.core.schedule import Schedule
from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError, EpUnsupportedError

__all__ = ["COMMUNICATOR_ATTR", "resolve_group", "pick_geometry", "check_combine_options",
           "check_call_options", "refuse_train_options", "check_buffer_request"]

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


def _count(name: str, value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int):
        raise EpArgumentTypeError(f"{name}={value!r}: expected an int (-1 or <= 0: the op's own choice)")
    return value


def pick_geometry(schedule: Schedule, leg: str, num_tokens: int, block_num: Any, rdma_block_num: Any,
                  warp_per_block: Any) -> int:
    """The bucket a call that names a geometry launches (mori's per-call ``block_num``,
    ``rdma_block_num``, ``warp_per_block``; a value ``<= 0`` or None leaves that one to the op).
    Only a variant built at construction can serve it: nothing compiles on the call path."""
    blocks, rdma, warps = (_count(n, v) for n, v in (("block_num", block_num), ("rdma_block_num", rdma_block_num),
                                                      ("warp_per_block", warp_per_block)))
    if rdma > 0:
        raise EpUnsupportedError(f"{leg}: rdma_block_num={rdma}: the kernels give no blocks to the network apart "
                                 f"from the others (each leg is one kernel); pass -1")
    found = schedule.find(leg, num_tokens, blocks, warps)
    if found is None:
        built = sorted(set(schedule.dispatch if leg == "dispatch" else schedule.combine))
        raise EpArgumentError(f"{leg}: block_num={blocks}, warp_per_block={warps}: no {leg} variant built for this op "
                              f"has that geometry (built, as (blocks, warps): {built}); nothing compiles on a call: "
                              f"pin the geometry in the config (block and warp fields, or schedule), or pass -1")
    return found


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


def check_call_options(op, schedule: Schedule, leg: str, num_tokens: int, geometry: Optional[tuple],
                       count: bool = False, options: Optional[tuple] = None) -> None:
    """The mori options of one call of ``op`` (part of the call's checks, so that a backend whose
    ranks agree on their arguments first refuses them on every rank): ``count`` (dispatch's
    ``call_local_expert_count``), the ``geometry`` ``(block_num, rdma_block_num, warp_per_block)``
    when one is named, combine's ``options`` ``(use_external_inp_buf, call_reset)`` when not the
    defaults."""
    _check_count_and_options(op, count, options)
    if geometry is not None:
        pick_geometry(schedule, leg, num_tokens, *geometry)


def _check_count_and_options(op, count: bool, options: Optional[tuple]) -> None:
    """``call_local_expert_count`` needs ``cfg.expert_counts``; combine's ``options`` must be mori's values."""
    if count and not op.cfg.expert_counts:
        raise EpUnsupportedError("call_local_expert_count=True: the op counts local experts only with "
                                 "EpDispatchCombineConfig.expert_counts=True")
    if options is not None:
        check_combine_options(*options)


def refuse_train_options(op, leg: str, geometry: Optional[tuple], count: bool = False,
                         options: Optional[tuple] = None) -> None:
    """The mori options of a differentiable call (:mod:`mori_jit.ops.ep.train`, which runs the op's
    own calls with the op's choices): ``count`` and combine's ``options`` are checked as on any call
    (a valid value changes nothing); a named ``geometry`` is refused, since the differentiable legs
    (forward and backward) launch the op's own geometry. Each refusal depends only on the config
    and the call's own values, so ranks calling alike refuse alike."""
    _check_count_and_options(op, count, options)
    if geometry is not None:
        block_num, rdma_block_num, warp_per_block = geometry
        raise EpUnsupportedError(f"{leg}: block_num={block_num}, rdma_block_num={rdma_block_num}, warp_per_block="
                                 f"{warp_per_block}: a differentiable {leg} (an input requires grad) launches the "
                                 f"op's own geometry; pass -1 (pin the geometry in the config: block and warp "
                                 f"fields, or schedule)")


def check_buffer_request(cfg, dtype, hidden_dim: Any) -> None:
    """mori's ``get_registered_combine_input_buffer(dtype, hidden_dim=-1)``: the buffer holds
    combine-dtype rows of ``cfg.hidden_dim`` elements; any other request is refused."""
    if dtype != cfg.combine_dtype:
        raise EpArgumentTypeError(f"dtype={dtype}: the combine input buffer holds the combine dtype "
                                  f"{cfg.combine_dtype} (what combine reads)")
    if hidden_dim not in (-1, None, cfg.hidden_dim):
        raise EpArgumentError(f"hidden_dim={hidden_dim!r}: the combine input buffer's rows are the op's hidden_dim "
                              f"{cfg.hidden_dim}; pass -1 or {cfg.hidden_dim}")
