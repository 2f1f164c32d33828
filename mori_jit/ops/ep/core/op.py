"""``EpDispatchCombineOp``: the backend-independent EP op.

The base class owns construction, ``_pick`` and the lifecycle once; its legs (``dispatch``,
``combine``, ``combine_expert_major``, with their checks) are :class:`.legs.Legs`. A backend
supplies three things: ``_regions(cfg)`` (arena region sizes; empty = no arena),
``_build_kernels(cfg, arena)`` (a :class:`KernelSet`) and ``_unsupported(cfg)`` (what it cannot do).
Behaviour differences are data on the KernelSet, not overrides. ``EpDispatchCombineOp(cfg, group)``
returns the backend's subclass, importing only that backend. mori's names that the serving
engines read (``local_expert_count``, ``backend_name``, ...) come from :class:`.op_mori.MoriSurface`.

Order (docs/design.md §6): process group → capability gate → rank cards (configs compared, ranks
per device, memory kind) → arena → every variant compiled → launches.
"""
from __future__ import annotations

import abc
import importlib
import logging
from typing import Optional

import torch
import torch.distributed as dist

from mori_jit.ops.ep.memory.arena import SymmArena, keep_until_exit
from mori_jit.ops.ep.config import EpDispatchCombineConfig
from mori_jit.ops.ep.core.agreement import agree_on_step
from mori_jit.ops.ep.core.arguments import byte_span
from mori_jit.ops.ep.core.call_options import resolve_group
from mori_jit.ops.ep.core.kernel_set import KernelSet
from mori_jit.ops.ep.core.legs import Legs
from mori_jit.ops.ep.core.mask import MaskSurface, RankMask
from mori_jit.ops.ep.core.op_mori import MoriSurface
from mori_jit.ops.ep.core.overlap import SplitLegs
from mori_jit.ops.ep.core.watch import watch_of
from mori_jit.ops.ep.memory.peers import RankCard, config_mismatch, gather_cards, memory_kind, ranks_sharing_device
from mori_jit.ops.ep.errors import EpArgumentError, EpArgumentTypeError, EpConfigError, EpError, EpPeerError, \
    EpStateError, EpUnsupportedError, jit_errors_as_ep_errors

_log = logging.getLogger(__name__)

__all__ = ["EpDispatchCombineOp"]

_BACKENDS = {"hip": "mori_jit.ops.ep.backends.hip.backend:EpDispatchCombineOpHip",
             "torch": "mori_jit.ops.ep.backends.torch.backend:EpDispatchCombineOpTorch"}
def _backend_class(name: str) -> type:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


class EpDispatchCombineOp(Legs, SplitLegs, MoriSurface, MaskSurface, abc.ABC):
    """Expert-parallel dispatch/combine over ``group``: None (WORLD), a torch process group, or a
    communicator-like object holding one as ``process_group`` (mori's ``mori.cco.Communicator``
    as :mod:`mori_jit.compat.mori` makes it). Collective to construct.

    Use as a context manager or call :meth:`close` to release the arena. Each leg also runs as a
    send and a receive (:class:`~mori_jit.ops.ep.core.overlap.SplitLegs`).
    """

    _backend_paths = _BACKENDS

    def __new__(cls, cfg: EpDispatchCombineConfig, group=None):
        if not isinstance(cfg, EpDispatchCombineConfig):  # (before cfg.backend() is asked of it)
            raise EpArgumentTypeError(f"cfg: expected an EpDispatchCombineConfig, got {type(cfg).__name__}")
        if cls is EpDispatchCombineOp:
            cls = _backend_class(cfg.backend())
        return super().__new__(cls)

    # -- backend hooks ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _unsupported(self, cfg: EpDispatchCombineConfig) -> list[str]:
        """Everything this backend cannot do for ``cfg`` (empty = supported); runs before allocation."""

    @abc.abstractmethod
    def _regions(self, cfg: EpDispatchCombineConfig) -> dict[str, int]:
        """Arena region name → bytes (empty: the backend needs no symmetric arena)."""

    @abc.abstractmethod
    def _build_kernels(self, cfg: EpDispatchCombineConfig, arena: Optional[SymmArena]) -> KernelSet:
        """Compile and load every variant; return the KernelSet the base class drives."""

    def _memory_kind(self, cfg: EpDispatchCombineConfig, cards: list[RankCard]) -> str:
        """The arena's memory provider (:func:`.peers.memory_kind` unless a backend knows better)."""
        return memory_kind(cfg.symm_memory, cards)

    def _device(self, cfg: EpDispatchCombineConfig) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    # -- lifecycle -------------------------------------------------------------------------------
    def __init__(self, cfg: EpDispatchCombineConfig, group=None):
        if not isinstance(cfg, EpDispatchCombineConfig):
            raise EpArgumentTypeError(f"cfg: expected an EpDispatchCombineConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.group = resolve_group(group)
        ws, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (ws, rank) != (cfg.world_size, cfg.rank):
            raise EpArgumentError(f"cfg says rank {cfg.rank} of {cfg.world_size}, the process group says {rank} of {ws}")
        missing = self._unsupported(cfg)
        if missing:  # before any allocation
            raise EpUnsupportedError(f"backend {type(self).__name__} does not support: {'; '.join(missing)}")
        self.device = self._device(cfg)
        self._watch = watch_of(self.group)  # (a group that a failed exchange left unusable is refused)
        self._watch.check_usable(ask_the_store=ws > 1)
        # One collective tells every rank the others' host, device and config, so each decision
        # below is the same on every rank (a mismatch raises on all of them, none hangs).
        cards = gather_cards(self.group, RankCard.local(rank, self.device, cfg), self._watch.wait)
        mismatch = config_mismatch(cards)
        if mismatch:
            raise EpConfigError(mismatch)
        # the op's number on its group names it in the agreements (the same on every rank: ops are
        # made collectively, in order)
        self._number = self._watch.take_op_number()
        #: ranks of the group on this rank's GPU (this one included); they share its SMs/CUs
        self.ranks_per_device = ranks_sharing_device(cards, rank)
        with jit_errors_as_ep_errors():
            regions = self._regions(cfg)
        self.memory_kind = self._memory_kind(cfg, cards) if regions else None
        try:  # (the peers may wait in a collective of the construction this rank now never joins)
            self.arena = SymmArena.create(regions, self.group, self.device, self.memory_kind,
                                          wait=self._watch.wait) if regions else None
            with jit_errors_as_ep_errors():
                self._kernels = self._build_kernels(cfg, self.arena)
        except Exception as e:
            if ws > 1 and not isinstance(e, EpPeerError):  # (an EpPeerError was recorded by the watch)
                self._watch.fail(f"construction of op #{self._number}: rank {rank} raised {type(e).__name__}: "
                                 f"{str(e)[:300]}")
            raise
        self._arena_span = byte_span(self.arena.tensor if self.arena is not None else None)
        # What every call reads, resolved once: the config's properties cost a Python call each,
        # and dispatch()/combine() have a host budget of a few microseconds.
        # _pick(num_tokens): the bucket index, a lookup among already-compiled variants, never a compile
        self._pick = self._kernels.schedule.index
        self._in_dtype, self._comb_dtype, self._cap = cfg.input_dtype, cfg.combine_dtype, cfg.recv_capacity
        self._routing = None  # the latest dispatch's routing
        self._dispatches = self._routing_no = 0  # agreed dispatches; the one self._routing came from
        # scales=None is refused only where the caller must pass them (check_scales)
        self._scales_required = bool(cfg.scale_dim) and cfg.dispatch_quant_type in (None, "none")
        self._count_experts = cfg.expert_counts  # (local_expert_count: the latest dispatch's counts)
        # backends whose legs are host collectives agree on the arguments first (see core/agreement.py)
        self._agree_per_call = "host_collectives" in self._kernels.capabilities
        self._rank_mask = RankMask(self)  # (core/mask.py: the masked ranks, the group of the live ones)
        self._closed = False

    def close(self) -> None:
        """Collective: release the arena and the kernels' state (idempotent). Every rank calls it
        (the context manager does): with IPC memory a rank frees its block only after every peer
        has unmapped it. The ranks agree first (core/agreement.py): a peer at another call, or none
        within twice ``MORI_EP_TIMEOUT_S``, makes it raise on every rank, and the op is then let go of
        without a release (as on leaving the context manager on an exception)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        group, watch = self._rank_mask.collective()
        try:
            watch.check_usable()
            agree_on_step(group, (self._number, "close", None))
        except EpError as e:
            self._abandon(e)
            if isinstance(e, EpStateError) and self._watch.failed is not None:
                return  # (the group's failure was raised to the caller already)
            raise
        self._kernels.close()
        if self.arena is not None and self._rank_mask.masked:  # (its release is collective over every rank)
            self._abandon(EpStateError("close with masked ranks"))
        elif self.arena is not None:
            self.arena.close(wait=watch.wait)
        self._let_go_of_group()

    def _let_go_of_group(self) -> None:
        """Drop what reaches the process group (the op's, its mask's and its kernels' references), so
        that a closed op that outlives ``destroy_process_group`` does not keep the group alive until
        interpreter exit, where tearing down a gloo group's workers can abort the process."""
        self.group = self._watch = self._rank_mask = self._routing = self._in_flight = None
        self._kernels = self._pick = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Leaving normally closes the op (collective). Leaving on an exception does not: the
        peers need not be at a matching ``close()``, so the rank keeps its arena mapped until the
        process exits (see :meth:`SymmArena.abandon`) and the exception propagates at once instead
        of waiting on the group."""
        if exc_type is None:
            self.close()
        elif not getattr(self, "_closed", True):
            self._closed = True
            self._abandon(exc)

    def _abandon(self, why: BaseException) -> None:
        """Let go of the op without a collective release (see :meth:`SymmArena.abandon`)."""
        keep_until_exit(self._kernels)  # (a kernel may still write its error words)
        if self.arena is not None:
            self.arena.abandon()
            _log.warning("rank %d left an EpDispatchCombineOp on %s; its symmetric memory stays "
                         "mapped until the process exits", self.cfg.rank, type(why).__name__)

    @property
    def kernels(self) -> KernelSet:
        """What the backend built (launch callables, schedule, capabilities): for diagnostics."""
        return self._kernels

    def _refuse_closed(self) -> None:
        if self._closed:
            raise EpStateError("EpDispatchCombineOp is closed")

    def _live(self) -> KernelSet:
        self._refuse_closed()
        self._kernels.check()
        return self._kernels

    def check(self) -> None:
        """Raise :class:`EpDeviceError` if a kernel recorded an error (no host sync).

        A kernel that gives up (a peer did not arrive within ``MORI_EP_TIMEOUT_S``, a short combine
        input) still returns: its call's outputs are garbage, and nothing says so until the error
        words are read, which every ``dispatch``/``combine`` does at its start (so the *next* call
        raises). To know about a step's own outputs, call ``check()`` after the step's work has
        completed on the device (e.g. after the synchronize that reads a result): it reads a
        host-mapped word, no sync and no launch (0.2-0.4 µs per call on an H200 host), cheap
        enough for every step. Recover with :meth:`reset` (collective).
        """
        self._live()

    def reset(self) -> None:
        """Collective: wait for the device, clear counters, flags and errors on every rank (which
        agree first, as in :meth:`close`: a barrier would pair with any peer's collective). With
        masked ranks, on the survivors alone (:mod:`.mask`; a masked rank is refused)."""
        self._refuse_closed()
        group, watch = self._rank_mask.before_reset()  # (after a mask change: among the survivors)
        watch.check_usable()
        agree_on_step(group, (self._number, "reset", None))
        self._kernels.reset()
        self._in_flight = None  # (a send's receive is moot once the counters are cleared)
        self._rank_mask.after_reset()

    @property
    def latest_routing(self):
        """The routing of this op's latest dispatch that was not a replay (None before the first): the
        only one ``combine``, ``combine_expert_major`` and a replay accept."""
        self._refuse_closed()
        return self._routing
