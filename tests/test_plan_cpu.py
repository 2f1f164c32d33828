"""CPU tests of the launch path: args packing, field errors, LaunchGroup layout rules.

No GPU: plans are bound to a recording :class:`~mori_jit.jit.runtime.Runtime` (the driver is the
dependency replaced here, not the thing under test). The recorder reads the argument bytes back
through the ``void*[1]`` ``params_ptr`` at launch time, exactly as ``cuLaunchKernel`` does, and
the expected bytes come from an independent oracle: a ctypes struct filled attribute by attribute.
"""
from __future__ import annotations

import ctypes
import random
import struct

import pytest

from mori_jit.examples.axpy_spec import AXPY, AxpyCfg, AxpyDType, AxpySpec
from mori_jit.jit.args import ArgField, ArgsSchema, f32, i32, i64, ptr, u32, u64
from mori_jit.jit.packing import ArgsPacker, layout_difference
from mori_jit.jit.launch_group import LaunchGroup
from mori_jit.jit.plan import Plan
from mori_jit.jit.runtime import Runtime, get_runtime
from mori_jit.jit.runtime.base import as_dim3


class RecordingRuntime(Runtime):
    """Records every launch with the argument bytes the driver would have copied."""

    vendor = "test"

    def __init__(self, stream: int = 0x5EED):
        self.launches: list[tuple] = []
        self._stream_value = stream

    def load_module(self, image, device=None):
        return ("module", bytes(image))

    def get_function(self, module, name):
        return ("fn", name)

    def launch(self, fn, grid, block, shared_bytes, stream, params_ptr):
        kp = (ctypes.c_void_p * 1).from_address(params_ptr)
        size = self.size_of[fn]
        self.launches.append((fn, tuple(grid), tuple(block), shared_bytes, stream, ctypes.string_at(kp[0], size)))

    def stream_getter(self, device):
        return lambda: self._stream_value

    def current_device(self):
        return 0


def _plan(spec, cfg, rt: RecordingRuntime, device: int = 0) -> Plan:
    fn = rt.get_function(rt.load_module(b"\0"), spec.entry_name(cfg))
    rt.size_of = getattr(rt, "size_of", {})
    rt.size_of[fn] = spec.args.size
    return Plan(spec, cfg, runtime=rt, function=fn, device=device)


def _oracle(schema: ArgsSchema, **fields) -> bytes:
    s = schema.ctype()
    for k, v in fields.items():
        if isinstance(v, (list, tuple)):
            getattr(s, k)[:] = v
        else:
            setattr(s, k, v)
    return bytes(s)


SWAPPED = ArgsSchema("AxpyArgsSwapped", [ptr("y", "void"), ptr("x", "const void"), f32("a"), i64("n")])
SAME = ArgsSchema("AxpyArgsTwin", [ptr("x", "const void"), ptr("y", "void"), f32("a"), i64("n")])
NARROW = ArgsSchema("AxpyArgsNarrow", [ptr("x", "const void"), ptr("y", "void"), f32("a"), i32("n")])


class SwappedAxpy(AxpySpec):
    name = "test_axpy_swapped"
    args = SWAPPED


class TwinAxpy(AxpySpec):
    name = "test_axpy_twin"
    args = SAME


class NarrowAxpy(AxpySpec):
    name = "test_axpy_narrow"
    args = NARROW


def test_launch_packs_exact_bytes_and_geometry():
    rt = RecordingRuntime()
    cfg = AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4, blockSize=128, blockNum=7)
    plan = _plan(AXPY, cfg, rt)
    plan.launch(x=0x7F00_0000_1000, y=0x7F00_0000_2000, a=-2.5, n=1001)
    (fn, grid, block, shm, stream, data), = rt.launches
    assert fn == ("fn", AXPY.entry_name(cfg)) and plan.name == AXPY.entry_name(cfg)
    assert grid == (7, 1, 1) and block == (128, 1, 1) and shm == 0 and stream == 0x5EED
    assert data == _oracle(AXPY.args, x=0x7F00_0000_1000, y=0x7F00_0000_2000, a=-2.5, n=1001)
    assert plan.layout == AXPY.args.layout


def test_struct_reuse_between_launches_takes_new_values():
    rt = RecordingRuntime()
    plan = _plan(AXPY, AxpyCfg(), rt)
    rng = random.Random(1)
    expect = []
    for _ in range(20):
        f = dict(x=rng.randrange(1 << 48), y=rng.randrange(1 << 48), a=rng.choice([0.5, -3.0, 1e-3]),
                 n=rng.randrange(-(1 << 63), 1 << 63))
        plan.launch(**f)
        expect.append(_oracle(AXPY.args, **f))
    assert [r[-1] for r in rt.launches] == expect


def test_args_struct_fast_path_and_positional_struct():
    rt = RecordingRuntime()
    plan = _plan(AXPY, AxpyCfg(), rt)
    s = plan.args(x=16, y=32, a=1.0, n=3)
    assert isinstance(s, AXPY.args.ctype)
    plan.launch_struct(s)
    s.n = 99  # attribute edits are seen by the next launch
    plan.launch(s)
    plan.pack(s, x=1, y=2, a=0.0, n=5)
    plan.launch_struct(s)
    assert [r[-1] for r in rt.launches] == [_oracle(AXPY.args, x=16, y=32, a=1.0, n=3),
                                            _oracle(AXPY.args, x=16, y=32, a=1.0, n=99),
                                            _oracle(AXPY.args, x=1, y=2, a=0.0, n=5)]
    # a struct of another type but the same layout is accepted; another layout is not
    plan.launch_struct(SAME.ctype.from_buffer_copy(s))
    with pytest.raises(TypeError, match="different layout"):
        plan.launch_struct(SWAPPED.ctype())
    with pytest.raises(TypeError, match="args struct"):
        plan.launch_struct(b"\0" * AXPY.args.size)
    with pytest.raises(TypeError, match="not both"):
        plan.launch(s, n=3)


def test_bound_struct_launch_sees_each_rewrite_and_checks_the_layout_once():
    rt = RecordingRuntime()
    plan = _plan(AXPY, AxpyCfg(), rt)
    s = plan.args(x=16, y=32, a=1.0, n=3)
    launch = plan.bind_struct(s)
    assert launch.plan is plan and launch.struct is s  # what diagnostics read off the callable
    launch()
    s.n, s.a = 7, -0.5  # rewritten in place: the next call launches the new values
    launch()
    assert [r[-1] for r in rt.launches] == [_oracle(AXPY.args, x=16, y=32, a=1.0, n=3),
                                            _oracle(AXPY.args, x=16, y=32, a=-0.5, n=7)]
    with pytest.raises(TypeError, match="different layout"):
        plan.bind_struct(SWAPPED.ctype())
    del s  # the callable keeps its struct alive
    launch()
    assert rt.launches[-1][-1] == _oracle(AXPY.args, x=16, y=32, a=-0.5, n=7)


def test_unknown_and_missing_fields_name_the_valid_ones():
    rt = RecordingRuntime()
    plan = _plan(AXPY, AxpyCfg(), rt)
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['z'\].*valid fields: x, y, a, n"):
        plan.launch(x=1, y=2, a=1.0, n=4, z=0)
    with pytest.raises(TypeError, match=r"missing field\(s\) \['n'\].*valid fields: x, y, a, n"):
        plan.launch(x=1, y=2, a=1.0)
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['N'\] and missing field\(s\) \['n'\]"):
        plan.launch(x=1, y=2, a=1.0, N=4)
    assert rt.launches == []  # nothing was enqueued by a failed launch


def test_bad_values_name_the_field():
    import torch
    rt = RecordingRuntime()
    plan = _plan(AXPY, AxpyCfg(), rt)
    with pytest.raises(TypeError, match="field 'n'"):
        plan.launch(x=1, y=2, a=1.0, n=2.5)
    with pytest.raises(TypeError, match="field 'a'"):
        plan.launch(x=1, y=2, a="1", n=2)
    with pytest.raises(ValueError, match="field 'x'"):
        plan.launch(x=-1, y=2, a=1.0, n=2)
    with pytest.raises(ValueError, match="field 'n'"):
        plan.launch(x=1, y=2, a=1.0, n=1 << 63)
    with pytest.raises(TypeError, match="field 'y' is a pointer"):
        plan.launch(x=1, y="0x10", a=1.0, n=2)
    with pytest.raises(TypeError, match="field 'x' is a pointer"):
        plan.launch(x=True, y=2, a=1.0, n=2)
    with pytest.raises(ValueError, match="field 'x' is a device pointer"):
        plan.launch(x=torch.zeros(4), y=2, a=1.0, n=2)
    assert rt.launches == []
    plan.launch(x=None, y=ctypes.c_void_p(64), a=1, n=True)  # null, ctypes pointer, int→float, bool→int
    assert rt.launches[-1][-1] == _oracle(AXPY.args, x=None, y=64, a=1.0, n=1)


ALL_KINDS = ArgsSchema("AllKinds", [
    i32("r"), ptr("p"), i32("arr", 3), u32("u"), f32("z"), u64("big"), i64("neg"), u32("flags", 2),
    ArgField("peers", "void*", ctypes.c_void_p, 2), i32("tail"),
])


@pytest.mark.parametrize("seed", range(5))
def test_packer_matches_ctypes_layout_on_random_values(seed):
    rng = random.Random(seed)
    packer = ArgsPacker.for_schema(ALL_KINDS)
    assert struct.calcsize(packer.format) == ctypes.sizeof(ALL_KINDS.ctype)
    for _ in range(50):
        f = dict(r=rng.randrange(-(1 << 31), 1 << 31), p=rng.randrange(1 << 64),
                 arr=[rng.randrange(-(1 << 31), 1 << 31) for _ in range(3)], u=rng.randrange(1 << 32),
                 z=struct.unpack("<f", struct.pack("<f", rng.uniform(-1e6, 1e6)))[0],
                 big=rng.randrange(1 << 64), neg=rng.randrange(-(1 << 63), 0),
                 flags=[rng.randrange(1 << 32), 0], peers=[rng.randrange(1 << 64), 0], tail=rng.randrange(100))
        buf = ALL_KINDS.ctype()
        packer.pack(buf, f)
        assert bytes(buf) == _oracle(ALL_KINDS, **f)
    with pytest.raises(ValueError, match="array of 3"):
        packer.pack(ALL_KINDS.ctype(), {**f, "arr": [1, 2]})
    with pytest.raises(ValueError, match="field 'flags'"):
        packer.pack(ALL_KINDS.ctype(), {**f, "flags": [1 << 32, 0]})


def test_launch_group_packs_once_and_launches_in_order():
    rt = RecordingRuntime()
    cfg_a = AxpyCfg(blockNum=3)
    cfg_b = AxpyCfg(dtype=AxpyDType.Fp32, vecElems=4, blockNum=5)
    pa, pb, pt = _plan(AXPY, cfg_a, rt), _plan(AXPY, cfg_b, rt), _plan(TwinAxpy(), AxpyCfg(blockNum=9), rt)
    group = LaunchGroup([pa, pb, pt])  # a different schema object with the same layout is fine
    assert len(group) == 3 and group.layout == AXPY.args.layout
    group.launch(x=0x1000, y=0x2000, a=0.25, n=12345)
    want = _oracle(AXPY.args, x=0x1000, y=0x2000, a=0.25, n=12345)
    assert [(r[0][1], r[1], r[-1]) for r in rt.launches] == [
        (pa.name, (3, 1, 1), want), (pb.name, (5, 1, 1), want), (pt.name, (9, 1, 1), want)]
    rt.launches.clear()
    s = group.args(x=1, y=2, a=3.0, n=4)
    group.launch(s)
    assert [r[-1] for r in rt.launches] == [_oracle(AXPY.args, x=1, y=2, a=3.0, n=4)] * 3
    with pytest.raises(TypeError, match="valid fields"):
        group.launch(x=1, y=2, a=3.0)


def test_launch_group_rejects_a_different_layout_naming_the_first_difference():
    rt = RecordingRuntime()
    pa = _plan(AXPY, AxpyCfg(), rt)
    ps = _plan(SwappedAxpy(), AxpyCfg(), rt)
    with pytest.raises(ValueError, match=r"plan 1 .*different args layout.*field #0: \('x', 0, 8\) vs \('y', 0, 8\)"):
        LaunchGroup([pa, ps])
    pn = _plan(NarrowAxpy(), AxpyCfg(), rt)
    with pytest.raises(ValueError, match=r"field #3: \('n', 24, 8\) vs \('n', 20, 4\)"):
        LaunchGroup([pa, pa, pn])
    with pytest.raises(ValueError, match="at least one plan"):
        LaunchGroup([])
    with pytest.raises(ValueError, match="device"):
        LaunchGroup([pa, _plan(AXPY, AxpyCfg(), rt, device=1)])


def test_layout_difference():
    a = (("x", 0, 8), ("y", 8, 8))
    assert layout_difference(a, a, 16, 16) is None
    assert layout_difference(a, a[:1]) == "field #1: ('y', 8, 8) vs (none)"
    assert layout_difference(a, a, 16, 24) == "struct size 16 vs 24"


def test_as_dim3():
    assert as_dim3(5) == (5, 1, 1) and as_dim3((2, 3)) == (2, 3, 1) and as_dim3([1, 2, 3]) == (1, 2, 3)
    for bad in (0, (1, 2, 3, 4), (1, -1)):
        with pytest.raises(ValueError):
            as_dim3(bad)


def test_get_runtime_rejects_unknown_vendor():
    with pytest.raises(ValueError, match="unknown vendor"):
        get_runtime("intel")


def test_driver_error_names_never_mask_the_error():
    from mori_jit.jit.runtime.base import error_name

    class Enum(int):
        name = "cudaErrorFoo"

    def boom(_):
        raise TypeError("binding rejects the value")

    assert error_name(Enum(3), boom, "CUresult") == "cudaErrorFoo"
    assert error_name(7, lambda e: (0, b"hipErrorBar"), "hipError_t") == "hipErrorBar"
    assert error_name(7, lambda e: "hipErrorBaz", "hipError_t") == "hipErrorBaz"
    assert error_name(7, lambda e: (1, None), "CUresult") == "CUresult 7"
    assert error_name(7, boom, "CUresult") == "CUresult 7"
