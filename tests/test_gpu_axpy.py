"""GPU tests of the JIT framework end to end with ``example_axpy`` (run with ``pytest -m gpu``).

Real compiler (nvcc / hipcc for the device's arch), real cache, real module load and launch on
torch's current stream; checked against torch in fp32 on fresh random data with the output
poisoned (y starts random, and a guard region past ``n`` must stay untouched). Also: a
LaunchGroup, launches on a side stream, CUDA-graph capture + replays with fresh inputs, and
``prepare`` refusing to compile during capture.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

GUARD = 64  # poisoned elements after y[n] that no launch may write


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(tmp_path_factory):
    """A fresh cache directory for this module (compiles for real, then hits)."""
    old = os.environ.get("MORI_JIT_CACHE_DIR")
    os.environ["MORI_JIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("mori_jit_cache"))
    from mori_jit.jit.plan import forget_plans
    forget_plans()
    yield
    forget_plans()
    if old is None:
        os.environ.pop("MORI_JIT_CACHE_DIR", None)
    else:
        os.environ["MORI_JIT_CACHE_DIR"] = old


def _cfg(dtype: torch.dtype, **kw):
    from mori_jit.examples.axpy_spec import AxpyCfg, AxpyDType
    if dtype == torch.bfloat16:
        return AxpyCfg(dtype=AxpyDType.Bf16, **{"vecElems": 8, **kw})
    return AxpyCfg(dtype=AxpyDType.Fp32, **{"vecElems": 4, **kw})


def _inputs(n: int, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(n, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    y = torch.empty(n + GUARD, device="cuda", dtype=dtype)
    y[:n] = torch.randn(n, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    y[n:] = float("nan")
    return x, y


def _check(y: torch.Tensor, ref32: torch.Tensor, n: int, dtype: torch.dtype, steps: int = 1):
    assert torch.isnan(y[n:]).all(), "a launch wrote past n"
    out = y[:n].float()
    assert not torch.isnan(out).any()
    if dtype == torch.bfloat16:
        # kernel: fp32 math, one bf16 rounding per step; reference rounds the same way
        torch.testing.assert_close(out, ref32, rtol=1.6e-2 * steps, atol=1e-3 * steps)
    else:
        torch.testing.assert_close(out, ref32, rtol=1e-5, atol=1e-5)
    rel = (out - ref32).norm() / ref32.norm()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-6), rel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [1, 1000, 264 * 256 * 8 * 3 + 13, 1_000_003])
def test_axpy_matches_torch(dtype, n):
    from mori_jit.examples.axpy_spec import AXPY
    from mori_jit.jit.plan import prepare
    plan = prepare(AXPY, _cfg(dtype))
    assert prepare(AXPY, _cfg(dtype)) is plan  # memo hit
    assert plan.name == AXPY.entry_name(plan.cfg) and plan.entry.meta["entry"] == plan.name
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + (dtype == torch.bfloat16))
    for it in range(3):  # fresh data each time
        x, y = _inputs(n, dtype, gen)
        a = float(torch.empty(1).uniform_(-3, 3, generator=torch.Generator().manual_seed(n + it)).item())
        ref = (a * x.float() + y[:n].float())
        if dtype == torch.bfloat16:
            ref = ref.to(torch.bfloat16).float()
        if it == 0:
            plan.launch(x=x, y=y, a=a, n=n)  # tensors for pointer fields
        elif it == 1:
            plan.launch(x=x.data_ptr(), y=y.data_ptr(), a=a, n=n)  # raw ints
        else:
            s = plan.args(x=x, y=y, a=a, n=n)
            plan.launch_struct(s)
        torch.cuda.synchronize()
        _check(y, ref, n, dtype)


def test_launch_uses_the_current_stream():
    from mori_jit.examples.axpy_spec import AXPY
    from mori_jit.jit.plan import prepare
    plan = prepare(AXPY, _cfg(torch.float32))
    n = 1 << 22
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, y = _inputs(n, torch.float32, gen)
    y0 = y[:n].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y[:n].copy_(y0 * 3)               # torch op on the side stream ...
        plan.launch(x=x, y=y, a=0.5, n=n)  # ... our kernel must be ordered after it ...
        y[:n].mul_(-2)                      # ... and before this one
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    _check(y, -2 * (0.5 * x + 3 * y0), n, torch.float32)


def test_launch_group_of_two_axpy_plans():
    from mori_jit.examples.axpy_spec import AXPY
    from mori_jit.jit.launch_group import LaunchGroup
    from mori_jit.jit.plan import prepare
    p1 = prepare(AXPY, _cfg(torch.float32))
    p2 = prepare(AXPY, _cfg(torch.float32, vecElems=2, blockNum=17, blockSize=128))
    assert p1.function is not p2.function
    group = LaunchGroup([p1, p2])
    gen = torch.Generator(device="cuda").manual_seed(11)
    for n in (777, 123_457):
        x, y = _inputs(n, torch.float32, gen)
        ref = y[:n] + 1.25 * x + 1.25 * x
        group.launch(x=x, y=y, a=1.25, n=n)
        torch.cuda.synchronize()
        _check(y, ref, n, torch.float32)
    # bf16 group: two roundings, reference rounds after each step
    q1 = prepare(AXPY, _cfg(torch.bfloat16))
    q2 = prepare(AXPY, _cfg(torch.bfloat16, vecElems=4, blockNum=33))
    x, y = _inputs(99_999, torch.bfloat16, gen)
    r1 = (-0.75 * x.float() + y[:99_999].float()).to(torch.bfloat16).float()
    ref = (-0.75 * x.float() + r1).to(torch.bfloat16).float()
    LaunchGroup([q1, q2]).launch(x=x, y=y, a=-0.75, n=99_999)
    torch.cuda.synchronize()
    _check(y, ref, 99_999, torch.bfloat16, steps=2)


def test_graph_capture_and_replay_with_fresh_inputs():
    from mori_jit.examples.axpy_spec import AXPY
    from mori_jit.jit.launch_group import LaunchGroup
    from mori_jit.jit.plan import prepare
    n = 300_007
    p1 = prepare(AXPY, _cfg(torch.float32))
    p2 = prepare(AXPY, _cfg(torch.float32, vecElems=2, blockNum=17, blockSize=128))
    group = LaunchGroup([p1, p2])
    gen = torch.Generator(device="cuda").manual_seed(3)
    x_s, y_s = _inputs(n, torch.float32, gen)  # static buffers the graph reads and writes
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert prepare(AXPY, _cfg(torch.float32)) is p1  # a memo hit is fine during capture
        p1.launch(x=x_s, y=y_s, a=0.5, n=n)
        group.launch(x=x_s, y=y_s, a=2.0, n=n)
    for _ in range(6):
        x, y = _inputs(n, torch.float32, gen)
        x_s.copy_(x)
        y_s.copy_(y)
        ref = y[:n] + 0.5 * x + 2.0 * x + 2.0 * x
        g.replay()
        torch.cuda.synchronize()
        _check(y_s, ref, n, torch.float32)


def test_prepare_refuses_to_compile_during_capture():
    from mori_jit.examples.axpy_spec import AXPY
    from mori_jit.jit.compile import resolve
    from mori_jit.jit.plan import CaptureError, prepare
    from mori_jit.jit.toolchain import get_toolchain
    p1 = prepare(AXPY, _cfg(torch.float32))
    never = _cfg(torch.float32, blockNum=5, blockSize=96)
    x, y = _inputs(1024, torch.float32, torch.Generator(device="cuda").manual_seed(1))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match="capturing"):
        with torch.cuda.graph(g):
            p1.launch(x=x, y=y, a=1.0, n=1024)
            prepare(AXPY, never)
    assert not resolve(AXPY, never, get_toolchain()).path.exists()  # nothing was compiled
    torch.cuda.synchronize()
    assert prepare(AXPY, never) is not None  # outside capture it compiles and loads
