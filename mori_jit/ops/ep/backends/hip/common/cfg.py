"""What the intranode (``intranode.cfg``) and internode (``internode.cfg``) kernel configs declare
alike: the payload arithmetic, how validity rules combine and report, and the fields every args
struct starts with. Each config names its own derived values (``Ep*``, ``Net*``) from these."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from mori_jit.jit.args import i32, i64, ptr
from mori_jit.jit.expr import C, where
from mori_jit.jit.fields import cfg_fields

from mori_jit.ops.ep.backends.hip.common.consts import EpCombineQuant, EpDType, EpPhase

__all__ = ["DISPATCH", "COMBINE", "LAYOUT", "EXPERT_SUM", "ELEM_TYPES", "ELEM_BYTES", "MAX_RECV", "SUMMABLE", "all_of",
           "rule_problems", "leg_io_args", "SPLIT_PHASES", "phase_suffix", "halves", "MASK_REGIONS", "mask_region_bytes",
           "wire_bytes", "COMBINE_QUANT_RULE", "quant_suffix"]

#: The legs of the op, each a kernel.
DISPATCH, COMBINE = "dispatch", "combine"
#: The expert-major layout kernel (launched after a dispatch, on the dispatch's EpCfg) and the
#: expert-major combine's local sum (launched before a float32 combine, on the combine's EpCfg).
LAYOUT, EXPERT_SUM = "layout", "expert_sum"

#: The halves of a split leg (docs/design.md §8, "Send and receive kernels"), in launch order; each
#: is the leg's Cfg with its ``phase`` (``EpPhase.Whole``, the default, is the unsplit leg).
SPLIT_PHASES = (EpPhase.Send, EpPhase.Recv)

#: Device element type of each dtype tag (expanded at render time; the Cfg header has only the tag).
ELEM_TYPES = {EpDType.Bf16: "mori::bf16_t", EpDType.Fp32: "float", EpDType.Fp8: "mori::fp8_t",
              EpDType.Fp4x2: "mori::fp4x2_t"}
#: Bytes per payload element of a config's ``dtype``.
ELEM_BYTES = where(C.dtype.eq(EpDType.Fp32), 4, where(C.dtype.eq(EpDType.Bf16), 2, 1))
#: Receive capacity in rows: ``maxRecv``, or every rank's every token when it is 0.
MAX_RECV = where(C.maxRecv.eq(0), C.worldSize * C.maxTokPerRank, C.maxRecv)
#: The dtype can be reduced (a combine's): bf16 and fp32.
SUMMABLE = C.dtype.eq(EpDType.Bf16) | C.dtype.eq(EpDType.Fp32)
#: The combine wire's rule (``combineQuant``, ``combineScaleBytes``; numerics: ``quant.py``), the
#: same for the intranode and the internode kernels.
COMBINE_QUANT_RULE = (
    C.combineQuant.eq(EpCombineQuant.Plain)
    | ((C.dtype.eq(EpDType.Bf16) | C.dtype.eq(EpDType.Fp32)) & (C.hiddenDim % 16).eq(0)
       & (~C.combineQuant.eq(EpCombineQuant.Fp8Block)
          | ((C.hiddenDim % 128).eq(0) & (C.combineScaleBytes.eq(4) | C.combineScaleBytes.eq(1))))),
    "combineQuant needs dtype Bf16 or Fp32 and hiddenDim a multiple of 16; Fp8Block also hiddenDim a multiple "
    "of 128 and combineScaleBytes 4 or 1")


def wire_bytes(token_bytes):
    """A combine row on the wire (a config's ``*WireBytes``; ``token_bytes``: its ``*TokenBytes``):
    the row itself, or its e4m3 bytes and (Fp8Block) one 32-bit scale word per 128-element block,
    the words padded to whole 16-byte vectors (``kernels/ep/ep_wire_row.hpp``)."""
    return where(C.combineQuant.eq(EpCombineQuant.Plain), token_bytes,
                 C.hiddenDim + where(C.combineQuant.eq(EpCombineQuant.Fp8Block), (C.hiddenDim / 128 * 4 + 15) / 16 * 16, 0))


def quant_suffix(cfg) -> str:
    """The entry-name mark of a combine's wire, for both kernel configs: none for the rows as they
    are, ``_w8`` for the direct cast, ``_w8b<bytes>`` for the blockwise one with scales of that size."""
    return {EpCombineQuant.Plain: "", EpCombineQuant.Fp8Direct: "_w8",
            EpCombineQuant.Fp8Block: f"_w8b{cfg.combineScaleBytes}"}[cfg.combineQuant]

#: Rank masking's two arena regions (docs/design.md §6, "Rank masking"), the same in both families'
#: tables (name → doc; sizes: :func:`mask_region_bytes`). Local: the op writes the mask between
#: calls and every kernel reads it, so a captured graph follows a change.
MASK_REGIONS: dict[str, str] = {
    "rank_mask": "masked ranks [most ranks] i32, 1 = masked: their experts dropped, no send, count or wait for them (local; the op writes it, every call reads it)",
    "masked_pairs": "(token, expert) pairs dropped for a masked rank [3] u32: two by epoch parity (this rank's blocks add), then the last dispatch's (local)",
}


def mask_region_bytes(ranks: int) -> dict[str, int]:
    """Bytes of :data:`MASK_REGIONS` for a family of at most ``ranks`` ranks."""
    return {"rank_mask": ranks * 4, "masked_pairs": 3 * 4}


def all_of(rules: Sequence[tuple[Any, str]]):
    """The conjunction of the rules' expressions (a config's ``*IsValid``, emitted to C++ too)."""
    out = rules[0][0]
    for expr, _ in rules[1:]:
        out = out & expr
    return out


def rule_problems(cfg, rules: Sequence[tuple[Any, str]]) -> list[str]:
    """The message of every rule ``cfg`` violates, each with the config's values."""
    vals = ", ".join(f"{f.name}={getattr(cfg, f.name)!s}" for f in cfg_fields(cfg))
    return [f"{msg} ({vals})" for expr, msg in rules if not expr.eval(cfg)]


def leg_io_args(indices_doc: str, rank_doc: str) -> list:
    """The fields every EP args struct starts with: a leg's inputs and outputs, the host-mapped
    error words, the call's counts, this rank and the spin-wait bound."""
    return [
        ptr("inpTok", "const void", "dispatch: tokens [n, tokenBytes]; combine: expert output [>=recv, H]"),
        ptr("inpWeights", "const float", "dispatch: weights [n, k]; combine: weights [>=recv, k] or null"),
        ptr("inpIndices", "const int32_t", indices_doc),
        ptr("outTok", "void", "combine: y [n, H]"),
        ptr("outWeights", "float", "combine: y_w [n, k] or null"),
        ptr("errWord", "uint64_t", "host-mapped error words [4]: code, detail, extra (0 = ok)"),
        i32("numTokens", doc="n of the dispatch call"),
        i32("inpRows", doc="combine: rows of the expert output (guards a short input)"),
        i32("rank", doc=rank_doc),
        i64("timeoutNs", doc="spin-wait bound in ns"),
    ]


def phase_suffix(phase: EpPhase) -> str:
    """The entry-name mark of a kernel's phase, for both families: none for the whole leg (its names
    stay what they were before the split existed), ``_send`` or ``_recv`` for a half."""
    return "" if phase == EpPhase.Whole else f"_{phase.name.lower()}"


def halves(cfgs: Sequence, phase: EpPhase, split: bool) -> tuple:
    """Per bucket, a leg's Cfg (``cfgs``: intranode EpCfg or internode EpNetCfg) for one half of the
    split legs: the whole leg's Cfg with ``phase``; empty when the op has no split legs."""
    return tuple(dataclasses.replace(c, phase=phase) for c in cfgs) if split else ()
