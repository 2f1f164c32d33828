"""mori's v1 config (``mori.ops.EpDispatchCombineConfig``) and its meaning on mori-jit's op.

The fields are mori's, in mori's order (engines build the config with keywords, and SGLang keeps
only the keywords ``dataclasses.fields`` lists). :func:`to_ep_config` is the whole translation:

* ``kernel_type`` -> intranode or an internode family (:data:`INTERNODE_FAMILY`); ``AsyncLL`` is
  refused by name (its send/receive split is not built);
* ``data_type`` -> the dispatch dtype; the combine dtype is fixed here at construction (mori takes
  it from each combine's input): ``data_type`` when it can be summed (bf16, fp32), else bf16, what
  the engines' experts return. An fp4 dispatch is refused: mori counts ``hidden_dim`` in values on
  both legs, mori-jit's op has one row width of ``hidden_dim`` elements of each leg's dtype;
* ``scale_dim``/``scale_type_size`` -> the forwarded scales (none when ``scale_dim`` is 0, as mori
  reads them); ``quant_type`` -> ``quant_type`` (the combine wire's, refused by a backend that does
  not serve it); ``max_total_recv_tokens`` and ``gpu_per_node`` as they are;
* the local expert counts (``call_local_expert_count``) are on for intranode ops;
* ``block_num``, ``warp_num_per_block``, ``rdma_block_num``, ``num_qp_per_pe``,
  ``max_token_type_size``, ``use_external_inp_buf`` (combine's default) are mori's launch and
  staging choices for its AMD kernels: mori-jit's tuning table chooses the geometry (as mori's
  own tuning rules override these), and its buffers are sized from the dtypes.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch

from mori_jit.ops.ep import EpArgumentTypeError, EpDispatchCombineConfig as EpConfig, EpUnsupportedError
from mori_jit.ops.ep.config_rules import COMBINE_DTYPES

__all__ = ["EpDispatchCombineKernelType", "EpDispatchCombineConfig", "INTERNODE_FAMILY", "to_ep_config"]


class EpDispatchCombineKernelType(enum.Enum):
    """mori's v1 kernel types (values as mori numbers them)."""

    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5

    def __str__(self) -> str:
        return self.name


_K = EpDispatchCombineKernelType
#: kernel type -> the internode family that serves it (None: intranode); a type not here is refused
INTERNODE_FAMILY = {_K.IntraNode: None, _K.IntraNodeLL: None, _K.InterNode: "v2", _K.InterNodeV1: "v2",
                    _K.InterNodeV1LL: "v2_ll"}


@dataclasses.dataclass
class EpDispatchCombineConfig:
    """mori's v1 op config (the fields engines pass; meaning on mori-jit: the module's doc)."""

    data_type: torch.dtype
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"


def _kernel_type(value) -> EpDispatchCombineKernelType:
    """``value`` as a kernel type: a member, its name or its number."""
    if isinstance(value, _K):
        return value
    try:
        return _K[value] if isinstance(value, str) else _K(value)
    except (KeyError, ValueError):
        raise EpArgumentTypeError(f"kernel_type={value!r}: allowed {', '.join(k.name for k in _K)} "
                                  f"(mori.ops.EpDispatchCombineKernelType)") from None


def _combine_quant(value) -> str:
    """mori's ``quant_type`` as its name (mori takes names in any case, or its enum)."""
    name = getattr(value, "name", value)
    return name.strip().lower() if isinstance(name, str) else name


def to_ep_config(config: EpDispatchCombineConfig, kernel_backend: Optional[str] = None) -> EpConfig:
    """The config of mori-jit's op that serves mori's v1 ``config`` (the module's doc says how each
    field maps); refuses by name what it cannot serve."""
    if not isinstance(config, EpDispatchCombineConfig):
        raise EpArgumentTypeError(f"config: expected a mori.ops.EpDispatchCombineConfig, got {type(config).__name__}")
    kind = _kernel_type(config.kernel_type)
    if kind not in INTERNODE_FAMILY:
        raise EpUnsupportedError(f"kernel_type={kind.name}: its dispatch and combine are split into send and "
                                 f"receive halves (dispatch_send/dispatch_recv), and that split is not built in "
                                 f"mori-jit yet; served: {', '.join(k.name for k in INTERNODE_FAMILY)}")
    family = INTERNODE_FAMILY[kind]
    dtype = config.data_type
    if dtype == getattr(torch, "float4_e2m1fn_x2", None):
        raise EpUnsupportedError(f"data_type={dtype}: mori counts hidden_dim in values on both legs, and mori-jit's "
                                 f"op moves rows of hidden_dim elements of each leg's dtype, so an fp4 dispatch "
                                 f"cannot pair with the bf16 combine of the same tokens")
    legs = dict(data_type=dtype) if dtype in COMBINE_DTYPES else \
        dict(dispatch_data_type=dtype, combine_data_type=torch.bfloat16)
    intranode = family is None or config.gpu_per_node >= config.world_size
    return EpConfig(
        rank=config.rank, world_size=config.world_size, hidden_dim=config.hidden_dim,
        max_num_inp_token_per_rank=config.max_num_inp_token_per_rank,
        num_experts_per_rank=config.num_experts_per_rank, num_experts_per_token=config.num_experts_per_token,
        scale_dim=config.scale_dim, scale_type_size=config.scale_type_size if config.scale_dim else 0,
        quant_type=_combine_quant(config.quant_type), max_total_recv_tokens=config.max_total_recv_tokens,
        gpu_per_node=config.world_size if family is None else config.gpu_per_node,
        internode_kernel=family or "auto", expert_counts=intranode, kernel_backend=kernel_backend, **legs)
