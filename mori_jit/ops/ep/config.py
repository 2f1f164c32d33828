"""``EpDispatchCombineConfig``: what a user asks of the EP op (mirrors mori's v2 op config).

Validation happens at construction and names the field, the value and what is allowed. Which of
the valid configs a *backend* can serve is the backend's capability gate (``_unsupported``), run by
the op before any allocation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from mori_jit.ops.ep import knobs

from mori_jit.ops.ep.config_rules import (BACKENDS, COMBINE_DTYPES, DEFAULT_BACKEND, DISPATCH_DTYPES, INDEX_DTYPES,
                                          INTERNODE_KERNELS, SCALE_TYPE_SIZES, SYMM_MEMORY_KINDS, check_config)
from mori_jit.ops.ep.quant import quant_spec
from mori_jit.ops.ep.errors import EpConfigError

__all__ = ["EpDispatchCombineConfig", "DISPATCH_DTYPES", "COMBINE_DTYPES", "BACKENDS", "DEFAULT_BACKEND",
           "INTERNODE_KERNELS", "SYMM_MEMORY_KINDS",
           "INDEX_DTYPES", "SCALE_TYPE_SIZES"]

#: Field metadata of what may differ between the ranks of one op: the rank, and the geometry (each
#: rank sizes its grids for itself). Every other field must be equal on every rank (compared at
#: construction).
PER_RANK = {"per_rank": True}
#: Field metadata of the options a MoE layer sets around the transfer (rules: :mod:`.config_rules`).
MOE_OPTION = {"moe_option": True}



@dataclasses.dataclass(frozen=True)
class EpDispatchCombineConfig:
    """Config of one EP dispatch/combine op (mori's ``EpDispatchCombineConfig`` of its v2 op).

    Every field is checked at construction; an error names the field, the value and what is
    allowed (:class:`~mori_jit.ops.ep.errors.EpConfigError`). Which valid configs a *backend* can
    serve is the backend's gate, run by the op before any allocation. ``rank`` and the geometry
    fields (``PER_RANK`` metadata) may differ between ranks; every other field must be the same on
    every rank of the group (compared at construction). Semantics: docs/design.md §6; every call
    and its shapes: docs/api.md.
    """

    #: This process's rank in the op's group, ``0 <= rank < world_size``.
    rank: int = dataclasses.field(metadata=PER_RANK)
    #: Ranks in the op's group (every rank holds ``num_experts_per_rank`` experts).
    world_size: int
    #: Elements per token row of the dispatch dtype (bytes for fp4x2, which packs two e2m1 per byte).
    hidden_dim: int
    #: Most tokens one rank passes to one ``dispatch`` (``M``); sizes the receive buffer.
    max_num_inp_token_per_rank: int
    #: Experts on each rank (``E``); expert ``e`` lives on rank ``e // E``.
    num_experts_per_rank: int
    #: Experts each token is routed to (top-k, ``k``): the columns of ``indices`` and ``weights``.
    num_experts_per_token: int
    #: Dtype of both legs' rows, unless ``dispatch_data_type``/``combine_data_type`` are set.
    data_type: torch.dtype = torch.bfloat16
    #: Dtype dispatch moves (bf16, fp32, fp8, fp4x2, uint8); set together with ``combine_data_type``.
    dispatch_data_type: Optional[torch.dtype] = None
    #: Dtype combine reads and returns (bf16 or fp32: combine sums); set with ``dispatch_data_type``.
    combine_data_type: Optional[torch.dtype] = None
    #: Per-token scales forwarded with their rows: scales per token (0: none; set with ``scale_type_size``).
    scale_dim: int = dataclasses.field(default=0, metadata=MOE_OPTION)
    #: Bytes of one scale: 1 (UE8M0), 2, 4 (fp32) or 8 (0: none; set with ``scale_dim``).
    scale_type_size: int = dataclasses.field(default=0, metadata=MOE_OPTION)
    #: mori's combine mode; ``"gather"`` or ``"scatter"`` (both run the push combine here).
    combine_mode: str = "gather"
    #: mori's field: the combine wire's quantization, mori's values (:data:`.quant.COMBINE_QUANT_TYPES`:
    #: ``"none"``, ``"fp8_direct_cast"``, ``"fp8_blockwise"``, ...; the numerics: :mod:`.quant`). A
    #: backend refuses at construction, by name, the values it does not serve (the fp4 ones).
    quant_type: str = "none"
    #: Bytes of one block scale of ``quant_type="fp8_blockwise"``: 4 (float32) or 1 (UE8M0), as
    #: ``scale_type_size`` is for the dispatch cast; unused by the other values.
    combine_scale_type_size: int = 4
    #: The cast of the dispatch payload in the op (:mod:`.quant`): None/``"none"``, or
    #: ``"fp8_e4m3_block128"`` (bf16 in, e4m3 rows and per-128-block scales out).
    dispatch_quant_type: Optional[str] = dataclasses.field(default=None, metadata=MOE_OPTION)
    #: Dispatch blocks per launch (None: the backend's tuning table).
    dispatch_block_num: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    #: Combine blocks per launch (None: the tuning table).
    combine_block_num: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    #: Warps per dispatch block (None: the tuning table).
    warp_num_per_block: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    #: Warps per combine block (None: the tuning table).
    combine_warp_num_per_block: Optional[int] = dataclasses.field(default=None, metadata=PER_RANK)
    #: Replaces the tuning table: buckets ``(max_tokens_inclusive | None, dispatch_blocks,
    #: dispatch_warps, combine_blocks, combine_warps)``, ascending, the last one ``None``.
    schedule: Optional[Sequence[tuple]] = dataclasses.field(default=None, metadata=PER_RANK)
    #: Receive-buffer rows (0: the worst case ``world_size * max_num_inp_token_per_rank``).
    max_total_recv_tokens: int = 0
    #: Ranks per node; ``gpu_per_node < world_size`` makes the op internode (NVSHMEM).
    gpu_per_node: int = 8
    #: ``"hip"`` (the JIT kernels, AMD and NVIDIA) or ``"torch"`` (torch.distributed collectives);
    #: None: ``MORI_EP_KERNEL_BACKEND``, else ``"hip"``.
    kernel_backend: Optional[str] = None
    #: The combine pushes rows whose every 32-bit word is its own arrival signal (no fence, no flag
    #: per token range): wins at small batches, loses at large. None: on when
    #: ``max_num_inp_token_per_rank`` is at most the backend's threshold, on NVIDIA GPUs.
    combine_low_latency: Optional[bool] = None
    #: What backs the symmetric arena: ``"torch"`` (torch symmetric memory), ``"ipc"`` (CUDA/HIP IPC
    #: of a plain allocation, one host) or ``"auto"`` (torch unless ranks share a device or it is
    #: unusable, then ipc).
    symm_memory: str = "auto"
    #: Internode family: ``"v2"`` (a token crosses the network once per destination node and is
    #: forwarded inside it), ``"v2_ll"`` (straight to every destination rank) or ``"auto"`` (both
    #: built; a call of at most ``internode_auto_ll_max_tokens`` tokens takes ``v2_ll``).
    internode_kernel: str = "auto"
    #: ``internode_kernel="auto"``'s switch point, in tokens per call (every rank of one call must
    #: be on the same side: the families speak different protocols).
    internode_auto_ll_max_tokens: int = 512
    #: Dtype of the expert ids dispatch takes and returns: int32 or int64 (what models produce).
    index_dtype: torch.dtype = dataclasses.field(default=torch.int32, metadata=MOE_OPTION)
    #: Dispatch also counts the received (token, expert) pairs per local expert (int32 ``[E]``).
    expert_counts: bool = dataclasses.field(default=False, metadata=MOE_OPTION)
    #: Rows per local expert of the expert-major layout ``[E, C, H]`` (0: no layout; needs
    #: ``expert_counts``); a pair beyond it raises :class:`~.errors.EpCapacityError`.
    expert_capacity: int = dataclasses.field(default=0, metadata=MOE_OPTION)
    #: ``dispatch(routing=...)`` resends new rows along an earlier dispatch's routing.
    routing_replay: bool = dataclasses.field(default=False, metadata=MOE_OPTION)
    #: Each leg also runs as a send and a receive, to overlap its exchange with other work
    #: (``dispatch_send``/``dispatch_recv``, ``combine_send``/``combine_recv``, ``return_recv_hook=True``;
    #: :mod:`.core.overlap`): the ``hip`` backend builds those kernels too.
    split_send_recv: bool = False

    def __post_init__(self):
        check_config(self)

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
        """The dtype dispatch takes: the cast's input under ``dispatch_quant_type``, else the dispatch dtype."""
        spec = quant_spec(self.dispatch_quant_type)
        return spec.input_dtype if spec is not None else self.dispatch_dtype

    @property
    def recv_capacity(self) -> int:
        """Rows of the receive buffer (= the flat-index stride)."""
        return self.max_total_recv_tokens or self.world_size * self.max_num_inp_token_per_rank

    @property
    def effective_max_recv(self) -> int:
        """mori's name of :attr:`recv_capacity` (engines read it to bound the rows they process)."""
        return self.recv_capacity

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
        """``kernel_backend`` → ``MORI_EP_KERNEL_BACKEND`` → ``hip``."""
        name = self.kernel_backend or knobs.ep.kernel_backend or DEFAULT_BACKEND
        if name not in BACKENDS:
            raise EpConfigError(f"MORI_EP_KERNEL_BACKEND={name!r}: allowed {BACKENDS}")
        return name
