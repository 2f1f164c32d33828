"""Readable messages for the error words (code, detail, extra) the internode kernels record."""
from __future__ import annotations

from mori_jit.ops.ep.backends.hip.common.consts import ErrCode
from mori_jit.ops.ep.backends.hip.common.wait_errors import peer_short, short_input, timed_out, unknown
from mori_jit.ops.ep.backends.hip.internode.cfg import NetWaitId

__all__ = ["NET_WAIT_MESSAGES", "decode_net_error"]

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


def decode_net_error(words: list[int]) -> str:
    """A readable message for the internode kernels' error words (code, detail, extra)."""
    code, detail, extra = words[0], words[1], words[2]
    if code == ErrCode.kErrTimeout:
        said = timed_out(detail, NET_WAIT_MESSAGES)[1]
        return f"{said} (signal never reached {extra}); a peer skipped or is stuck in a collective"
    if code == ErrCode.kErrShortInput:
        return short_input(detail, extra) + " (their home ranks report it)"
    if code == ErrCode.kErrPeerShortInput:
        return peer_short(detail, "", "some of rank {peer}'s rows")
    return unknown(code, detail)
