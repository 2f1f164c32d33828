"""The EP op's settings, read from the environment (see :mod:`mori_jit.jit.knobs` for the framework's).

Every variable is ``MORI_EP_*``; mori's own names (``MORI_V2_KERNEL_BACKEND``, ``MORI_V2_EP_<FIELD>``)
are read as aliases, so an environment written for mori keeps its meaning here."""
from __future__ import annotations

from mori_jit.jit.knobs import BoolSetting, Group, IntListSetting, PositiveFloatSetting, PrefixSetting, StrSetting

__all__ = ["EpKnobs", "ep"]


class EpKnobs(Group):
    """The EP op's backend, its bound on waiting for a peer (kernels and host collectives), overrides
    of its kernels' EpCfg fields, CUDA MPS's per-process SM limit (which the op reads, never sets),
    and the world sizes of its GPU tests."""

    name = "ep"
    kernel_backend = StrSetting("MORI_EP_KERNEL_BACKEND", None, "the EP backend when the op's config names none",
                                default_doc="hip", aliases=("MORI_V2_KERNEL_BACKEND",))
    timeout_s = PositiveFloatSetting("MORI_EP_TIMEOUT_S", 30.0,
                                     "how long an EP kernel spin-waits before it gives up and reports a timeout "
                                     "(a rank waits twice that for its peers in the op's host collectives)")
    cfg_overrides = PrefixSetting("MORI_EP_CFG_", "MORI_EP_CFG_[DISPATCH_|COMBINE_]<FIELD>: an EpCfg field of both "
                                                  "legs or one (e.g. MORI_EP_CFG_COMBINE_BLOCKNUM=64); enters the key",
                                  aliases=("MORI_V2_EP_",))
    mps_thread_percentage = StrSetting("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None,
                                       "CUDA MPS's limit on this process's share of the GPU, in percent; when set, "
                                       "the device reports only that share of its SMs, which is then a rank's "
                                       "grid budget as it is (NVSHMEM needs it with several PEs on one GPU; the "
                                       "GPU test harness sets it)")
    mask_on_timeout = BoolSetting("MORI_EP_MASK_ON_TIMEOUT", False,
                                  "mask the peer a timed-out kernel wait names (op.mask_rank), so that the next "
                                  "op.reset() runs among the survivors (docs/design.md §6, \"Rank masking\")")
    test_world_sizes = IntListSetting("MORI_EP_TEST_WORLD_SIZES", (1, 2, 4, 8),
                                      "the world sizes the EP GPU tests run at (several ranks per GPU where the "
                                      "machine has fewer GPUs)")


ep = EpKnobs()
