"""GPU jobs whose ranks are NVSHMEM PEs: :func:`mori_jit.testing.gpu_world.run_ep_job` plus the MPS
setting NVSHMEM needs when several PEs share a GPU.

NVSHMEM runs several PEs on one GPU only under CUDA MPS with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
set in each process so that the percentages sum to at most 100 (otherwise it aborts with "Called
NVSHMEM API not supported with limited MPG"). :func:`run_shmem_job` gives every rank an equal share,
``100 // ranks_per_gpu``, for the job's duration (the ranks are spawned with this process's
environment), and otherwise leaves placement, MPS start-up and skipping to ``run_ep_job``.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from mori_jit.ops.ep.knobs import EpKnobs

from mori_jit.testing.gpu_world import placement, run_ep_job

__all__ = ["MPS_THREAD_PERCENTAGE", "mps_thread_percentage", "run_shmem_job"]

MPS_THREAD_PERCENTAGE = EpKnobs.mps_thread_percentage.var  # (the op reads it; the harness sets it per job)


def mps_thread_percentage(ranks_per_gpu: int) -> Optional[int]:
    """Each rank's share of a GPU's threads under MPS when ``ranks_per_gpu`` ranks share it (their
    sum is at most 100), or None for one rank per GPU (no limit)."""
    if ranks_per_gpu < 1:
        raise ValueError(f"ranks_per_gpu={ranks_per_gpu}: expected >= 1")
    return None if ranks_per_gpu == 1 else 100 // ranks_per_gpu


def run_shmem_job(fn, world_size: int, *args, timeout: float = 600.0) -> None:
    """``run_ep_job(fn, world_size, *args)`` with every rank's MPS thread percentage set when ranks
    share a GPU (CUDA only; the variable is restored afterwards)."""
    share = mps_thread_percentage(max(1, placement(world_size).ranks_per_gpu))
    saved = os.environ.pop(MPS_THREAD_PERCENTAGE, None)  # (the ranks are spawned with this environment)
    if share is not None and torch.version.hip is None:
        os.environ.update({MPS_THREAD_PERCENTAGE: str(share)})
    elif saved is not None:
        os.environ.update({MPS_THREAD_PERCENTAGE: saved})
    try:
        run_ep_job(fn, world_size, *args, timeout=timeout)
    finally:
        os.environ.pop(MPS_THREAD_PERCENTAGE, None)
        if saved is not None:
            os.environ.update({MPS_THREAD_PERCENTAGE: saved})
