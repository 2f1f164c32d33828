"""The internode EP kernel specs: one spec per (family, leg), each its own entry names and keys.

``v2_ll`` (low latency, ``kernels/ep/ep_net_ll.hpp``): ``ep_ll_dispatch``, ``ep_ll_combine``;
``v2`` (hierarchical, ``kernels/ep/ep_net_v2.hpp``): ``ep_v2_dispatch``, ``ep_v2_combine``. Each
leg's phases (send, forward, receive) run in its one kernel, or, for the split legs (the Cfg's
``phase``), in a send kernel and a receive kernel, each its own entry name (``…_send``, ``…_recv``).
Every spec is device-linked against NVSHMEM (its module joins the process's NVSHMEM instance when
loaded) and renders the transport header of its vendor; AMD has none here.
"""
from __future__ import annotations

from mori_jit.jit.devlib import DeviceLibraryError
from mori_jit.jit.nvshmem import NVSHMEM
from mori_jit.jit.registry import register
from mori_jit.jit.spec import Geometry, Spec
from mori_jit.jit.toolchain import Toolchain, ToolchainError

from mori_jit.ops.ep.backends.hip.internode.cfg import EP_NET_ARGS, TRANSPORTS, EpNetCfg, EpPhase, NetBlockThreads, make_net_cfg
from mori_jit.ops.ep.backends.hip.common.cfg import DISPATCH, ELEM_TYPES, phase_suffix, quant_suffix

__all__ = ["EpNetSpec", "NET_SPECS", "FAMILY_BODIES", "TRANSPORTS", "net_spec"]

#: Each built family: its body header and the body function of each leg (internode.cfg.LEGS).
FAMILY_BODIES = {
    "v2_ll": ("ep/ep_net_ll.hpp", {"dispatch": "NetLlDispatch", "combine": "NetLlCombine"}),
    "v2": ("ep/ep_net_v2.hpp", {"dispatch": "NetV2Dispatch", "combine": "NetV2Combine"}),
}
_SHORT = {"v2_ll": "ll", "v2": "v2"}  # (spec and entry names)
#: The families whose dispatch receive runs on one block: v2_ll's is block 0's waits and counts; v2's
#: also forwards its node's relay rows, on the whole grid.
_ONE_BLOCK_DISPATCH_RECV = ("v2_ll",)


class EpNetSpec(Spec):
    """One leg of one internode family (``family``: ``v2_ll`` or ``v2``; ``leg``: ``dispatch`` or
    ``combine``)."""

    cfg_type = EpNetCfg
    args = EP_NET_ARGS
    template = "ep_internode.hip.j2"
    deps = ("kernels/platform", "kernels/common", "kernels/ep", "kernels/transport")
    device_libraries = (NVSHMEM,)

    def __init__(self, family: str, leg: str):
        if family not in FAMILY_BODIES or leg not in FAMILY_BODIES[family][1]:
            raise ValueError(f"internode spec: family {family!r} (built: {tuple(FAMILY_BODIES)}), leg {leg!r} "
                             f"(legs: {tuple(FAMILY_BODIES.get(family, ('', {}))[1])})")
        self.family, self.leg = family, leg
        self.name = f"ep_{_SHORT[family]}_{leg}"

    def default_cfg(self, toolchain: Toolchain) -> EpNetCfg:
        return make_net_cfg(self.leg, toolchain.arch, {})

    def precompile_cfgs(self, toolchain: Toolchain) -> list[EpNetCfg]:
        """The default config where it can be built: none on a vendor without a transport, or
        without NVSHMEM installed (``mori-jit info`` says why); ``precompile --ep`` builds an op's."""
        if toolchain.vendor not in TRANSPORTS:
            return []
        try:
            NVSHMEM.locate()
        except DeviceLibraryError:
            return []
        return [self.default_cfg(toolchain)]

    def make_cfg(self, toolchain: Toolchain, request=None) -> EpNetCfg:
        return make_net_cfg(self.leg, toolchain.arch, request or {})

    def entry_name(self, cfg: EpNetCfg) -> str:
        # (_w8, _w8b<bytes>: the combine's fp8 wire, as the intranode names; _send/_recv: a split half)
        return (f"mori_ep{_SHORT[self.family]}_{self.leg}_{cfg.dtype.name.lower()}_ws{cfg.worldSize}"
                f"_g{cfg.gpuPerNode}_h{cfg.hiddenDim}_k{cfg.numExpertPerToken}_{cfg.blockNum}x{cfg.warpPerBlock}"
                f"{quant_suffix(cfg)}{phase_suffix(cfg.phase)}")

    def geometry(self, cfg: EpNetCfg) -> Geometry:
        one = self.leg == DISPATCH and cfg.phase == EpPhase.Recv and self.family in _ONE_BLOCK_DISPATCH_RECV
        return Geometry((1 if one else cfg.blockNum, 1, 1), (NetBlockThreads(cfg), 1, 1))

    def template_vars(self, cfg: EpNetCfg, toolchain: Toolchain) -> dict:
        transport = TRANSPORTS.get(toolchain.vendor)
        if transport is None:
            raise ToolchainError(f"{self.name}: no SHMEM transport for {toolchain.arch} ({toolchain.vendor}); the "
                                 f"internode kernels run on NVSHMEM (NVIDIA) only")
        header, bodies = FAMILY_BODIES[self.family]
        return {"transport": transport, "body_header": header, "body": bodies[self.leg],
                "elem_t": ELEM_TYPES[cfg.dtype]}


NET_SPECS = {(family, leg): register(EpNetSpec(family, leg)) for family, (_, bodies) in FAMILY_BODIES.items()
             for leg in bodies}


def net_spec(family: str, leg: str) -> EpNetSpec:
    """The registered spec of ``leg`` of ``family``."""
    return NET_SPECS[(family, leg)]
