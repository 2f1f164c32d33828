"""The rules of the config fields a MoE layer sets around the transfer (docs/design.md §6, "MoE
outputs"): per-token scales, in-op quantization, the expert ids' dtype, local expert counts, the
expert-major layout and routing replay. Which backend serves them is each backend's gate."""
from __future__ import annotations

import torch

from .quant import quant_config_errors

__all__ = ["INDEX_DTYPES", "SCALE_TYPE_SIZES", "moe_field_errors"]

#: dtypes of the expert ids dispatch accepts (transformers and DeepEP produce int64)
INDEX_DTYPES = (torch.int32, torch.int64)
#: bytes of one per-token scale: UE8M0/e8m0 bytes, 16-bit, float32, 64-bit
SCALE_TYPE_SIZES = (1, 2, 4, 8)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def moe_field_errors(cfg) -> list[str]:
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
    return errors + quant_config_errors(cfg)
