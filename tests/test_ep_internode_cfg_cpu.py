"""The internode fields of the EP config and the ``hip`` op's refusal of internode configs (CPU).

``internode_kernel`` is ``auto``/``v2``/``v2_ll`` and ``internode_auto_ll_max_tokens`` an int >= 1,
each bad value named; ``mori-jit precompile --ep`` takes them as strings. The ``hip`` op refuses an
internode config before any allocation: on AMD naming the missing engine (rocSHMEM / mori-shmem),
on NVIDIA naming what it lacks (here: NVSHMEM memory).
"""
from __future__ import annotations

import pytest

from mori_jit.cli import main
from mori_jit.jit.fields import ConfigError
from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp, EpUnsupportedError
from mori_jit.ops.ep.config import INTERNODE_KERNELS
from mori_jit.ops.ep.backends.hip.variants import config_from_strings, hip_gaps
from mori_jit.testing.distributed import run_distributed

BASE = dict(hidden_dim=64, max_num_inp_token_per_rank=8, num_experts_per_rank=4, num_experts_per_token=2)


def _cfg(**kw):
    return EpDispatchCombineConfig(**{"rank": 0, "world_size": 2, **BASE, **kw})


def test_defaults_and_every_family():
    cfg = _cfg()
    assert (cfg.internode_kernel, cfg.internode_auto_ll_max_tokens) == ("auto", 512)
    assert INTERNODE_KERNELS == ("auto", "v2", "v2_ll")
    assert [_cfg(internode_kernel=k).internode_kernel for k in INTERNODE_KERNELS] == list(INTERNODE_KERNELS)
    assert _cfg(internode_auto_ll_max_tokens=1).internode_auto_ll_max_tokens == 1


@pytest.mark.parametrize("field, value, match", [
    ("internode_kernel", "ll", r"internode_kernel='ll': allowed \('auto', 'v2', 'v2_ll'\)"),
    ("internode_kernel", None, r"internode_kernel=None: allowed"),
    ("internode_kernel", "V2", r"internode_kernel='V2': allowed"),
    ("internode_auto_ll_max_tokens", 0, r"internode_auto_ll_max_tokens=0: expected an int >= 1"),
    ("internode_auto_ll_max_tokens", True, r"internode_auto_ll_max_tokens=True: expected an int >= 1"),
    ("internode_auto_ll_max_tokens", "512", r"internode_auto_ll_max_tokens='512': expected an int >= 1"),
])
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**{field: value})


def test_the_command_line_takes_every_string_field():
    base = {k: str(v) for k, v in {"world_size": 2, **BASE}.items()}
    cfg, _ = config_from_strings({**base, "internode_kernel": "v2_ll", "internode_auto_ll_max_tokens": "256",
                                  "symm_memory": "ipc"})
    assert (cfg.internode_kernel, cfg.internode_auto_ll_max_tokens, cfg.symm_memory) == ("v2_ll", 256, "ipc")
    with pytest.raises(ConfigError, match="internode_kernel='fast': allowed"):
        config_from_strings({**base, "internode_kernel": "fast"})


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942"])
def test_amd_refuses_internode_naming_the_missing_engine(arch):
    (gap,) = hip_gaps(_cfg(gpu_per_node=1), arch)
    assert gap.startswith(f"internode (gpu_per_node=1 < world_size=2) on {arch}:")
    assert "rocSHMEM" in gap and "mori-shmem" in gap
    assert hip_gaps(_cfg(), arch) == []  # intranode stays open


def test_nvidia_takes_every_family_and_refuses_other_memory():
    for kernel in INTERNODE_KERNELS:
        assert hip_gaps(_cfg(gpu_per_node=1, internode_kernel=kernel), "sm_90a") == []
    assert hip_gaps(_cfg(gpu_per_node=1, symm_memory="ipc"), "sm_90a") == [
        "internode (gpu_per_node=1 < world_size=2) with symm_memory='ipc': the internode arena is NVSHMEM "
        "symmetric memory; leave symm_memory='auto'"]


def test_precompile_refuses_internode_on_amd_in_one_line(fake_cc, capsys):
    rc = main(["precompile", "--arch", "gfx90a", "--ep", "world_size=2", "gpu_per_node=1",
               *(f"{k}={v}" for k, v in BASE.items())])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "rocSHMEM" in err and "gfx90a" in err, err


def _internode_gate_job(rank, ws, hip_version):
    import torch

    from mori_jit.ops.ep.memory import arena

    def no_allocation(*a, **k):
        raise AssertionError("the arena was allocated before the capability gate refused the config")

    torch.version.hip = hip_version  # this process's torch build, as the op sees it
    arena.SymmArena.create = staticmethod(no_allocation)
    cfg = EpDispatchCombineConfig(rank=rank, world_size=ws, gpu_per_node=1, kernel_backend="hip", symm_memory="ipc",
                                  **BASE)
    with pytest.raises(EpUnsupportedError) as e:
        EpDispatchCombineOp(cfg)
    msg = str(e.value)
    assert "internode (gpu_per_node=1 < world_size=2)" in msg, msg
    if hip_version:
        assert "on AMD GPUs" in msg and "rocSHMEM" in msg and "mori-shmem" in msg, msg
    else:
        assert "the internode arena is NVSHMEM symmetric memory" in msg and "rocSHMEM" not in msg, msg


@pytest.mark.parametrize("hip_version", ["6.4.0", None], ids=["amd", "nvidia"])
def test_the_live_op_refuses_internode_before_allocating(hip_version):
    run_distributed(_internode_gate_job, 2, hip_version, timeout=120)


def test_internode_refuses_the_moe_options_by_name():
    gaps = hip_gaps(_cfg(gpu_per_node=1, routing_replay=True, scale_dim=2, scale_type_size=4), "sm_90a")
    assert ("the MoE-layer options on the internode kernels (scale_dim=2, scale_type_size=4, routing_replay=True): "
            "intranode only") in gaps, gaps
    assert not any("MoE" in g for g in hip_gaps(_cfg(routing_replay=True), "sm_90a"))
