"""What the ``hip`` backend's kernels cannot do for a config: shared by the live op's gate and
``mori-jit precompile --ep``, which refuse the same configs."""
from __future__ import annotations

from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.args import EP_MAX_PEERS

__all__ = ["HIP_QUANT_TYPES", "gather_unquantized_gaps", "hip_gaps"]


#: The in-op quantizations the ``hip`` kernels do (``EpCfg.quantFp8Block128``).
HIP_QUANT_TYPES = (None, "none", "fp8_e4m3_block128")


def gather_unquantized_gaps(cfg: EpDispatchCombineConfig) -> list[str]:
    """The ``hip`` backend's gaps of combine and quantization: only gather combine, and only the
    in-op quantizations its kernels do."""
    missing = []
    if cfg.combine_mode != "gather":
        missing.append(f"combine_mode={cfg.combine_mode!r} (only 'gather')")
    if cfg.quant_type not in HIP_QUANT_TYPES:
        missing.append(f"quant_type={cfg.quant_type!r} (pass already-quantized payloads instead)")
    return missing


def hip_gaps(cfg: EpDispatchCombineConfig, arch: str | None = None) -> list[str]:
    """What the ``hip`` op's kernels cannot do for ``cfg`` on ``arch`` (None: this torch build's
    GPUs) (empty = they can); the live op adds the device check, ``mori-jit precompile --ep``
    refuses the same configs."""
    missing = gather_unquantized_gaps(cfg)
    if cfg.is_internode:  # (the internode kernels: their own limits)
        from mori_jit.ops.ep.backends.hip.internode.variants import internode_gaps
        missing.extend(internode_gaps(cfg, arch))
        moe = cfg.moe_options_in_use()
        if moe:
            missing.append(f"the MoE-layer options on the internode kernels ({', '.join(moe)}): intranode only")
        if cfg.split_send_recv:
            missing.append("split_send_recv=True on the internode kernels (dispatch_send/dispatch_recv, "
                           "combine_send/combine_recv): intranode only")
    elif cfg.world_size > EP_MAX_PEERS:
        missing.append(f"world_size={cfg.world_size} > {EP_MAX_PEERS} (intranode)")
    return missing
