"""Expert-parallel dispatch/combine: mori's ``dispatch_combine_v2`` op on the mori-jit kernels.

Map (each folder's ``__init__`` says more)::

    ops/ep/                 what a user touches, and what every layer below shares
      config, config_rules    EpDispatchCombineConfig, its fields' allowed values and rules
      errors                  EpError and every error the op raises
      results, quant          dispatch's named outputs; the two wires' quantizations
      knobs, contract         the op's settings (MORI_EP_*); facts the kernels and checks share
    core/                   the backend-independent op: lifecycle, argument checks, the
                            ranks' agreement on each call and the bounded waits of its host
                            collectives, KernelSet (what a backend hands it), Schedule (which
                            geometry a call launches), the split legs (overlap), mori's call
                            options and accessors (call_options, op_mori), rank masking and
                            the survivors' agreement and group (mask, survivors)
    memory/                 the symmetric arena and where its memory comes from: torch
                            symmetric memory, CUDA/HIP IPC, NVSHMEM; what ranks learn of each other
    train/                  training and prefill: dispatch and combine differentiable, as
                            torch.library custom ops (namespace mori_jit), the packed
                            expert-sorted layout
    backends/torch/         the reference backend on torch.distributed collectives
    backends/hip/           the JIT kernels (AMD via hipcc, NVIDIA via nvcc)
      common/                 what both kernel families share (payload arithmetic, constants,
                              SM budget, host-side views, error words)
      intranode/              one node, over the arena: cfg, args, specs, tuning, errors
      internode/              across nodes, on NVSHMEM: cfg, specs, tuning, variants, kernels
      backend, variants, gaps the op's hip backend; the variant walk it and ``mori-jit
                              precompile`` share; what the kernels cannot serve

Import rule (one direction, checked by ``tests/test_layout.py``): a module imports only from its
own folder, from folders below it in this list, or from the top files of ``ops/ep``::

    backends/hip/{backend,variants,gaps}  →  backends/hip/{intranode,internode}  →  backends/hip/common
    backends/*  →  train  →  core  →  memory  →  ops/ep top files  →  mori_jit.jit

``core`` names its backends and ``train`` (whose hooks make the op's calls differentiable) by module
path only (``core/op.py``'s ``_BACKENDS``, ``core/legs.py``'s ``_TRAIN``), never by import.
:mod:`mori_jit.compat` (mori's API for the serving engines) builds on this package; nothing here
imports it.
Golden checks live in :mod:`mori_jit.testing`, the worked MoE block in :mod:`mori_jit.examples`.

Importing this package imports neither torch nor a backend: the spec registry walks it to find
the kernel specs, and the CLI verbs that only render or key a kernel must start without torch. The
public names below load their modules (and torch) on first use.
"""
from __future__ import annotations

import importlib

#: Each public name and the module that defines it.
_MODULE_OF = {"EpDispatchCombineConfig": ".config", "EpDispatchCombineOp": ".core.op",
              "EpDispatchResult": ".results", "EpExpertLayout": ".results",
              **{name: ".errors" for name in ("EpError", "EpConfigError", "ConfigError", "EpArgumentError",
                                              "EpArgumentTypeError", "EpUnsupportedError", "EpStateError",
                                              "EpMemoryError", "EpBuildError", "EpPeerError", "EpDeviceError", "EpCapacityError")}}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    """Load a public name's module on first access (PEP 562)."""
    try:
        module = _MODULE_OF[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
