"""CPU tests of ``mori_jit.compat.mori``: the import aliases and that a real ``mori`` is never
shadowed, mori's v1 config on mori-jit's op (kernel types, dtypes, scales, quantization; AsyncLL
and an fp4 dispatch refused by name), ``mori.cco`` and ``mori.shmem`` on torch.distributed, the
import direction (nothing in ``mori_jit.ops`` imports compat) and the CLI's ``--ep`` fields."""
from __future__ import annotations

import ast
import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import mori_jit.compat.mori as compat
from mori_jit.ops.ep import EpArgumentError, EpArgumentTypeError, EpConfigError, EpStateError, EpUnsupportedError
from mori_jit.testing.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_modules(monkeypatch):
    """No ``mori`` module loaded, and whatever a test puts in ``sys.modules`` under mori's names undone."""
    for name in [n for n in sys.modules if n == "mori" or n.startswith("mori.")]:
        monkeypatch.delitem(sys.modules, name)
    saved = dict(sys.modules)
    yield
    compat.uninstall()
    for name in [n for n in sys.modules if (n == "mori" or n.startswith("mori.")) and n not in saved]:
        del sys.modules[name]


def test_install_aliases_mori_and_uninstall_removes_them(clean_modules):
    import importlib.util

    assert compat.install() and compat.install() and compat.installed()  # (twice: nothing changes)
    import mori
    import mori.cco
    import mori.ops.dispatch_combine_v2
    import mori.shmem
    from mori.ops.dispatch_combine import EpDispatchCombineKernelType
    from mori_jit.ops.ep import EpDispatchCombineConfig, EpDispatchCombineOp

    assert mori is compat and importlib.util.find_spec("mori") is not None  # (what vLLM's has_mori() asks)
    assert mori.ops.dispatch_combine_v2.EpDispatchCombineOp is EpDispatchCombineOp
    assert mori.ops.dispatch_combine_v2.EpDispatchCombineConfig is EpDispatchCombineConfig
    assert mori.ops.EpDispatchCombineKernelType is EpDispatchCombineKernelType
    assert callable(mori.cco.Communicator.init) and callable(mori.shmem.shmem_torch_process_group_init)
    with pytest.raises(ImportError):
        import mori.jit  # noqa: F401  (a mori module mori-jit has no counterpart of)
    import mori.groups
    assert mori.groups is sys.modules["mori_jit.compat.mori.groups"]  # (one module, one state)
    compat.uninstall()
    assert not compat.installed() and not any(n == "mori" or n.startswith("mori.") for n in sys.modules)


def test_install_costs_nothing_until_mori_is_imported():
    """install() imports neither torch nor the op, nor does importing the packages (the spec
    registry walks every package of mori-jit): a process that never uses mori pays nothing."""
    code = ("import sys, mori_jit.compat.mori as m; assert m.install(); "
            "assert 'torch' not in sys.modules and 'mori_jit.ops' not in sys.modules, sorted(sys.modules); "
            "import importlib.util; assert importlib.util.find_spec('mori') is not None; "
            "assert 'torch' not in sys.modules; import mori, mori.ops; assert 'torch' not in sys.modules; "
            # (the engines read mori.shmem and mori.ops as attributes right after `import mori`)
            "assert mori.shmem.shmem_torch_process_group_init and 'torch' in sys.modules; "
            "assert mori.ops.EpDispatchCombineKernelType.AsyncLL.name == 'AsyncLL' and mori.cco.Communicator")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_install_never_shadows_a_real_mori(clean_modules, tmp_path, monkeypatch):
    (tmp_path / "mori").mkdir()
    (tmp_path / "mori" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"a real mori is importable \(.*mori.__init__.py\); it is left alone"):
        assert compat.install() is False
    assert "mori" not in sys.modules and not compat.installed()
    import mori
    assert mori.REAL
    with pytest.warns(RuntimeWarning, match="a real mori is loaded"):
        assert compat.install() is False
    assert sys.modules["mori"] is mori


def _v1(kernel_type="IntraNode", **fields):
    from mori_jit.compat.mori.ops.v1_config import EpDispatchCombineConfig, EpDispatchCombineKernelType

    base = dict(data_type=torch.bfloat16, rank=1, world_size=4, hidden_dim=256, scale_dim=0, scale_type_size=4,
                max_token_type_size=2, max_num_inp_token_per_rank=32, num_experts_per_rank=8, num_experts_per_token=4,
                kernel_type=getattr(EpDispatchCombineKernelType, kernel_type), gpu_per_node=4)
    return EpDispatchCombineConfig(**{**base, **fields})


def test_v1_config_on_mori_jit():
    from mori_jit.compat.mori.ops.v1_config import to_ep_config

    for kind in ("IntraNode", "IntraNodeLL"):  # one node; counts for call_local_expert_count
        cfg = to_ep_config(_v1(kind, gpu_per_node=8, block_num=80, warp_num_per_block=16, rdma_block_num=0))
        assert not cfg.is_internode and cfg.expert_counts and cfg.gpu_per_node == 4
        assert cfg.dispatch_block_num is None and cfg.warp_num_per_block is None  # (the tuning table's)
        assert (cfg.scale_dim, cfg.scale_type_size, cfg.quant_type) == (0, 0, "none")
        assert cfg.dispatch_dtype == cfg.combine_dtype == torch.bfloat16 and cfg.index_dtype == torch.int32
    for kind, family in (("InterNode", "v2"), ("InterNodeV1", "v2"), ("InterNodeV1LL", "v2_ll")):
        cfg = to_ep_config(_v1(kind, gpu_per_node=2, rdma_block_num=32))
        assert cfg.is_internode and cfg.internode_kernel == family and not cfg.expert_counts
    cfg = to_ep_config(_v1("InterNodeV1", gpu_per_node=8))  # (one node after all: counts served)
    assert not cfg.is_internode and cfg.expert_counts
    # fp8 rows with their block scales, a bf16 combine; mori's quant_type names in any case
    cfg = to_ep_config(_v1(data_type=torch.float8_e4m3fn, scale_dim=2, scale_type_size=4,
                           quant_type=" FP8_Blockwise"))
    assert (cfg.dispatch_dtype, cfg.combine_dtype, cfg.scale_dim, cfg.quant_type) == \
        (torch.float8_e4m3fn, torch.bfloat16, 2, "fp8_blockwise")
    assert to_ep_config(_v1(kernel_type="IntraNode", data_type=torch.float32)).combine_dtype == torch.float32
    assert to_ep_config(_v1(), kernel_backend="torch").backend() == "torch"
    with pytest.raises(EpUnsupportedError, match=r"kernel_type=AsyncLL: .*send and receive halves .*not built in "
                                                 r"mori-jit yet; served: IntraNode, IntraNodeLL, InterNode"):
        to_ep_config(_v1("AsyncLL"))
    with pytest.raises(EpUnsupportedError, match=r"data_type=torch.float4_e2m1fn_x2: mori counts hidden_dim"):
        to_ep_config(_v1(data_type=torch.float4_e2m1fn_x2, scale_dim=8, scale_type_size=1))
    # a kernel type by name or by number, as mori's enum converts
    assert to_ep_config(dataclasses.replace(_v1(), kernel_type=3, gpu_per_node=2)).internode_kernel == "v2_ll"
    assert not to_ep_config(dataclasses.replace(_v1(), kernel_type="IntraNodeLL")).is_internode
    with pytest.raises(EpArgumentTypeError, match="kernel_type='Ring': allowed IntraNode, InterNode"):
        to_ep_config(dataclasses.replace(_v1(), kernel_type="Ring"))
    with pytest.raises(EpConfigError, match=r"quant_type='fp8_cast': the combine wire's quantization"):
        to_ep_config(_v1(quant_type="fp8_cast"))
    with pytest.raises(EpConfigError, match=r"max_total_recv_tokens=64: must be 0 or >= .* = 128"):
        to_ep_config(_v1(max_total_recv_tokens=64))


def test_unique_id_pickles_and_refusals_name_the_call():
    from mori_jit.compat.mori.cco import Communicator, UniqueId, get_unique_id

    uid = get_unique_id()
    assert uid.root is None  # (no torch.distributed here)
    assert pickle.loads(pickle.dumps(uid)) == uid == UniqueId.from_bytes(bytes(uid))
    with pytest.raises(EpArgumentTypeError, match="unique_id: not the bytes of a"):
        UniqueId.from_bytes(b"nccl-id")
    with pytest.raises(EpStateError, match="Communicator.init: torch.distributed is not initialized"):
        Communicator.init(2, 0, uid)
    comm = Communicator()
    with pytest.raises(EpStateError, match="Communicator.barrier: the communicator is destroyed"):
        comm.barrier()
    with pytest.raises(EpUnsupportedError, match="Communicator.alloc_mem: mori-jit's communicator holds no"):
        comm.alloc_mem(1 << 20)


def _cco_job(rank, ws):
    import mori_jit.compat.mori as m
    from mori_jit.compat.mori import cco, groups, shmem

    assert m.install()
    box = [cco.Communicator.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0].root == 0
    with cco.Communicator.init(ws, rank, bytes(box[0])) as comm:  # (bytes too)
        assert comm.process_group is dist.group.WORLD and (comm.rank, comm.nranks) == (rank, ws)
        comm.barrier()
    assert not comm.is_valid
    # a subgroup of the world: found among torch's groups; the registered one comes first
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    uid = [cco.get_unique_id() if rank % 2 == 0 else None]
    dist.broadcast_object_list(uid, src=rank - rank % 2, group=mine)
    assert cco.Communicator.init(2, rank % 2, uid[0]).process_group is mine
    with pytest.raises(EpArgumentError, match=r"Communicator.init\(nranks=3, rank=0\): no torch process group"):
        cco.Communicator.init(3, 0, cco.UniqueId(b"0" * 16, None))
    torch._C._distributed_c10d._register_process_group(f"ep{rank // 2}", mine)
    assert shmem.shmem_torch_process_group_init(f"ep{rank // 2}") == 0
    assert groups.v1_group() is mine and (shmem.shmem_mype(), shmem.shmem_npes()) == (rank % 2, 2)
    with pytest.raises(EpArgumentError, match="group_name='nowhere': no process group is registered"):
        shmem.shmem_torch_process_group_init("nowhere")
    # the name is kept, not the group: once torch forgets the name (destroy_process_group unregisters
    # every group), nothing here holds the group past its end
    torch._C._distributed_c10d._unregister_process_group(f"ep{rank // 2}")
    assert groups.registered() is None and groups.v1_group() is dist.group.WORLD
    torch._C._distributed_c10d._register_process_group(f"ep{rank // 2}", mine)
    assert groups.v1_group() is mine
    shmem.shmem_finalize()
    assert groups.v1_group() is dist.group.WORLD


def test_communicator_and_shmem_find_the_torch_group():
    run_distributed(_cco_job, 4, timeout=180)


def test_nothing_in_ops_imports_compat():
    """The import direction: compat builds on mori_jit.ops, never the other way."""
    offenders = []
    for path in sorted((REPO / "mori_jit" / "ops").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("mori_jit.compat")]
    assert not offenders, offenders


def test_cli_ep_fields_take_both_quantizations():
    from mori_jit.ops.ep.backends.hip.variants import config_from_strings, precompile_targets

    base = dict(world_size="2", hidden_dim="256", max_num_inp_token_per_rank="32", num_experts_per_rank="4",
                num_experts_per_token="2")
    cfg, _ = config_from_strings({**base, "dispatch_quant_type": "fp8_e4m3_block128", "dispatch_data_type": "fp8",
                                  "combine_data_type": "bf16", "scale_dim": "2", "scale_type_size": "4"})
    assert cfg.dispatch_quant_type == "fp8_e4m3_block128" and cfg.quant_type == "none"
    cfg, _ = config_from_strings({**base, "quant_type": "fp8_direct_cast"})
    assert cfg.quant_type == "fp8_direct_cast"
    names = [c and spec.entry_name(c) for spec, c in precompile_targets({**base, "quant_type": "fp8_direct_cast"},
                                                                          "sm_90a")]
    assert any(n.startswith("mori_ep_combine_") and n.endswith("_w8") for n in names), names
    with pytest.raises(EpConfigError, match=r"the hip op does not support: quant_type='fp4_blockwise' \(mori's "
                                            r"combine-wire quantization"):
        precompile_targets({**base, "quant_type": "fp4_blockwise"}, "sm_90a")
    net = {**base, "world_size": "4", "gpu_per_node": "2", "quant_type": "fp8_blockwise"}
    names = [spec.entry_name(c) for spec, c in precompile_targets(net, "sm_90a")]
    assert any(n.startswith("mori_epll_combine_") and n.endswith("_w8b4") for n in names), names
    with pytest.raises(EpConfigError, match=r"quant_type='fp4_blockwise' \(mori's combine-wire quantization; this "
                                            r"backend serves 'none', 'fp8_direct_cast', 'fp8_blockwise'\)"):
        precompile_targets({**net, "quant_type": "fp4_blockwise"}, "sm_90a")
