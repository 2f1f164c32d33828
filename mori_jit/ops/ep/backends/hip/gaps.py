"""What the ``hip`` backend's kernels cannot do for a config: shared by the live op's gate and
``mori-jit precompile --ep``, which refuse the same configs."""
from __future__ import annotations

from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.intranode.args import EP_MAX_PEERS
from mori_jit.ops.ep.quant import combine_quant_gap

__all__ = ["HIP_QUANT_TYPES", "HIP_COMBINE_QUANT_TYPES", "gather_unquantized_gaps", "hip_gaps"]


#: The dispatch casts the ``hip`` kernels do (``EpCfg.quantFp8Block128``).
HIP_QUANT_TYPES = (None, "none", "fp8_e4m3_block128")
#: The combine-wire quantizations (mori's ``quant_type``) the ``hip`` kernels do (``EpCfg.combineQuant``
#: intranode, ``EpNetCfg.combineQuant`` internode; both families).
HIP_COMBINE_QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise")


def gather_unquantized_gaps(cfg: EpDispatchCombineConfig) -> list[str]:
    """The ``hip`` backend's gaps of combine and quantization: only gather combine, only the
    dispatch casts its kernels do, and only an unquantized combine wire."""
    missing = []
    if cfg.combine_mode != "gather":
        missing.append(f"combine_mode={cfg.combine_mode!r} (only 'gather')")
    if cfg.dispatch_quant_type not in HIP_QUANT_TYPES:
        missing.append(f"dispatch_quant_type={cfg.dispatch_quant_type!r} (pass already-quantized payloads instead)")
    combine_gap = combine_quant_gap(cfg, HIP_COMBINE_QUANT_TYPES)
    if combine_gap:
        missing.append(combine_gap)
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
    elif cfg.world_size > EP_MAX_PEERS:
        missing.append(f"world_size={cfg.world_size} > {EP_MAX_PEERS} (intranode)")
    return missing
