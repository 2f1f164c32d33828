"""What the ``hip`` backend has built but not yet verified on a GPU.

These paths compile for every target (``mori-jit precompile`` builds them), are keyed and gated,
and are covered by the CPU suite, but have not passed the EP GPU suite (golden check, parity with
the torch backend, graph replay) at every world size. The live op refuses them, naming each, unless
``MORI_EP_UNVERIFIED=1``: a path that may hang or return wrong rows is not offered as a product.
The GPU tests that verify them set the variable; a path leaves this list when they pass (the MoE
options of the intranode kernels have: ``tests/test_gpu_ep_moe.py`` at world sizes 1, 2, 4 and 8).
"""
from __future__ import annotations

from .config import EpDispatchCombineConfig

__all__ = ["unverified_paths"]


def unverified_paths(cfg: EpDispatchCombineConfig) -> list[str]:
    """The paths ``cfg`` takes that have not passed the EP GPU suite (empty: none)."""
    paths = []
    if cfg.is_internode:
        paths.append(f"internode on NVSHMEM (gpu_per_node={cfg.gpu_per_node} < world_size={cfg.world_size}, "
                     f"internode_kernel={cfg.internode_kernel!r})")
    return paths
