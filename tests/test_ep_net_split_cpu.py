"""The internode split legs on the CPU (docs/design.md §11, "Split legs"): the gate takes
``split_send_recv`` for every internode family; each bucket's legs add a send and a receive kernel
(``EpNetCfg.phase``: its own entry name and key; the whole leg's default renders as before) in the
variant walk the op and ``mori-jit precompile`` share; the arena is the unsplit op's; nvcc builds
and device-links every half where NVSHMEM is installed, and its PTX shows that a ``v2_ll`` send
kernel keeps only the waits before its first store. The GPU runs are in
``tests/test_gpu_ep_internode.py``."""
from __future__ import annotations

import dataclasses

import pytest

from jit_helpers import STT_FUNC, elf_symbols, toolchain_or_skip
from test_ep_internode_cpu import BASE, _fake_nvshmem
from mori_jit.jit.compile import build, resolve
from mori_jit.jit.devlib import DeviceLibraryError
from mori_jit.jit.nvshmem import NVSHMEM
from mori_jit.jit.toolchain import make_toolchain
from mori_jit.ops.ep import EpDispatchCombineConfig
from mori_jit.ops.ep.backends.hip.common.cfg import COMBINE, DISPATCH, SPLIT_PHASES, phase_suffix
from mori_jit.ops.ep.backends.hip.internode.cfg import EpPhase
from mori_jit.ops.ep.backends.hip.internode.kernels import net_regions
from mori_jit.ops.ep.backends.hip.internode.specs import net_spec
from mori_jit.ops.ep.backends.hip.internode.variants import net_variants
from mori_jit.ops.ep.backends.hip.variants import hip_gaps, precompile_targets

FAMILIES = ("v2_ll", "v2", "auto")


def _cfg(family="v2_ll", split=True, **kw):
    fields = dict(rank=0, world_size=8, gpu_per_node=4, internode_kernel=family, split_send_recv=split, **BASE)
    return EpDispatchCombineConfig(**{**fields, **kw})


def _auto(**kw):  # both families: v2_ll up to 32 tokens, v2 above
    return _cfg("auto", max_num_inp_token_per_rank=128, internode_auto_ll_max_tokens=32, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gate_takes_the_split_on_every_internode_family(family):
    assert hip_gaps(_cfg(family), "sm_90a") == []
    assert hip_gaps(_auto(), "sm_90a") == []


def test_an_op_without_the_split_builds_what_it_built_before(fake_cc, monkeypatch, tmp_path):
    _fake_nvshmem(monkeypatch, tmp_path)
    tc = make_toolchain("sm_90a")
    var = net_variants(_auto(split=False), "sm_90a", 132)
    assert not var.split and var.half(DISPATCH, EpPhase.Send) == ()
    for spec, c in var.requests():
        assert c.phase == EpPhase.Whole
        assert "phase" not in spec.render_source(c, tc)  # the default is never rendered: same text
        assert not spec.entry_name(c).endswith(("_send", "_recv"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_split_adds_a_send_and_a_receive_kernel_per_leg_and_bucket(family, fake_cc, monkeypatch, tmp_path):
    _fake_nvshmem(monkeypatch, tmp_path)
    tc = make_toolchain("sm_90a")
    make = _auto if family == "auto" else (lambda **kw: _cfg(family, max_num_inp_token_per_rank=512, **kw))
    whole, split = net_variants(make(split=False), "sm_90a", 132), net_variants(make(), "sm_90a", 132)
    assert (split.families, split.dispatch, split.combine, split.schedule) == (whole.families, whole.dispatch,
                                                                              whole.combine, whole.schedule)
    assert len(split.families) >= 2 and (family != "auto" or set(split.families) == {"v2_ll", "v2"})
    assert net_regions(split) == net_regions(whole)  # the halves share the whole legs' arena
    assert split.requests()[:len(whole.requests())] == whole.requests()
    added = split.requests()[len(whole.requests()):]
    for leg, legs in ((DISPATCH, whole.dispatch), (COMBINE, whole.combine)):
        for phase in SPLIT_PHASES:
            half = split.half(leg, phase)
            assert half == tuple(dataclasses.replace(c, phase=phase) for c in legs)  # one per bucket
            for fam, c, w in zip(split.families, half, legs):
                spec = net_spec(fam, leg)  # (auto: each bucket's halves are its family's)
                assert (spec, c) in added
                assert spec.entry_name(c) == spec.entry_name(w) + phase_suffix(phase)
                assert phase_suffix(phase) == f"_{phase.name.lower()}"
                assert f".phase=EpPhase::{phase.name}" in spec.render_source(c, tc)
                assert resolve(spec, c, tc).key != resolve(spec, w, tc).key
                geo, wgeo = spec.geometry(c), spec.geometry(w)
                if (fam, leg, phase) == ("v2_ll", DISPATCH, EpPhase.Recv):  # block 0's waits and counts
                    assert geo.grid == (1, 1, 1) and geo.block == wgeo.block
                else:  # (v2's dispatch receive forwards on the whole grid)
                    assert geo == wgeo
    distinct = {(net_spec(f, leg).name, c) for leg, legs in ((DISPATCH, whole.dispatch), (COMBINE, whole.combine))
                for f, c in zip(whole.families, legs)}
    assert len(added) == 2 * len(distinct)
    names = [spec.entry_name(c) for spec, c in split.requests()]
    assert len(set(names)) == len(names)


def test_precompile_walks_the_split_variants(fake_cc, monkeypatch, tmp_path):
    from mori_jit.cli import main
    _fake_nvshmem(monkeypatch, tmp_path)
    request = {"world_size": "8", "gpu_per_node": "4", "internode_kernel": "auto", "max_num_inp_token_per_rank": "128",
               "internode_auto_ll_max_tokens": "32", "split_send_recv": "on",
               **{k: str(v) for k, v in BASE.items() if k != "max_num_inp_token_per_rank"}}
    live = net_variants(_auto(), "sm_90a", 132).requests()
    assert precompile_targets(request, "sm_90a") == live
    assert {c.phase for _, c in live} == {EpPhase.Whole, *SPLIT_PHASES}
    assert main(["precompile", "--arch", "sm_90a", "--ep", *(f"{k}={v}" for k, v in request.items())]) == 0
    assert len([c for c in fake_cc.compiles() if "-dlink" in c["argv"]]) == len(live)


@pytest.mark.parametrize("family", ["v2_ll", "v2"])
def test_real_nvcc_builds_and_device_links_every_half(family):
    tc = toolchain_or_skip("sm_90a")
    try:
        NVSHMEM.locate()
    except DeviceLibraryError as e:
        pytest.skip(f"NVSHMEM absent: {e}")
    var = net_variants(_cfg(family, dispatch_block_num=8, combine_block_num=8), "sm_90a", 132)
    built = 0
    for spec, c in var.requests():
        if c.phase != EpPhase.Whole:
            symbols = elf_symbols(build(spec, c, tc).read_binary())
            assert symbols.get(spec.entry_name(c)) == STT_FUNC, spec.entry_name(c)
            built += 1
    assert built == 4  # (one geometry: each leg's send and receive)


#: an acquire load in nvcc's PTX of an internode kernel: the epochs' reads and each wait's first
#: load and loop
_ACQUIRE = r"ld\.acquire\.sys\.global\.u64"
_EPOCH_READS = 5  # (ReadEpochs: one acquire load per signal row it reads)


def _ptx(tc, spec, c, tmp_path) -> str:
    import subprocess
    from mori_jit.jit.devlib import link_inputs
    from mori_jit.jit.paths import kernels_dir
    src, out = tmp_path / f"{spec.entry_name(c)}.cu", tmp_path / f"{spec.entry_name(c)}.ptx"
    src.write_text(spec.render_source(c, tc))
    dirs = [kernels_dir(), *link_inputs(spec.device_libraries).include_dirs]
    cmd = [("--ptx" if a == "--cubin" else a) for a in tc.command(src, out, dirs, relocatable=True)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=tc.env(), timeout=600)
    assert p.returncode == 0, p.stderr
    return out.read_text()


def test_v2_ll_send_kernels_wait_only_before_their_first_store(tmp_path):
    """nvcc's PTX of v2_ll's halves against the whole legs': the dispatch send keeps only its two
    waits on the previous round (each a first load and a loop), the combine send none; the
    receive kernels hold the rest. Each kernel also reads the five epochs."""
    import re
    tc = toolchain_or_skip("sm_90a")
    try:
        NVSHMEM.locate()
    except DeviceLibraryError as e:
        pytest.skip(f"NVSHMEM absent: {e}")
    var = net_variants(_cfg("v2_ll", dispatch_block_num=8, combine_block_num=8), "sm_90a", 132)

    def waits(spec, c):
        return len(re.findall(_ACQUIRE, _ptx(tc, spec, c, tmp_path))) - _EPOCH_READS

    for leg, legs, send_waits in ((DISPATCH, var.dispatch, 2), (COMBINE, var.combine, 0)):
        spec = net_spec("v2_ll", leg)
        w, s, r = (waits(spec, c[0]) for c in (legs, var.half(leg, EpPhase.Send), var.half(leg, EpPhase.Recv)))
        assert s == 2 * send_waits and s + r == w and r > 0, (leg, w, s, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_live_op_serves_the_internode_split_as_it_serves_the_whole_legs(family):
    """The split adds no reason to refuse to the live op: it refuses a split config for exactly the
    reasons it refuses the unsplit one (on a machine without a GPU, the missing device)."""
    from mori_jit.ops.ep.backends.hip.backend import EpDispatchCombineOpHip

    split = EpDispatchCombineOpHip._unsupported(None, _cfg(family))
    assert split == EpDispatchCombineOpHip._unsupported(None, _cfg(family, False)), split
    assert not any("split" in why for why in split), split
