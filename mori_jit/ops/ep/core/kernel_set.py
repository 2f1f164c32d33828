"""What a backend hands the op: :class:`KernelSet`, the callables of its legs and its schedule."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from mori_jit.ops.ep.core.schedule import Schedule

__all__ = ["KernelSet"]


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """What a backend built. Callables take a bucket index first (see ``EpDispatchCombineOp._pick``).

    ``dispatch(v, x, weights, scales, indices)`` → ``(out, out_w, out_s, out_idx, total_recv, routing)``,
    plus a seventh ``(expert_counts, expert_layout)`` from backends with the MoE outputs
    (:class:`~mori_jit.ops.ep.results.EpDispatchResult`); ``replay(v, x, weights, scales, routing)``
    the same along an earlier routing (None: no replay);
    ``combine(v, inp, weights, routing, out, out_w)`` → ``(y, y_w)`` (``out``/``out_w``: caller's
    output tensors or None); ``combine_expert_major(v, inp, routing, out)`` → ``y`` (None: no
    expert-major layout). ``bound_launches``, for diagnostics (``scripts/profile_ep_host.py``):
    per leg (``"dispatch"``, ``"combine"``), each bucket's zero-argument launch
    (:meth:`mori_jit.jit.plan.Plan.bind_struct`) of the args struct the leg's last call filled.
    The split legs (None: not built): ``dispatch_send(v, x, weights, scales, indices, routing)``
    (routing None: a dispatch, else a replay along it) and ``combine_send`` (``combine``'s
    arguments) each send and return ``(outputs, receive)``: the leg's outputs, valid once the
    zero-argument ``receive`` has run (:mod:`mori_jit.ops.ep.core.overlap`).
    Rank masking (None: not served, :mod:`mori_jit.ops.ep.core.mask`): ``rank_mask`` int32
    ``[world_size]`` on the device, 1 = masked, read by every call; ``masked_pairs`` int32 ``[1]``,
    the (token, expert) pairs the latest dispatch dropped for a masked rank; ``mask_refusal``, when
    they are None, why (the refusal's message names what serves masking).
    """

    dispatch: Callable[..., tuple]
    combine: Callable[..., tuple]
    schedule: Schedule
    capabilities: frozenset[str]  # e.g. "graph": no host work between rounds, so a step can be captured
    check: Callable[[], None] = lambda: None
    reset: Callable[[], None] = lambda: None
    combine_input_buffer: Optional[Callable[[], torch.Tensor]] = None
    close: Callable[[], None] = lambda: None
    bound_launches: dict[str, tuple[Callable[[], None], ...]] = dataclasses.field(default_factory=dict)
    replay: Optional[Callable[..., tuple]] = None
    combine_expert_major: Optional[Callable[..., torch.Tensor]] = None
    dispatch_send: Optional[Callable[..., tuple[tuple, Callable[[], None]]]] = None
    combine_send: Optional[Callable[..., tuple[tuple, Callable[[], None]]]] = None
    rank_mask: Optional[torch.Tensor] = None
    masked_pairs: Optional[torch.Tensor] = None
    mask_refusal: str = ""
