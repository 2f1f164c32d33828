"""The ranks' agreement on a call before any rank enters its exchange (docs/design.md §6).

For backends whose legs are host collectives (the ``torch`` backend), every call first checks its
arguments on every rank and exchanges one small record per rank (:func:`agree_on_arguments`); so
do ``close`` and ``reset`` of every backend (:func:`agree_on_step`), whose releases and barriers are
host collectives too. A record holds the rank's *step* (the op's number on the group, the call,
and the dispatch it belongs to), its refusal if its checks refused the call, and whether it passes
weights. From the same records every rank reaches the same outcome:

* ranks at different steps (one repeats a combine while a peer dispatches, a replay meets a fresh
  dispatch, two ops' calls meet, a close meets a dispatch): :class:`EpStateError` on every rank,
  naming each rank's step;
* a rank refused its call: it raises its own error, every peer :class:`EpPeerError` naming it;
* ranks disagree on passing weights: ValueError on every rank.

The records travel in one fixed-size ``all_gather``, waited for with a bound (:mod:`.watch`).
"""
from __future__ import annotations

import json
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mori_jit.ops.ep.core.watch import watch_of
from mori_jit.ops.ep.memory.peers import collective_device
from mori_jit.ops.ep.errors import EpArgumentError, EpPeerError, EpStateError

__all__ = ["Step", "step_text", "agree_on_arguments", "agree_on_step", "RECORD_BYTES"]

#: A rank's step: ``(op number on the group, call, number of the dispatch it belongs to | None)``.
Step = tuple
#: Bytes of one rank's record (a refusal's message is shortened to fit).
RECORD_BYTES = 2048


def step_text(step: Step) -> str:
    """``dispatch 3 of op #1``, ``combine of dispatch 3 of op #1``, ``close of op #1``."""
    op, call, of = step
    if of is None:
        return f"{call} of op #{op}"
    return f"{call} {of} of op #{op}" if call == "dispatch" else f"{call} of dispatch {of} of op #{op}"


def agree_on_arguments(group, step: Step, weights_given: bool, check: Callable[..., int], *args) -> int:
    """``check(*args)`` on every rank (it returns the call's token count, or raises to refuse the
    call), then one bounded collective before any rank enters the call's own exchange: see the
    module's outcomes. Returns the token count."""
    try:
        n, refusal = check(*args), None
    except Exception as e:  # noqa: BLE001 - a refused argument, a closed op, a failed preparation: peers hear of it
        n, refusal = -1, e
    if dist.get_world_size(group) == 1:
        if refusal is not None:
            raise refusal
        return n
    records = _gather(group, step, refusal, weights_given)
    call = step[1]
    _raise_if_out_of_step(step, records)
    if refusal is not None:
        raise refusal
    refused = [(r, msg, kind) for r, (_, msg, kind, _) in enumerate(records) if msg]
    if refused:
        r, msg, kind = refused[0]
        what = "its arguments" if kind == "arguments" else "the call"
        raise EpPeerError(f"{call}: rank {r} refused {what} ({msg}); no rank ran this {call}")
    given = [g for *_, g in records]
    if any(g != given[0] for g in given):
        with_w = [r for r, g in enumerate(given) if g]
        raise EpArgumentError(f"weights: given on ranks {with_w} and not on the others; every rank passes weights "
                              f"to {call} or none does")
    return n


def agree_on_step(group, step: Step) -> None:
    """Every rank of ``group`` is at ``step`` (a call with no arguments: ``close``, ``reset``), or
    every rank raises (see the module)."""
    if dist.get_world_size(group) > 1:
        _raise_if_out_of_step(step, _gather(group, step, None, False))


def _raise_if_out_of_step(step: Step, records: list) -> None:
    steps = [tuple(s) for s, *_ in records]
    if all(s == steps[0] for s in steps):
        return
    by_step: dict = {}
    for r, s in enumerate(steps):
        by_step.setdefault(s, []).append(r)
    where = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} in {step_text(s)}"
                      for s, rs in by_step.items())
    refusals = "".join(f"; rank {r} also refused it ({msg})" for r, (_, msg, _, _) in enumerate(records) if msg)
    raise EpStateError(f"{step_text(step)}: the ranks are at different steps ({where}){refusals}; every rank makes "
                       f"the same calls of the same ops in the same order, and no rank ran these")


def _gather(group, step: Step, refusal: Optional[BaseException], weights_given: bool) -> list:
    """Every rank's record ``(step, refusal message | None, refusal kind, weights_given)``."""
    # (EpStateError: the op's state refuses the call, e.g. a leg in flight)
    kind = "arguments" if isinstance(refusal, (TypeError, ValueError, NotImplementedError, EpStateError)) else "call"
    msg = None if refusal is None else f"{type(refusal).__name__}: {refusal}"
    mine = _encode([list(step), msg, kind, weights_given])
    device = collective_device(group)
    t = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    t[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    t = t.to(device)
    outs = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    watch_of(group).wait(dist.all_gather(outs, t, group=group, async_op=True), f"agreement on {step_text(step)}")
    return [_decode(o.cpu()) for o in outs]


def _encode(record: list) -> bytes:
    """``record`` as length-prefixed JSON within :data:`RECORD_BYTES` (a long message shortened
    until it fits: the other fields are a few numbers and short names)."""
    for limit in (None, 1000, 200, 0):
        if limit is not None and record[1] is not None and len(record[1]) > limit:
            record = [record[0], record[1][:limit] + "...", *record[2:]]
        body = json.dumps(record).encode()
        if len(body) + 4 <= RECORD_BYTES or limit == 0:
            return len(body).to_bytes(4, "little") + body


def _decode(t: torch.Tensor) -> list:
    raw = bytes(t.numpy())
    return json.loads(raw[4:4 + int.from_bytes(raw[:4], "little")])
