"""The EP op's accessors beside its calls, most of them named as mori's op API has them for the
serving engines (SGLang's and vLLM's mori backends; docs/mori_compat.md): the backend's name, the
local expert counts, the combine input buffer under both its names. :class:`MoriSurface` is a base
of the op; it reads only what the op's construction sets (``cfg``, ``_live()``, the latest
dispatch's state)."""
from __future__ import annotations

import torch

from mori_jit.ops.ep.core.call_options import check_buffer_request
from mori_jit.ops.ep.errors import EpStateError, EpUnsupportedError

__all__ = ["MoriSurface"]


class MoriSurface:
    """The op's accessors (the ``dispatch``/``combine`` arguments are the op's own)."""

    #: the latest dispatch's local expert counts (``cfg.expert_counts``), None before the first
    _counts = None
    #: backend name -> ``"module:Class"`` (the op's table of its backends)
    _backend_paths: dict = {}

    @property
    def backend_name(self) -> str:
        """The backend serving this op, ``"hip"`` or ``"torch"`` (mori's attribute; an engine that
        knows how a backend lays out the received rows reads it)."""
        names = {path: name for name, path in self._backend_paths.items()}
        for cls in type(self).__mro__:
            name = names.get(f"{cls.__module__}:{cls.__qualname__}")
            if name is not None:
                return name
        return type(self).__name__

    @property
    def local_expert_count(self) -> torch.Tensor:
        """int32 ``[num_experts_per_rank]`` on the op's device: the (token, local expert) pairs the
        latest dispatch received, per local expert (mori's name of the counts
        ``cfg.expert_counts`` makes; the same tensor as ``EpDispatchResult.expert_counts``). Every
        dispatch refreshes it, whether or not it passes ``call_local_expert_count=True``."""
        self._refuse_closed()
        if not self.cfg.expert_counts:
            raise EpUnsupportedError("local_expert_count: the op counts local experts only with "
                                     "EpDispatchCombineConfig.expert_counts=True")
        if self._counts is None:
            raise EpStateError("local_expert_count: no dispatch has run on this op yet")
        return self._counts

    def get_combine_input_buffer(self) -> torch.Tensor:
        """A ``[recv_capacity, hidden]`` buffer (combine dtype) an expert may write into: the same
        tensor on every call (the ``hip`` backend allocates it on the first, outside the symmetric
        arena, so an op that never asks costs nothing).

        ``combine(buffer[:rows] or buffer, ...)`` reads it in place, as it reads any input (the
        ``hip`` backend has no staging copy), so it is a convenience: a static address for graph
        captures and no allocation per step. Only this rank writes it; rows beyond ``total_recv``
        are ignored.
        """
        k = self._live()
        if k.combine_input_buffer is None:
            raise EpUnsupportedError(f"{type(self).__name__} has no combine input buffer")
        return k.combine_input_buffer()

    def get_registered_combine_input_buffer(self, dtype: torch.dtype, hidden_dim: int = -1) -> torch.Tensor:
        """mori's name of :meth:`get_combine_input_buffer`: ``[recv_capacity, hidden_dim]`` of the
        combine dtype, the same tensor on every call. ``dtype`` must be the combine dtype and
        ``hidden_dim`` -1 or the op's (anything else is refused by name)."""
        check_buffer_request(self.cfg, dtype, hidden_dim)
        return self.get_combine_input_buffer()
