"""``EpDispatchCombineConfig``: what a user asks of the EP op (mirrors mori's v2 op config).

Validation happens at construction and names the field, the value and what is allowed. Which of
the valid configs a *backend* can serve is the backend's capability gate (``_unsupported``), run by
the op before any allocation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from . import knobs

from .config_moe import moe_field_errors
from .peers import SYMM_MEMORY_KINDS
from .quant import quant_spec

__all__ = ["EpDispatchCombineConfig", "DISPATCH_DTYPES", "COMBINE_DTYPES", "BACKENDS", "DEFAULT_BACKEND",
           "INTERNODE_KERNELS"]

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


#: Field metadata of what may differ between the ranks of one op: the rank, and the geometry (each
#: rank sizes its grids for itself). Every other field must be equal on every rank (compared at
#: construction).
PER_RANK = {"per_rank": True}
#: Field metadata of the options a MoE layer sets around the transfer (rules: :mod:`.config_moe`).
MOE_OPTION = {"moe_option": True}


def _int(name: str, value: Any, lo: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"EpDispatchCombineConfig.{name}={value!r}: expected an int >= {lo}")


def _opt_int(name: str, value: Any, lo: int = 1) -> None:
    if value is not None:
        _int(name, value, lo)


@dataclasses.dataclass(frozen=True)
class EpDispatchCombineConfig:
    """Config of one EP dispatch/combine op. See docs/design.md §6 for the semantics of each field.

    ``hidden_dim`` counts elements of the dispatch dtype (bytes for fp4x2, which packs two e2m1
    per byte). ``dispatch_data_type``/``combine_data_type`` select asymmetric legs and are set
    together; otherwise both legs use ``data_type``. Geometry pins left ``None`` come from the
    backend's tuning table. ``schedule`` (optional) replaces the table: a sequence of buckets
    ``(max_tokens_inclusive | None, dispatch_blocks, dispatch_warps, combine_blocks, combine_warps)``.
    ``combine_low_latency``: the combine pushes rows whose every 32-bit word is its own arrival
    signal (no fence and no flag per token range), which wins at small batches and loses at large
    ones; ``None`` turns it on when ``max_num_inp_token_per_rank`` is at most the backend's
    threshold (an op sized for decode batches), like DeepEP's separate low-latency mode, on NVIDIA
    GPUs (where it was measured; on AMD it is built only when asked for).
    ``rank`` and the geometry fields (``PER_RANK`` metadata) may differ between ranks; every
    other field must be the same on every rank of the group (compared at construction).
    ``symm_memory``: what backs the symmetric arena: ``"torch"`` (torch symmetric memory),
    ``"ipc"`` (CUDA/HIP IPC handles of a plain allocation, one host), or ``"auto"``: torch unless
    ranks share a device (which torch symmetric memory refuses) or it is unusable, then ipc.
    ``internode_kernel`` (when ``is_internode``): ``"v2"`` (throughput: a token crosses the network
    once per destination node and is forwarded inside it), ``"v2_ll"`` (low latency: straight to
    every destination rank), or ``"auto"``: both are built and a launch of at most
    ``internode_auto_ll_max_tokens`` tokens takes ``v2_ll``, a larger one ``v2`` (every rank of one
    call must be on the same side: the families speak different protocols).
    What a MoE layer asks around the transfer (docs/design.md §6, "MoE outputs"): ``scale_dim``/
    ``scale_type_size`` per-token scales (bytes per scale), ``quant_type`` in-op quantization
    (:mod:`.quant`), ``index_dtype`` the expert ids' dtype (int32 or int64), ``expert_counts``
    received pairs per local expert, ``expert_capacity`` the expert-major layout's rows per local
    expert (0 = none), ``routing_replay`` ``dispatch(routing=)``. Their rules: :mod:`.config_moe`.
    """

    rank: int = dataclasses.field(metadata=PER_RANK)
    world_size: int
    hidden_dim: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    data_type: torch.dtype = torch.bfloat16
    dispatch_data_type: Optional[torch.dtype] = None
    combine_data_type: Optional[torch.dtype] = None
    scale_dim: int = dataclasses.field(default=0, metadata=MOE_OPTION)
    scale_type_size: int = dataclasses.field(default=0, metadata=MOE_OPTION)
    combine_mode: str = "gather"
    quant_type: Optional[str] = dataclasses.field(default=None, metadata=MOE_OPTION)
    dispatch_block_num: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    combine_block_num: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    warp_num_per_block: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    combine_warp_num_per_block: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    schedule: Optional[Sequence[tuple]] = dataclasses.field(default=None, metadata=PER_RANK)
    max_total_recv_tokens: int = 0
    gpu_per_node: int = 8
    kernel_backend: Optional[str] = None
    combine_low_latency: Optional[bool] = None
    symm_memory: str = "auto"
    internode_kernel: str = "auto"
    internode_auto_ll_max_tokens: int = 512
    index_dtype: torch.dtype = dataclasses.field(default=torch.int32, metadata=MOE_OPTION)
    expert_counts: bool = dataclasses.field(default=False, metadata=MOE_OPTION)
    expert_capacity: int = dataclasses.field(default=0, metadata=MOE_OPTION)
    routing_replay: bool = dataclasses.field(default=False, metadata=MOE_OPTION)

    def __post_init__(self):
        _int("world_size", self.world_size, 1)
        _int("rank", self.rank)
        if self.rank >= self.world_size:
            raise ValueError(f"EpDispatchCombineConfig.rank={self.rank}: expected 0 <= rank < world_size={self.world_size}")
        for f in ("hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank", "num_experts_per_token",
                  "gpu_per_node"):
            _int(f, getattr(self, f), 1)
        for f in ("scale_dim", "scale_type_size", "max_total_recv_tokens"):
            _int(f, getattr(self, f), 0)
        for f in ("dispatch_block_num", "combine_block_num", "warp_num_per_block", "combine_warp_num_per_block"):
            _opt_int(f, getattr(self, f))
        if not (self.combine_low_latency is None or isinstance(self.combine_low_latency, bool)):
            raise ValueError(f"EpDispatchCombineConfig.combine_low_latency={self.combine_low_latency!r}: "
                             f"expected None (by max_num_inp_token_per_rank), True or False")
        if (self.dispatch_data_type is None) != (self.combine_data_type is None):
            raise ValueError("EpDispatchCombineConfig: dispatch_data_type and combine_data_type are set together "
                             f"(got {self.dispatch_data_type} and {self.combine_data_type})")
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(f"EpDispatchCombineConfig.dispatch dtype {self.dispatch_dtype}: allowed {list(DISPATCH_DTYPES)}")
        if self.combine_dtype not in COMBINE_DTYPES:
            raise ValueError(f"EpDispatchCombineConfig.combine dtype {self.combine_dtype}: combine sums, so it must be "
                             f"one of {list(COMBINE_DTYPES)} (byte dtypes can be dispatched, not combined)")
        if self.combine_mode not in ("gather", "scatter"):
            raise ValueError(f"EpDispatchCombineConfig.combine_mode={self.combine_mode!r}: allowed 'gather', 'scatter'")
        if self.max_total_recv_tokens and self.max_total_recv_tokens < self.world_size * self.max_num_inp_token_per_rank:
            raise ValueError(f"EpDispatchCombineConfig.max_total_recv_tokens={self.max_total_recv_tokens}: must be 0 or "
                             f">= world_size*max_num_inp_token_per_rank = "
                             f"{self.world_size * self.max_num_inp_token_per_rank} (the worst case)")
        if self.symm_memory not in SYMM_MEMORY_KINDS:
            raise ValueError(f"EpDispatchCombineConfig.symm_memory={self.symm_memory!r}: allowed {SYMM_MEMORY_KINDS}")
        if self.internode_kernel not in INTERNODE_KERNELS:
            raise ValueError(f"EpDispatchCombineConfig.internode_kernel={self.internode_kernel!r}: allowed "
                             f"{INTERNODE_KERNELS}")
        _int("internode_auto_ll_max_tokens", self.internode_auto_ll_max_tokens, 1)
        if self.kernel_backend is not None and self.kernel_backend not in BACKENDS:
            raise ValueError(f"EpDispatchCombineConfig.kernel_backend={self.kernel_backend!r}: allowed {BACKENDS}")
        if self.schedule is not None:
            for b in self.schedule:
                if len(b) != 5 or not all(isinstance(v, int) and v >= 1 for v in b[1:]) or \
                        not (b[0] is None or (isinstance(b[0], int) and b[0] >= 1)):
                    raise ValueError(f"EpDispatchCombineConfig.schedule bucket {b!r}: expected "
                                     f"(max_tokens|None, disp_blocks, disp_warps, comb_blocks, comb_warps), ints >= 1")
        moe_errors = moe_field_errors(self)
        if moe_errors:
            raise ValueError("; ".join(f"EpDispatchCombineConfig.{e}" for e in moe_errors))
        _check_kernel_rules(self)

    @property
    def dispatch_dtype(self) -> torch.dtype:
        """The dtype dispatch moves: ``dispatch_data_type``, else ``data_type``."""
        return self.dispatch_data_type or self.data_type

    @property
    def combine_dtype(self) -> torch.dtype:
        """The dtype combine reads and returns: ``combine_data_type``, else ``data_type``."""
        return self.combine_data_type or self.data_type

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype dispatch takes: the quantization's input under ``quant_type``, else the dispatch dtype."""
        spec = quant_spec(self.quant_type)
        return spec.input_dtype if spec is not None else self.dispatch_dtype

    @property
    def recv_capacity(self) -> int:
        """Rows of the receive buffer (= the flat-index stride)."""
        return self.max_total_recv_tokens or self.world_size * self.max_num_inp_token_per_rank

    @property
    def num_experts(self) -> int:
        """Experts over all ranks (the id range of ``indices``)."""
        return self.num_experts_per_rank * self.world_size

    @property
    def is_internode(self) -> bool:
        """Whether the group spans more than one node (``gpu_per_node < world_size``)."""
        return self.gpu_per_node < self.world_size

    def moe_options_in_use(self) -> list[str]:
        """``field=value`` of every MoE-layer option (``MOE_OPTION`` metadata) set to other than its
        default, in declaration order."""
        return [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if f.metadata.get("moe_option") and getattr(self, f.name) != f.default]

    def backend(self) -> str:
        """``kernel_backend`` → ``MORI_V2_KERNEL_BACKEND`` → ``hip``."""
        name = self.kernel_backend or knobs.ep.kernel_backend or DEFAULT_BACKEND
        if name not in BACKENDS:
            raise ValueError(f"MORI_V2_KERNEL_BACKEND={name!r}: allowed {BACKENDS}")
        return name


def _check_kernel_rules(cfg: EpDispatchCombineConfig) -> None:
    """The rules of the data the kernels move, applied by every backend (a config one backend takes,
    all take): each count fits the kernels' C++ int, a token row is whole vectors of
    ``EP_ROW_ALIGN`` bytes on both legs, and top-k picks that many distinct experts."""
    from types import SimpleNamespace

    from mori_jit.jit.fields import CPP_INT_RANGE

    from .kernel_cfg import EP_ROW_ALIGN, EpDType, EpTokenBytes
    hi = CPP_INT_RANGE[1]
    for f in ("world_size", "hidden_dim", "max_num_inp_token_per_rank", "num_experts_per_rank",
              "num_experts_per_token", "max_total_recv_tokens", "scale_dim", "scale_type_size", "expert_capacity"):
        if getattr(cfg, f) > hi:
            raise ValueError(f"EpDispatchCombineConfig.{f}={getattr(cfg, f)}: above {hi}, the largest C++ int "
                             f"the kernels take")
    for leg, dtype in (("dispatch", cfg.dispatch_dtype), ("combine", cfg.combine_dtype)):
        row = EpTokenBytes(SimpleNamespace(hiddenDim=cfg.hidden_dim, dtype=EpDType.coerce(dtype)))
        if row % EP_ROW_ALIGN:
            raise ValueError(f"EpDispatchCombineConfig.hidden_dim={cfg.hidden_dim}: a {leg} row of {dtype} is "
                             f"{row} bytes, not a multiple of {EP_ROW_ALIGN} (rows move as {EP_ROW_ALIGN}-byte "
                             f"vectors); use a hidden_dim that makes it one")
    if cfg.num_experts_per_token > cfg.num_experts:
        raise ValueError(f"EpDispatchCombineConfig.num_experts_per_token={cfg.num_experts_per_token}: more than the "
                         f"{cfg.num_experts} experts (num_experts_per_rank={cfg.num_experts_per_rank} x "
                         f"world_size={cfg.world_size}); top-k picks distinct experts")
