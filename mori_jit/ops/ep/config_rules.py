"""The allowed values of each ``EpDispatchCombineConfig`` field and the rules between fields: one
place validates a config (:func:`check_config`, run at construction). Every error names the field,
the value and what is allowed. Which backend serves a valid config is each backend's gate."""
from __future__ import annotations

from typing import Any

import torch

from mori_jit.jit.fields import CPP_INT_RANGE
from mori_jit.ops.ep.contract import ROW_ALIGN
from mori_jit.ops.ep.errors import EpConfigError
from mori_jit.ops.ep.quant import COMBINE_QUANT_TYPES, DISPATCH_QUANT_TYPES, quant_config_errors

__all__ = ["check_config", "DISPATCH_DTYPES", "COMBINE_DTYPES", "BACKENDS", "DEFAULT_BACKEND", "INTERNODE_KERNELS",
           "SYMM_MEMORY_KINDS", "INDEX_DTYPES", "SCALE_TYPE_SIZES"]

#: dtypes each leg can carry (fp8/fp4 are moved as bytes; only bf16/fp32 can be summed)
DISPATCH_DTYPES = tuple(t for t in (torch.bfloat16, torch.float32, getattr(torch, "float8_e4m3fn", None),
                                    getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float4_e2m1fn_x2", None),
                                    torch.uint8) if t is not None)
COMBINE_DTYPES = (torch.bfloat16, torch.float32)
BACKENDS = ("hip", "torch")
DEFAULT_BACKEND = "hip"
#: the internode kernel families: ``v2`` (throughput, hierarchical), ``v2_ll`` (low latency), or
#: ``auto`` (both built; each launch picks by its token count)
INTERNODE_KERNELS = ("auto", "v2", "v2_ll")
#: Values of ``symm_memory``.
SYMM_MEMORY_KINDS = ("auto", "torch", "ipc")
#: dtypes of the expert ids dispatch accepts (transformers and DeepEP produce int64)
INDEX_DTYPES = (torch.int32, torch.int64)
#: bytes of one per-token scale: UE8M0/e8m0 bytes, 16-bit, float32, 64-bit
SCALE_TYPE_SIZES = (1, 2, 4, 8)


def check_config(cfg) -> None:
    """Raise :class:`~mori_jit.ops.ep.errors.EpConfigError` for the first field of ``cfg`` that breaks a rule."""
    _int("world_size", cfg.world_size, 1)
    _int("rank", cfg.rank)
    if cfg.rank >= cfg.world_size:
        raise EpConfigError(f"EpDispatchCombineConfig.rank={cfg.rank}: expected 0 <= rank < world_size={cfg.world_size}")
    for f in ("hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank", "num_experts_per_token",
              "gpu_per_node"):
        _int(f, getattr(cfg, f), 1)
    for f in ("scale_dim", "scale_type_size", "max_total_recv_tokens", "combine_scale_type_size"):
        _int(f, getattr(cfg, f), 0)
    for f in ("dispatch_block_num", "combine_block_num", "warp_num_per_block", "combine_warp_num_per_block"):
        _opt_int(f, getattr(cfg, f))
    if not (cfg.combine_low_latency is None or isinstance(cfg.combine_low_latency, bool)):
        raise EpConfigError(f"EpDispatchCombineConfig.combine_low_latency={cfg.combine_low_latency!r}: "
                         f"expected None (by max_num_inp_token_per_rank), True or False")
    if (cfg.dispatch_data_type is None) != (cfg.combine_data_type is None):
        raise EpConfigError("EpDispatchCombineConfig: dispatch_data_type and combine_data_type are set together "
                         f"(got {cfg.dispatch_data_type} and {cfg.combine_data_type})")
    if cfg.dispatch_dtype not in DISPATCH_DTYPES:
        raise EpConfigError(f"EpDispatchCombineConfig.dispatch dtype {cfg.dispatch_dtype}: allowed {list(DISPATCH_DTYPES)}")
    if cfg.combine_dtype not in COMBINE_DTYPES:
        raise EpConfigError(f"EpDispatchCombineConfig.combine dtype {cfg.combine_dtype}: combine sums, so it must be "
                         f"one of {list(COMBINE_DTYPES)} (byte dtypes can be dispatched, not combined)")
    if cfg.combine_mode not in ("gather", "scatter"):
        raise EpConfigError(f"EpDispatchCombineConfig.combine_mode={cfg.combine_mode!r}: allowed 'gather', 'scatter'")
    if cfg.max_total_recv_tokens and cfg.max_total_recv_tokens < cfg.world_size * cfg.max_num_inp_token_per_rank:
        raise EpConfigError(f"EpDispatchCombineConfig.max_total_recv_tokens={cfg.max_total_recv_tokens}: must be 0 or "
                         f">= world_size*max_num_inp_token_per_rank = "
                         f"{cfg.world_size * cfg.max_num_inp_token_per_rank} (the worst case)")
    _one_of("symm_memory", cfg.symm_memory, SYMM_MEMORY_KINDS)
    _one_of("internode_kernel", cfg.internode_kernel, INTERNODE_KERNELS)
    _int("internode_auto_ll_max_tokens", cfg.internode_auto_ll_max_tokens, 1)
    if not _is_bool(cfg.split_send_recv):
        raise EpConfigError(f"EpDispatchCombineConfig.split_send_recv={cfg.split_send_recv!r}: expected True or False")
    if cfg.kernel_backend is not None:
        _one_of("kernel_backend", cfg.kernel_backend, BACKENDS)
    if cfg.schedule is not None:
        _check_schedule(cfg.schedule)
    moe_errors = _moe_field_errors(cfg)
    if moe_errors:
        raise EpConfigError("; ".join(f"EpDispatchCombineConfig.{e}" for e in moe_errors))
    _check_kernel_rules(cfg)


_BUCKET = "(max_tokens | None, dispatch_blocks, dispatch_warps, combine_blocks, combine_warps)"


def _check_schedule(schedule: Any) -> None:
    """``schedule``: a non-empty list or tuple of buckets :data:`_BUCKET`, counts ints >= 1, the
    max_tokens edges ascending and only the last one None (it takes every larger call)."""
    what = (f"expected a non-empty list of buckets {_BUCKET} of ints >= 1, max_tokens ascending and None in the "
            f"last bucket only")
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise EpConfigError(f"EpDispatchCombineConfig.schedule={schedule!r}: {what}")
    edges = []
    for b in schedule:
        if (not isinstance(b, (list, tuple)) or len(b) != 5 or not all(_is_count(v) for v in b[1:])
                or not (b[0] is None or _is_count(b[0]))):
            raise EpConfigError(f"EpDispatchCombineConfig.schedule bucket {b!r}: expected {_BUCKET}, ints >= 1")
        edges.append(b[0])
    finite = edges[:-1]
    if edges[-1] is not None or None in finite or any(a >= b for a, b in zip(finite, finite[1:])):
        raise EpConfigError(f"EpDispatchCombineConfig.schedule={schedule!r}: max_tokens {edges}: {what}")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= CPP_INT_RANGE[1]


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise EpConfigError(f"EpDispatchCombineConfig.{name}={value!r}: allowed {allowed}")


def _int(name: str, value: Any, lo: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise EpConfigError(f"EpDispatchCombineConfig.{name}={value!r}: expected an int >= {lo}")


def _opt_int(name: str, value: Any, lo: int = 1) -> None:
    if value is not None:
        _int(name, value, lo)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _moe_field_errors(cfg) -> list[str]:
    """What is wrong with ``cfg``'s MoE fields, each naming the field, its value and what is allowed."""
    errors = []
    if cfg.index_dtype not in INDEX_DTYPES:
        errors.append(f"index_dtype={cfg.index_dtype}: allowed {', '.join(map(str, INDEX_DTYPES))}")
    for f in ("expert_counts", "routing_replay"):
        if not _is_bool(getattr(cfg, f)):
            errors.append(f"{f}={getattr(cfg, f)!r}: expected True or False")
    cap = cfg.expert_capacity
    if _is_bool(cap) or not isinstance(cap, int) or cap < 0:
        errors.append(f"expert_capacity={cap!r}: expected an int >= 0 (0: no expert-major layout)")
    elif cap and cfg.expert_counts is not True:
        errors.append(f"expert_capacity={cap} lays tokens out by expert, valid up to each expert's count: "
                      f"set expert_counts=True with it")
    if bool(cfg.scale_dim) != bool(cfg.scale_type_size):
        errors.append(f"scale_dim={cfg.scale_dim} and scale_type_size={cfg.scale_type_size}: set together "
                      f"(both 0: no scales)")
    elif cfg.scale_type_size and cfg.scale_type_size not in SCALE_TYPE_SIZES:
        errors.append(f"scale_type_size={cfg.scale_type_size}: allowed {SCALE_TYPE_SIZES} (bytes per scale)")
    # (a name is looked up in a dict: anything but a name is refused before the lookup)
    if cfg.dispatch_quant_type is not None and not isinstance(cfg.dispatch_quant_type, str):
        return errors + [f"dispatch_quant_type={cfg.dispatch_quant_type!r}: expected None or a name: allowed None, "
                         f"'none', {', '.join(map(repr, DISPATCH_QUANT_TYPES))}"]
    if cfg.quant_type is not None and not isinstance(cfg.quant_type, str):  # (None: refused by quant_config_errors)
        return errors + [f"quant_type={cfg.quant_type!r}: expected a name: the combine wire's quantization, mori's "
                         f"values: {', '.join(map(repr, COMBINE_QUANT_TYPES))}"]
    return errors + quant_config_errors(cfg)


def _check_kernel_rules(cfg) -> None:
    """The rules of the data the kernels move, applied by every backend (a config one backend takes,
    all take): each count, and each product of counts the kernels compute, fits the kernels' C++
    int, a token row is whole vectors of ``ROW_ALIGN`` bytes on both legs, and top-k picks that
    many distinct experts."""
    hi = CPP_INT_RANGE[1]
    for f in ("world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
              "num_experts_per_token", "max_total_recv_tokens", "scale_dim", "scale_type_size", "expert_capacity",
              "gpu_per_node", "internode_auto_ll_max_tokens", "dispatch_block_num", "combine_block_num",
              "warp_num_per_block", "combine_warp_num_per_block"):
        if (getattr(cfg, f) or 0) > hi:
            raise EpConfigError(f"EpDispatchCombineConfig.{f}={getattr(cfg, f)}: above {hi}, the largest C++ int "
                                f"the kernels take")
    for leg, dtype in (("dispatch", cfg.dispatch_dtype), ("combine", cfg.combine_dtype)):
        row = cfg.hidden_dim * dtype.itemsize  # (fp4x2's hidden_dim counts its bytes)
        if row % ROW_ALIGN:
            raise EpConfigError(f"EpDispatchCombineConfig.hidden_dim={cfg.hidden_dim}: a {leg} row of {dtype} is "
                                f"{row} bytes, not a multiple of {ROW_ALIGN} (rows move as {ROW_ALIGN}-byte "
                                f"vectors); use a hidden_dim that makes it one")
    _check_products(cfg, hi)
    if cfg.num_experts_per_token > cfg.num_experts:
        raise EpConfigError(f"EpDispatchCombineConfig.num_experts_per_token={cfg.num_experts_per_token}: more than the "
                         f"{cfg.num_experts} experts (num_experts_per_rank={cfg.num_experts_per_rank} x "
                         f"world_size={cfg.world_size}); top-k picks distinct experts")


def _check_products(cfg, hi: int) -> None:
    """Each product of fields that a kernel computes in a C++ int (a constexpr of the generated
    headers, or an index) must fit one: beyond it the constexpr is no constant (nvcc: "expression
    must have a constant value") or the value wraps (num_experts_per_rank=2**30 at 2 ranks makes
    the expert count INT_MIN, and every id is dropped). Byte offsets into the buffers are 64-bit
    (``size_t``) in the kernels, so the buffers' sizes are not bounded here."""
    E, ws, M, k = cfg.num_experts_per_rank, cfg.world_size, cfg.max_num_inp_token_per_rank, cfg.num_experts_per_token
    recv = "max_total_recv_tokens" if cfg.max_total_recv_tokens else "(world_size*max_num_inp_token_per_rank)"
    products = [
        ("num_experts_per_rank*world_size", E * ws, "experts in all: the range of the expert ids"),
        ("world_size*max_num_inp_token_per_rank", ws * M, "the receive capacity and the source ids rank*M + token"),
        (f"world_size*{recv}", ws * cfg.recv_capacity, "the flat receive index rank*capacity + row"),
        (f"{recv}*num_experts_per_token", cfg.recv_capacity * k, "the received (row, top-k slot) pairs"),
        *[(f"hidden_dim*{dtype.itemsize}", cfg.hidden_dim * dtype.itemsize, f"the bytes of a {leg} row of {dtype}")
          for leg, dtype in (("dispatch", cfg.dispatch_dtype), ("combine", cfg.combine_dtype))],
        ("scale_dim*scale_type_size", cfg.scale_dim * cfg.scale_type_size, "the bytes of a token's scales"),
        ("3*num_experts_per_rank*expert_capacity", 3 * E * cfg.expert_capacity,
         "the expert-major layout's three int32 maps, addressed from one pointer"),
    ]
    for expr, value, what in products:
        if value > hi:
            raise EpConfigError(f"EpDispatchCombineConfig: {expr} = {value} ({what}) is above {hi}, the largest C++ "
                                f"int the kernels compute it in; lower one of those fields")
