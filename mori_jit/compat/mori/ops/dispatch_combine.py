"""``mori.ops.dispatch_combine``: mori's v1 op (``EpDispatchCombineOp(config)``) on mori-jit's op.

The calls keep mori's positional signatures and meanings; each forwards to mori-jit's op
(:class:`mori_jit.ops.ep.EpDispatchCombineOp`, built from :func:`.v1_config.to_ep_config` on the
group :func:`..groups.v1_group` gives). Where mori's v1 and mori-jit differ:

* ``scales`` are read only when the config declares ``scale_dim`` (mori's rule; an empty tensor is
  fine), combine's ``weights`` only when they have rows;
* ``combine`` returns ``[n, hidden]`` (mori: a view of ``[max_num_inp_token_per_rank, hidden]``;
  the engines slice ``[:n]`` either way) and never weights ``input``;
* ``dispatch_send`` / ``combine_send`` are the whole leg, and ``dispatch_recv`` / ``combine_recv``
  have nothing left to do (mori splits only AsyncLL, which is refused at construction);
* ``reset()`` is collective (every rank calls it) and waits for the device; no step needs it.
"""
from __future__ import annotations

from typing import Optional

import torch

from mori_jit.compat.mori import groups
from mori_jit.compat.mori.ops.v1_config import EpDispatchCombineConfig, EpDispatchCombineKernelType, to_ep_config
from mori_jit.ops.ep import EpDispatchCombineOp as _EpOp

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineKernelType", "EpDispatchCombineOp"]


class EpDispatchCombineOp:
    """mori's v1 op: collective to construct (every rank of the group, in the same order)."""

    def __init__(self, config: EpDispatchCombineConfig):
        #: mori's v1 config, as given
        self.config = config
        #: the config of mori-jit's op that serves it
        self.cfg = to_ep_config(config)
        #: mori-jit's op
        self.ep_op = _EpOp(self.cfg, groups.v1_group())

    # -- dispatch ------------------------------------------------------------------------------
    def dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                 indices: torch.Tensor, block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1,
                 call_local_expert_count: bool = False, *, routing=None, return_routing: bool = False):
        """``(out, out_weights, out_scales, out_indices, total_recv)`` (+ routing); mori-jit's
        ``dispatch`` with mori's positional geometry and local expert counts."""
        return self.ep_op.dispatch(input, weights, scales if self.config.scale_dim else None, indices,
                                   routing=routing, return_routing=return_routing,
                                   call_local_expert_count=call_local_expert_count, block_num=block_num,
                                   rdma_block_num=rdma_block_num, warp_per_block=warp_per_block)

    def dispatch_send(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                      indices: torch.Tensor, block_num: int = -1, warp_per_block: int = -1,
                      call_local_expert_count: bool = False):
        """The whole dispatch (mori's send half of a split the served kernel types do not have)."""
        return self.dispatch(input, weights, scales, indices, block_num=block_num, warp_per_block=warp_per_block,
                             call_local_expert_count=call_local_expert_count)

    def dispatch_recv(self, block_num: int = -1, warp_per_block: int = -1,
                      call_local_expert_count: bool = False) -> None:
        """Nothing left to do: :meth:`dispatch_send` received the rows (and counted, where asked)."""

    # -- combine -------------------------------------------------------------------------------
    def combine(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: Optional[torch.Tensor],
                block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1,
                use_external_inp_buf: int = -1, call_reset: bool = False, *, routing=None):
        """``(out [n, hidden], out_weights | None)``: mori-jit's ``combine`` (the latest dispatch's
        routing; ``indices`` unused) with mori's positional options."""
        if weights is not None and weights.shape[0] == 0:
            weights = None  # (mori: weights without rows ask for no weights)
        return self.ep_op.combine(input, weights, indices, routing=routing, block_num=block_num,
                                  rdma_block_num=rdma_block_num, warp_per_block=warp_per_block,
                                  use_external_inp_buf=use_external_inp_buf, call_reset=call_reset)

    def combine_send(self, input: torch.Tensor, weights: Optional[torch.Tensor], indices: Optional[torch.Tensor],
                     block_num: int = -1, warp_per_block: int = -1):
        """The whole combine (mori's send half of a split the served kernel types do not have)."""
        return self.combine(input, weights, indices, block_num=block_num, warp_per_block=warp_per_block)

    def combine_recv(self, block_num: int = -1, warp_per_block: int = -1) -> None:
        """Nothing left to do: :meth:`combine_send` returned the sums."""

    # -- what the engines read -----------------------------------------------------------------
    @property
    def local_expert_count(self) -> torch.Tensor:
        """int32 ``[num_experts_per_rank]`` on the device: the latest dispatch's pairs per local expert."""
        return self.ep_op.local_expert_count

    @property
    def backend_name(self) -> str:
        """The mori-jit backend serving the op (``"hip"`` or ``"torch"``)."""
        return self.ep_op.backend_name

    def get_registered_combine_input_buffer(self, dtype: torch.dtype, hidden_dim: int = -1) -> torch.Tensor:
        """``[max_num_tokens_to_recv(), hidden_dim]`` of the combine dtype, the same tensor every call."""
        return self.ep_op.get_registered_combine_input_buffer(dtype, hidden_dim)

    def max_num_tokens_to_recv(self) -> int:
        """Rows of the receive buffer (``cfg.recv_capacity``)."""
        return self.cfg.recv_capacity

    def max_num_tokens_to_recv_per_rank(self) -> int:
        """Rows one source rank can send here: ``max_num_inp_token_per_rank``."""
        return self.cfg.max_num_inp_token_per_rank

    # -- lifecycle -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the error a kernel recorded, if any (mori-jit's ``check``)."""
        self.ep_op.check()

    def reset(self) -> None:
        """Collective: wait for the device and clear the op's state on every rank."""
        self.ep_op.reset()

    def close(self) -> None:
        """Collective: release the op's memory."""
        self.ep_op.close()

    def __enter__(self) -> "EpDispatchCombineOp":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.ep_op.__exit__(exc_type, exc, tb)
