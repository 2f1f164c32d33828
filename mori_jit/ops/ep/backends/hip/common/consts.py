"""The named constants of the intranode EP kernels: payload dtypes, the words and rows of their
sync regions, wait ids, error codes and phase-timestamp slots.

Each is declared once here and generated into ``kernels/ep/ep_generated.hpp`` (the internode
header takes the dtypes, error codes and done unit from here too); the host decodes them or sizes
regions by them.
"""
from __future__ import annotations

from mori_jit.jit.fields import CConst, CEnum

__all__ = ["EpDType", "EpPhase", "EpCombineQuant", "CombWord", "WaitId", "ErrCode", "XdbRow", "SyncWord", "SYNC_PAIRS", "EP_SYNC_WORDS",
           "FlagUnit", "Stamp", "EP_STAMP_WORDS"]


class EpDType(CEnum):
    """Payload type of one leg. Fp8 and Fp4x2 are moved as bytes (one byte per element; for Fp4x2
    ``hiddenDim`` counts bytes, i.e. pairs of e2m1), never summed."""

    Bf16 = 0
    Fp32 = 1
    Fp8 = 2
    Fp4x2 = 3

    @classmethod
    def _coerce_other(cls, value):
        name = str(value).replace("torch.", "")
        return {"bfloat16": cls.Bf16, "float32": cls.Fp32, "float8_e4m3fn": cls.Fp8,
                "float8_e4m3fnuz": cls.Fp8, "float4_e2m1fn_x2": cls.Fp4x2, "uint8": cls.Fp4x2}.get(name)


class EpPhase(CEnum):
    """Which part of its leg a dispatch or combine kernel runs (docs/design.md §8, "Send and
    receive kernels"): the whole leg, or one half of the split legs. Send: the rows go to their
    destinations and the done counts are raised, then the kernel ends, waiting for no peer's rows.
    Recv: the waits for every peer's rows and what follows them (dispatch: total_recv, the expert
    counts, the epoch; combine: the sums and the combine-done counts). A kernel of each half runs
    on the same stream, the receive after the send."""

    Whole = 0
    Send = 1
    Recv = 2


class EpCombineQuant(CEnum):
    """The combine wire's cast (the op's ``quant_type``; numerics: ``mori_jit/ops/ep/quant.py``): the
    rows as they are; e4m3 bytes (one per element); e4m3 bytes and one 32-bit scale word per
    128-element block (float32 bits, or the UE8M0 byte: ``combineScaleBytes``)."""

    Plain = 0
    Fp8Direct = 1
    Fp8Block = 2

    @classmethod
    def _coerce_other(cls, value):
        return {"none": cls.Plain, "fp8_direct_cast": cls.Fp8Direct, "fp8_blockwise": cls.Fp8Block}.get(str(value))


class _U64Const(CConst):
    """Codes that kernels combine with 64-bit error words (underlying type uint64_t)."""

    @classmethod
    def ctype(cls) -> str:
        """The C++ underlying type of the generated enum."""
        return "uint64_t"


class _U32Const(CConst):
    """Words that kernels compare with 32-bit data words (underlying type uint32_t)."""

    @classmethod
    def ctype(cls) -> str:
        """The C++ underlying type of the generated enum."""
        return "uint32_t"


class CombWord(_U32Const):
    """The 32-bit words of the low-latency combine's rows (`comb_recv`) that are not data.

    There, each word of a pushed row is its own arrival signal (no fence, no range flag). A word
    the home rank has summed is set back to kEmptyWord (the host fills the region with 0xFF bytes);
    a row the sender had no input for (a short input) arrives as kShortWord words. A data word equal
    to either (a NaN, of a bf16 pair or an fp32) is sent as kCanonWord, another NaN, so the home
    rank never mistakes data for them. An fp8 wire (EpCombineQuant) needs no such care: its casts
    never make the byte 0xff, and its scale words are positive floats or single bytes."""

    kEmptyWord = 0xFFFFFFFF
    kShortWord = 0xFFFFFFFE
    kCanonWord = 0xFFFFFFFD


class WaitId(_U64Const):
    """Which spin-wait timed out (the high bits of the error detail word)."""

    kWaitDispatchDone = 1
    kWaitCombineDone = 2
    kWaitCombineRange = 3
    kWaitCombineRows = 4


class ErrCode(_U64Const):
    """Device error codes (word 0 of the host-mapped error words; 0 = no error)."""

    kErrTimeout = 0x4D4F5249  # "MORI": a spin-wait gave up after the timeout
    kErrShortInput = 0x53484F52  # "SHOR": the combine input has fewer rows than were received
    kErrPeerShortInput = 0x50534852  # "PSHR": a peer's short combine input left some of our tokens without its rows
    kErrCapacity = 0x43415041  # "CAPA": a local expert received more pairs than the expert-major layout holds


class XdbRow(CConst):
    """Rows of the cross-device `xdb` region, each indexed by the writing rank."""

    kXdbDispatch = 0  # dispatch done (a count: FlagUnit.kDoneUnit per epoch)
    kXdbCombine = 1  # combine done reading (a count: FlagUnit.kDoneUnit per epoch)
    kXdbNumTok = 2  # token count of the writer's last dispatch


class SyncWord(CConst):
    """Words of the local `sync` region (u64, kernel-only; a claim counter is two, by epoch parity).

    A combine resets the other parity's claim counters at its start (the last combine that used
    them is done, by stream order), so no block has to wait for the others to reset them."""

    kDispEpoch = 0  # the last dispatch's epoch (device-side: no host sync)
    kCombSendNext = 1  # (and word 2) the combine's next send task to claim, by epoch parity
    kCombSumNext = 3  # (and word 4) the combine's next range to sum, by epoch parity
    kErrClaim = 5  # threads that failed since the last reset (RecordError; only the first reports)


#: The claim counters: two words each (the word and the next), by epoch parity.
SYNC_PAIRS = (SyncWord.kCombSendNext, SyncWord.kCombSumNext)
#: Words of the `sync` region (a pair's second word included).
EP_SYNC_WORDS = max(*SyncWord, *(w + 1 for w in SYNC_PAIRS)) + 1


class FlagUnit(_U64Const):
    """How far a done counter moves per epoch."""

    # a rank's dispatch-done and combine-done counters (on every rank, its own too: its own
    # combine-done count is its combine epoch): its blocks add this in all per epoch, whatever its
    # grid (block 0 adds kDoneUnit - (grid - 1), every other block 1), so no block waits for another
    kDoneUnit = 1 << 20


class Stamp(CConst):
    """Phase-timestamp slots of the `stamps` region (globaltimer ns of the last call)."""

    kStDispStart = 0
    kStDispLoopDone = 1
    kStDispCounted = 2  # the latest block's done count sent (atomic max)
    kStDispPeersDone = 3
    kStDispEnd = 4
    kStDispClaimed = 5
    kStCombStart = 8
    kStCombFirstRange = 9
    kStCombSent = 10  # the latest sender's finish (atomic max)
    # (11 and 13: not at one rank, whose blocks wait on no flag and count nothing)
    kStCombSummed = 11  # the latest block's sums computed, before its last output stores (atomic max)
    kStCombEnd = 12  # the latest block's end, its done counts sent (atomic max)
    kStCombFlagsSeen = 13  # the latest time a summer saw its range's flags (low latency: had its rows) (atomic max)
    kStCombFirstStore = 14  # block 0 may push (past its wait for the peers' last combine; its first rows' loads issued)


#: Words of the `stamps` region.
EP_STAMP_WORDS = 16
