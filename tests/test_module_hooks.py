"""Module hooks: what a spec's device libraries run on each module loaded from its binary (CPU).

``prepare`` runs them once per loaded module, with its handle, and memoizes a module only after
they succeed; NVSHMEM's hook is torch's ``_nvshmemx_cumodule_init``. The driver is replaced by a
runtime that numbers the modules it is given (the driver is the dependency here, the plan's
hook handling the thing under test); the binary comes from the fake toolchain, device-linked.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from mori_jit.examples.axpy_spec import AxpyCfg, AxpySpec
from mori_jit.jit import plan as plan_mod
from mori_jit.jit.devlib import DeviceLibrary
from mori_jit.jit.knobs import PathSetting
from mori_jit.jit.nvshmem import NVSHMEM
from mori_jit.jit.runtime import Runtime
from mori_jit.jit.toolchain import make_toolchain

HOME = PathSetting("MORI_JIT_TEST_HOOKED_HOME", None, "a fake device library install (tests only)")


class LoadingRuntime(Runtime):
    """Stands in for the driver: modules are numbered handles, launches do nothing."""

    vendor = "nvidia"

    def __init__(self):
        self.loaded: list[bytes] = []

    def load_module(self, image, device=None):
        self.loaded.append(bytes(image))
        return 0x1000 + len(self.loaded)

    def get_function(self, module, name):
        return (module, name)

    def launch(self, fn, grid, block, shared_bytes, stream, params_ptr):
        pass

    def stream_getter(self, device):
        return lambda: 0

    def current_device(self):
        return 0


class HookedLibrary(DeviceLibrary):
    """A device library whose module hook records the handles it is given (or fails)."""

    name = "hooked"
    archives = ("lib/libhooked_device.a",)
    home_settings = (HOME,)

    def __init__(self, fail: bool = False):
        self.calls: list[int] = []
        self.fail = fail

    def init_module(self, handle):
        self.calls.append(handle)
        if self.fail:
            raise RuntimeError("hook failed")


def _hooked_spec(lib):
    return type("HookedAxpy", (AxpySpec,), {"name": "test_axpy_hooked", "device_libraries": (lib,)})()


@pytest.fixture
def hooked_home(monkeypatch, tmp_path) -> Path:
    home = tmp_path / "hooked"
    (home / "include").mkdir(parents=True)
    (home / "lib").mkdir()
    (home / HookedLibrary.archives[0]).write_bytes(b"!<arch>\nhooked\n")
    monkeypatch.setenv(HOME.var, str(home))
    return home


@pytest.fixture
def loading_runtime(monkeypatch):
    rt = LoadingRuntime()
    monkeypatch.setattr(plan_mod, "get_runtime", lambda vendor: rt)
    monkeypatch.setattr(plan_mod, "_MODULES", {})
    monkeypatch.setattr(plan_mod, "_PLANS", {})
    return rt


def test_the_hook_runs_once_per_loaded_module(fake_cc, hooked_home, loading_runtime):
    lib = HookedLibrary()
    spec, tc = _hooked_spec(lib), make_toolchain("sm_90a")
    p = plan_mod.prepare(spec, AxpyCfg(), tc, device=0)
    assert lib.calls == [0x1001] and p.function == (0x1001, spec.entry_name(AxpyCfg()))
    assert loading_runtime.loaded == [p.entry.read_binary()] and p.entry.meta["linked"][0]["library"] == "hooked"
    plan_mod.forget_plans()
    plan_mod.prepare(spec, AxpyCfg(), tc, device=0)  # the module is loaded already: no second hook
    assert lib.calls == [0x1001]
    plan_mod.prepare(spec, AxpyCfg(blockNum=3), tc, device=0)  # another binary, another module
    assert lib.calls == [0x1001, 0x1002]


def test_a_failing_hook_leaves_no_module_behind(fake_cc, hooked_home, loading_runtime):
    lib = HookedLibrary(fail=True)
    spec, tc = _hooked_spec(lib), make_toolchain("sm_90a")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="hook failed"):
            plan_mod.prepare(spec, AxpyCfg(), tc, device=0)
    assert lib.calls == [0x1001, 0x1002] and plan_mod._MODULES == {} and plan_mod._PLANS == {}


def test_a_spec_without_libraries_runs_no_hook(fake_cc, loading_runtime, monkeypatch):
    from mori_jit.examples.axpy_spec import AXPY
    monkeypatch.setattr(LoadingRuntime, "init_module", lambda *a: pytest.fail("a hook ran"))
    assert AXPY.module_init_hooks() == ()
    plan_mod.prepare(AXPY, AxpyCfg(), make_toolchain("sm_90a"), device=0)
    assert len(loading_runtime.loaded) == 1


def test_nvshmem_hook_goes_through_torch(monkeypatch):
    import torch
    c10d = torch._C._distributed_c10d
    monkeypatch.delattr(c10d, "_nvshmemx_cumodule_init", raising=False)
    with pytest.raises(RuntimeError, match="_nvshmemx_cumodule_init"):
        NVSHMEM.init_module(0x1234)
    seen = []
    monkeypatch.setattr(c10d, "_nvshmemx_cumodule_init", seen.append, raising=False)
    NVSHMEM.init_module(0x1234)
    assert seen == [0x1234]
