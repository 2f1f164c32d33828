"""What the intranode and internode kernels' error words share: the layout of a timeout's detail
word (wait id, peer, waiting rank), a short combine input, a peer's short input, and an unknown code.
Each family's decoder (``intranode.errors``, ``internode.errors``) names its own waits."""
from __future__ import annotations

__all__ = ["waited_for", "timed_out", "short_input", "peer_short", "unknown"]


def waited_for(detail: int) -> int:
    """The peer a timed-out wait's detail word names (the rank ``MORI_EP_MASK_ON_TIMEOUT`` masks)."""
    return (detail >> 32) & 0xFFFF


def timed_out(detail: int, messages: dict) -> tuple[int, str]:
    """A timeout's wait id and its sentence: which rank waited for what, from which rank."""
    wait, peer, who = detail >> 48, (detail >> 32) & 0xFFFF, (detail >> 16) & 0xFFFF
    return wait, f"rank {who}: {messages.get(wait, f'wait {wait}')} from rank {peer} timed out after MORI_EP_TIMEOUT_S"


def short_input(detail: int, extra: int) -> str:
    """A short combine input: the rows given against the rows received."""
    return (f"rank {(detail >> 16) & 0xFFFF}: combine input had {extra & 0xFFFFFFFF} rows but dispatch "
            f"received {extra >> 32}; the missing rows were not combined")


def peer_short(detail: int, where: str, rows: str) -> str:
    """A peer's short combine input left tokens of this rank without ``rows`` (``{peer}`` filled)."""
    who, peer = (detail >> 16) & 0xFFFF, detail >> 32
    return (f"rank {who}: rank {peer}'s combine input was short (that rank reports its row counts), so "
            f"tokens of rank {who}{where} were summed without {rows.format(peer=peer)}: this combine's output on "
            f"rank {who} is wrong")


def unknown(code: int, detail: int) -> str:
    return f"unknown device error code {code:#x} (detail {detail:#x})"
