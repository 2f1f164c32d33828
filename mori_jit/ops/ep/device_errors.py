"""Readable messages for the error words the ``hip`` backend's kernels record (code, detail,
extra): the intranode kernels' (:func:`decode_error`) and the internode kernels'
(:func:`decode_net_error`), which encode a timeout, a short input and a peer's short input alike."""
from __future__ import annotations

from .internode_cfg import NetWaitId
from .kernel_consts import ErrCode, FlagUnit, WaitId

__all__ = ["WAIT_MESSAGES", "NET_WAIT_MESSAGES", "decode_error", "decode_net_error"]

#: What each spin-wait of the kernels waits for (every WaitId has one; a CPU test checks).
WAIT_MESSAGES = {WaitId.kWaitDispatchDone: "dispatch: waiting for a peer's dispatch-done count",
                 WaitId.kWaitCombineDone: "waiting for a peer to finish its previous combine (combine-done count)",
                 WaitId.kWaitCombineRange: "combine: waiting for a peer's rows of a token range (range-ready flag)",
                 WaitId.kWaitCombineRows: "combine (low latency): waiting for a peer's row of a token (its words "
                                          "never arrived)"}
#: What each spin-wait of the internode kernels waits for (every NetWaitId has one; a CPU test checks).
NET_WAIT_MESSAGES = {
    NetWaitId.kNetWaitPeerCombine: "dispatch: waiting for a peer to finish reading its previous combine input",
    NetWaitId.kNetWaitPeerSlots: "dispatch: waiting for a peer to free its receive slots after its previous dispatch",
    NetWaitId.kNetWaitDispatchDone: "dispatch: waiting for a peer's rows (its dispatch-done signal)",
    NetWaitId.kNetWaitCombineDone: "combine: waiting for a peer's rows (its combine-done signal)",
    NetWaitId.kNetWaitRelayFree: "dispatch: waiting for a forwarder to free its relay rows after its previous dispatch",
    NetWaitId.kNetWaitForwardDone: "dispatch: waiting for a forwarder of this node (its forward-done signal)",
    NetWaitId.kNetWaitCombineForwardDone: "combine: waiting for a forwarder's partial sums (its forward-done signal)",
}


def _timed_out(detail: int, messages: dict) -> tuple[int, str]:
    """A timeout's wait id and its sentence: which rank waited for what, from which rank."""
    wait, peer, who = detail >> 48, (detail >> 32) & 0xFFFF, (detail >> 16) & 0xFFFF
    return wait, f"rank {who}: {messages.get(wait, f'wait {wait}')} from rank {peer} timed out after MORI_EP_TIMEOUT_S"


def _short_input(detail: int, extra: int) -> str:
    """A short combine input: the rows given against the rows received."""
    return (f"rank {(detail >> 16) & 0xFFFF}: combine input had {extra & 0xFFFFFFFF} rows but dispatch "
            f"received {extra >> 32}; the missing rows were not combined")


def _peer_short(detail: int, where: str, rows: str) -> str:
    """A peer's short combine input left tokens of this rank without ``rows`` (``{peer}`` filled)."""
    who, peer = (detail >> 16) & 0xFFFF, detail >> 32
    return (f"rank {who}: rank {peer}'s combine input was short (that rank reports its row counts), so "
            f"tokens of rank {who}{where} were summed without {rows.format(peer=peer)}: this combine's output on "
            f"rank {who} is wrong")


def _unknown(code: int, detail: int) -> str:
    return f"unknown device error code {code:#x} (detail {detail:#x})"


def decode_error(words: list[int], rank: int) -> str:
    """A readable message for the device error words (code, detail, extra)."""
    code, detail, extra = words[0], words[1], words[2]
    if code == ErrCode.kErrTimeout:
        wait, said = _timed_out(detail, WAIT_MESSAGES)
        if wait == WaitId.kWaitCombineRows:
            return f"{said} (token {extra}); a peer skipped or is stuck in a collective"
        # how far each word moves per epoch: a range flag 2 (its low bit carries a short input), a
        # done count kDoneUnit
        unit, what = {WaitId.kWaitCombineRange: (2, "combine"), WaitId.kWaitCombineDone: (FlagUnit.kDoneUnit, "combine"),
                      WaitId.kWaitDispatchDone: (FlagUnit.kDoneUnit, "dispatch")}.get(wait, (1, ""))
        goal = f"{extra} = {int(unit)} x {what} epoch {extra // unit}" if unit > 1 else f"{extra}"
        return f"{said} (flag never reached {goal}); a peer skipped or is stuck in a collective"
    if code == ErrCode.kErrShortInput:
        return _short_input(detail, extra)
    if code == ErrCode.kErrCapacity:
        who, expert, count, cap = (detail >> 16) & 0xFFFF, detail >> 32, extra >> 32, extra & 0xFFFFFFFF
        return (f"rank {who}: local expert {expert} received {count} (token, expert) pairs, more than "
                f"expert_capacity={cap}; the expert-major layout holds the first {cap} (the receive rows and the "
                f"counts are whole); raise expert_capacity to at least {count}")
    if code == ErrCode.kErrPeerShortInput:
        # (a range flag reports its range's first token, the low-latency path the token itself)
        return _peer_short(detail, f" (first reported at token {extra})", "rank {peer}'s rows")
    return _unknown(code, detail)


def decode_net_error(words: list[int]) -> str:
    """A readable message for the internode kernels' error words (code, detail, extra)."""
    code, detail, extra = words[0], words[1], words[2]
    if code == ErrCode.kErrTimeout:
        said = _timed_out(detail, NET_WAIT_MESSAGES)[1]
        return f"{said} (signal never reached {extra}); a peer skipped or is stuck in a collective"
    if code == ErrCode.kErrShortInput:
        return _short_input(detail, extra) + " (their home ranks report it)"
    if code == ErrCode.kErrPeerShortInput:
        return _peer_short(detail, "", "some of rank {peer}'s rows")
    return _unknown(code, detail)
