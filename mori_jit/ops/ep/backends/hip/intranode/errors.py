"""Readable messages for the error words (code, detail, extra) the intranode kernels record."""
from __future__ import annotations

from mori_jit.ops.ep.backends.hip.common.consts import ErrCode, FlagUnit, WaitId
from mori_jit.ops.ep.backends.hip.common.wait_errors import peer_short, short_input, timed_out, unknown

__all__ = ["WAIT_MESSAGES", "decode_error"]

#: What each spin-wait of the kernels waits for (every WaitId has one; a CPU test checks).
WAIT_MESSAGES = {WaitId.kWaitDispatchDone: "dispatch: waiting for a peer's dispatch-done count",
                 WaitId.kWaitCombineDone: "waiting for a peer to finish its previous combine (combine-done count)",
                 WaitId.kWaitCombineRange: "combine: waiting for a peer's rows of a token range (range-ready flag)",
                 WaitId.kWaitCombineRows: "combine (low latency): waiting for a peer's row of a token (its words "
                                          "never arrived)"}


def decode_error(words: list[int], rank: int) -> str:
    """A readable message for the device error words (code, detail, extra)."""
    code, detail, extra = words[0], words[1], words[2]
    if code == ErrCode.kErrTimeout:
        wait, said = timed_out(detail, WAIT_MESSAGES)
        if wait == WaitId.kWaitCombineRows:
            return f"{said} (token {extra}); a peer skipped or is stuck in a collective"
        # how far each word moves per epoch: a range flag 2 (its low bit carries a short input), a
        # done count kDoneUnit
        unit, what = {WaitId.kWaitCombineRange: (2, "combine"), WaitId.kWaitCombineDone: (FlagUnit.kDoneUnit, "combine"),
                      WaitId.kWaitDispatchDone: (FlagUnit.kDoneUnit, "dispatch")}.get(wait, (1, ""))
        goal = f"{extra} = {int(unit)} x {what} epoch {extra // unit}" if unit > 1 else f"{extra}"
        return f"{said} (flag never reached {goal}); a peer skipped or is stuck in a collective"
    if code == ErrCode.kErrShortInput:
        return short_input(detail, extra)
    if code == ErrCode.kErrCapacity:
        who, expert, count, cap = (detail >> 16) & 0xFFFF, detail >> 32, extra >> 32, extra & 0xFFFFFFFF
        return (f"rank {who}: local expert {expert} received {count} (token, expert) pairs, more than "
                f"expert_capacity={cap}; the expert-major layout holds the first {cap} (the receive rows and the "
                f"counts are whole); raise expert_capacity to at least {count}")
    if code == ErrCode.kErrPeerShortInput:
        # (a range flag reports its range's first token, the low-latency path the token itself)
        return peer_short(detail, f" (first reported at token {extra})", "rank {peer}'s rows")
    return unknown(code, detail)
