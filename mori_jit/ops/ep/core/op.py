"""``EpDispatchCombineOp``: the backend-independent EP op.

The base class owns ``dispatch``/``combine``/``_pick``/validation/lifecycle, once. A backend
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
from mori_jit.ops.ep.core.agreement import agree_on_arguments, agree_on_step
from mori_jit.ops.ep.core.arguments import byte_span, router_weights
from mori_jit.ops.ep.core.arguments_moe import check_expert_major_input
from mori_jit.ops.ep.core.call_options import check_call_options, pick_geometry, refuse_train_options, resolve_group
from mori_jit.ops.ep.core.op_mori import MoriSurface
from mori_jit.ops.ep.core.kernel_set import KernelSet
from mori_jit.ops.ep.core.mask import MaskSurface, RankMask
from mori_jit.ops.ep.core.checks import check_combine_args, check_dispatch_args
from mori_jit.ops.ep.core.overlap import SplitLegs, refuse_in_flight_then
from mori_jit.ops.ep.core.watch import watch_of
from mori_jit.ops.ep.results import EpDispatchResult
from mori_jit.ops.ep.memory.peers import RankCard, config_mismatch, gather_cards, memory_kind, ranks_sharing_device
from mori_jit.ops.ep.errors import EpConfigError, jit_errors_as_ep_errors, EpArgumentError, EpArgumentTypeError, EpDeviceError, EpError, EpPeerError, EpStateError, EpUnsupportedError

_log = logging.getLogger(__name__)

__all__ = ["EpDispatchCombineOp"]

_BACKENDS = {"hip": "mori_jit.ops.ep.backends.hip.backend:EpDispatchCombineOpHip",
             "torch": "mori_jit.ops.ep.backends.torch.backend:EpDispatchCombineOpTorch"}
#: The differentiable calls (an input requires grad), named by module path like the backends.
_TRAIN = "mori_jit.ops.ep.train.hooks"


def _train():
    return importlib.import_module(_TRAIN)


def _backend_class(name: str) -> type:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


class EpDispatchCombineOp(SplitLegs, MoriSurface, MaskSurface, abc.ABC):
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
        cards = gather_cards(self.group, RankCard.local(rank, self.device, cfg))
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
        self.arena = SymmArena.create(regions, self.group, self.device, self.memory_kind) if regions else None
        self._arena_span = byte_span(self.arena.tensor if self.arena is not None else None)
        with jit_errors_as_ep_errors():
            self._kernels = self._build_kernels(cfg, self.arena)
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
            self.arena.close()

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

    def _live(self) -> KernelSet:
        if self._closed:
            raise EpStateError("EpDispatchCombineOp is closed")
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
        if self._closed:
            raise EpStateError("EpDispatchCombineOp is closed")
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
        return self._routing

    # -- the op ----------------------------------------------------------------------------------
    def dispatch(self, input: torch.Tensor, weights: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                 indices: Optional[torch.Tensor], *, routing=None, return_routing: bool = False,
                 return_result: bool = False, return_recv_hook: bool = False, call_local_expert_count: bool = False,
                 block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1):
        """Send each token to the ranks of its top-k experts (once per distinct rank).

        Args:
            input: ``[n, hidden]`` ``cfg.input_dtype`` (the dispatch dtype; bf16 under
                ``dispatch_quant_type``, which the op casts to fp8 with block scales on the way), ``n <= M``.
            weights: ``[n, k]`` float32 top-k weights, or None (then every rank passes None).
            scales: ``[n, scale_dim]`` per-token scales of ``scale_type_size``-byte elements when the
                config declares ``scale_dim`` (and no ``dispatch_quant_type``); else None.
            indices: ``[n, k]`` ``cfg.index_dtype`` expert ids; an id ``< 0`` or out of range drops
                its slot. None on a replay (the routing has them).
            routing: replay (``cfg.routing_replay``): the routing of this op's latest dispatch; the new
                payload (``input``, ``weights``, ``scales`` of the same n tokens) lands at the same
                receive rows and expert-major entries, and no slot is claimed again. The replay's
                outputs may occupy the buffers of the dispatch it replays (a backend whose outputs
                are views of one receive buffer, as the ``hip`` backend's are, overwrites them):
                read that payload first. The routing stays valid for ``combine``.
            return_routing: also return the routing (what ``combine`` takes).
            return_result: return an :class:`~mori_jit.ops.ep.results.EpDispatchResult` (every
                output by name, with the expert counts and the expert-major layout the config asks
                for) instead of the tuple.
            return_recv_hook: run only the send (:meth:`dispatch_send`) and return its outputs
                followed by a ``hook`` that receives (:meth:`dispatch_recv`): the tuple with the
                hook appended, or ``(result, hook)`` with ``return_result``.
            call_local_expert_count: mori's request for :attr:`local_expert_count`; the op counts
                on every dispatch when ``cfg.expert_counts`` (refused by name otherwise).
            block_num, rdma_block_num, warp_per_block: mori's per-call geometry (-1: the op's
                choice): a geometry one of the op's built variants has is launched; any other is
                refused by name (nothing compiles on a call; the kernels have no network blocks).
                Not on the differentiable path (pin the geometry in the config there).

        Returns ``(out, out_weights, out_scales, out_indices, total_recv)`` (+ ``routing`` when
        ``return_routing``). ``out`` is ``[recv_capacity, hidden]``; rows ``[0, total_recv)`` are
        valid, in arrival order; ``total_recv`` is a 1-element int32 device tensor (no host sync).
        Raises :class:`EpDeviceError` if an earlier call's kernel gave up; this call's own failure
        shows only in a later call or :meth:`check` (its outputs are then garbage).

        ``weights`` may also be bf16/fp16 (a router in the model's dtype; moved as float32). With grad
        mode on and ``input`` or ``weights`` requiring grad, the call is differentiable
        (:mod:`mori_jit.ops.ep.train`: fresh outputs, a backward that sends the gradients home).
        """
        if return_recv_hook:
            return self._with_hook("dispatch", self.dispatch_send(
                input, weights, scales, indices, routing=routing, return_routing=return_routing,
                return_result=return_result, call_local_expert_count=call_local_expert_count, block_num=block_num,
                rdma_block_num=rdma_block_num, warp_per_block=warp_per_block))
        # (mori's -1 each: the common case, tested inline within the call's host budget)
        geometry = None if block_num == -1 and rdma_block_num == -1 and warp_per_block == -1 else \
            (block_num, rdma_block_num, warp_per_block)
        if ((getattr(input, "requires_grad", False) or getattr(weights, "requires_grad", False))
                and routing is None and torch.is_grad_enabled()):
            refuse_train_options(self, "dispatch", geometry, count=call_local_expert_count)
            return _train().dispatch(self, input, weights, scales, indices, return_routing, return_result)
        weights = router_weights(weights)
        if self._agree_per_call:
            k, fresh = self._kernels, routing is None  # (a replay belongs to the dispatch it replays)
            n = self._agree("dispatch" if fresh else "replay", self._dispatches + 1 if fresh else self._routing_no,
                            weights is not None, self._check_dispatch, k, input, weights, scales, indices, routing,
                            call_local_expert_count, geometry)
            self._dispatches += fresh
        else:
            k = self._live()
            n = self._check_dispatch(k, input, weights, scales, indices, routing, call_local_expert_count, geometry)
        v = self._pick(n) if geometry is None else pick_geometry(k.schedule, "dispatch", n, *geometry)
        if routing is None:
            res = k.dispatch(v, input, weights, scales, indices)
            # the only routing combine accepts until the next dispatch
            self._routing, self._routing_no = res[5], self._dispatches
        else:
            res = k.replay(v, input, weights, scales, routing)
        if self._count_experts:
            self._counts = res[6][0]
        if return_result:
            return EpDispatchResult.of(res)
        return res[:6] if return_routing else res[:5]

    def _check_dispatch(self, k: KernelSet, input, weights, scales, indices, routing, count: bool = False,
                        geometry: Optional[tuple] = None) -> int:
        """Raise TypeError/ValueError naming a bad argument (EpStateError while a leg is in flight);
        return the token count."""
        self._refuse_in_flight()
        n = check_dispatch_args(self, k, input, weights, scales, indices, routing)
        check_call_options(self, k.schedule, "dispatch", n, geometry, count=count)
        return n

    def combine(self, input: torch.Tensor, weights: Optional[torch.Tensor] = None,
                indices: Optional[torch.Tensor] = None, *, routing=None, out: Optional[torch.Tensor] = None,
                out_weights: Optional[torch.Tensor] = None, return_recv_hook: bool = False, block_num: int = -1,
                rdma_block_num: int = -1, warp_per_block: int = -1, use_external_inp_buf: int = -1,
                call_reset: bool = False):
        """Sum each token's expert outputs back on its source rank (fp32 accumulation, unweighted).

        ``input[i]`` is the expert output of dispatch row i (``[rows <= recv_capacity, hidden]``).
        ``routing``: the latest dispatch's (None: that one, the only one accepted); ``indices`` is
        unused (mori's signature; the routing carries the mapping). mori's per-call options: the
        geometry as in :meth:`dispatch`; ``use_external_inp_buf`` (-1, 0 or 1) and ``call_reset``
        are accepted with mori's meaning and need nothing done (the input is read in place
        wherever it lies, and the kernels leave the op ready for the next dispatch).
        Returns ``(out [n, hidden], out_weights [n, k] | None)``, freshly allocated unless the
        caller passes them: ``out`` (combine dtype) and ``out_weights`` (float32, only with
        ``weights``) are written in place and returned, which saves the allocations (host time)
        and gives graph captures static outputs. Collective: every rank calls it, and either every
        rank passes ``weights`` or none does (a rank sends its rows' weights to their home ranks
        even when it has no tokens of its own). Repeating a combine for the same dispatch is safe.
        Like :meth:`dispatch`, a combine whose kernel gave up returns garbage, reported by the next
        call or by :meth:`check` once the device has run it. ``return_recv_hook``: run only the send
        (:meth:`combine_send`) and return ``(out, out_weights, hook)``, the hook receiving.

        With grad mode on and ``input`` or ``weights`` requiring grad, the call is differentiable
        (its dispatch must have been: :mod:`mori_jit.ops.ep.train`).
        """
        if return_recv_hook:
            return self._with_hook("combine", self.combine_send(
                input, weights, indices, routing=routing, out=out, out_weights=out_weights, block_num=block_num,
                rdma_block_num=rdma_block_num, warp_per_block=warp_per_block,
                use_external_inp_buf=use_external_inp_buf, call_reset=call_reset))
        routing = self._routing_or_latest("combine", routing)
        geometry = None if block_num == -1 and rdma_block_num == -1 and warp_per_block == -1 else \
            (block_num, rdma_block_num, warp_per_block)
        options = None if use_external_inp_buf == -1 and call_reset is False else (use_external_inp_buf, call_reset)
        if ((getattr(input, "requires_grad", False) or getattr(weights, "requires_grad", False))
                and torch.is_grad_enabled()):
            refuse_train_options(self, "combine", geometry, options=options)
            return _train().combine(self, input, weights, routing, out, out_weights)
        if self._agree_per_call:
            k = self._kernels
            n = self._agree("combine", self._routing_no, weights is not None, self._check_combine, input, weights,
                            routing, out, out_weights, geometry, options)
        else:
            k = self._live()
            n = self._check_combine(input, weights, routing, out, out_weights, geometry, options)
        v = self._pick(n) if geometry is None else pick_geometry(k.schedule, "combine", n, *geometry)
        return k.combine(v, input, weights, routing, out, out_weights)

    def _routing_or_latest(self, call: str, routing):
        """mori's ``routing=None``: the latest dispatch's routing (EpStateError before any)."""
        if routing is not None:
            return routing
        if self._routing is None:
            if self._closed:  # (a closed op, or a group a failed exchange left unusable, says so first)
                raise EpStateError("EpDispatchCombineOp is closed")
            self._watch.check_usable()
            raise EpStateError(f"{call}: routing=None takes the latest dispatch's routing, and no dispatch has "
                               f"run on this op yet")
        return self._routing

    def combine_expert_major(self, input: torch.Tensor, *, routing, out: Optional[torch.Tensor] = None):
        """Sum each token's expert outputs given in the expert-major layout (``cfg.expert_capacity``).

        ``input`` is ``[num_experts_per_rank, expert_capacity, hidden]`` (combine dtype): entry
        ``(e, c)`` is local expert e's output for the dispatch's layout entry ``(e, c)``, **already
        multiplied by its top-k weight** (``EpExpertLayout.weights``): the expert side applies the
        weights, the combine only sums. Padding entries (``recv_row == -1``) are never read into the
        result (they may hold anything, NaN included). ``y[t]`` = the float32 sum over every entry
        of token t on every rank (one per valid top-k slot), rounded once to the combine dtype.

        Returns ``out [n, hidden]`` (combine dtype), freshly allocated unless the caller passes it
        (written in place and returned). Collective: every rank calls it after the same dispatch.
        Differentiable when grad mode is on and ``input`` requires grad (:mod:`mori_jit.ops.ep.train`).
        """
        if getattr(input, "requires_grad", False) and torch.is_grad_enabled():
            return _train().combine_expert_major(self, input, routing, out)
        k = self._kernels if self._agree_per_call else self._live()
        if k.combine_expert_major is None:
            raise EpUnsupportedError(f"{type(self).__name__} has no expert-major combine")
        check = refuse_in_flight_then(self, check_expert_major_input)
        args = (self.cfg, input, routing, self._routing, out, self.device, self._arena_span)
        agreed = self._agree_per_call
        n = self._agree("combine_expert_major", self._routing_no, False, check, *args) if agreed else check(*args)
        return k.combine_expert_major(self._pick(n), input, routing, out)

    def _agree(self, call: str, of: int, weights_given: bool, check, *args) -> int:
        """The ranks' agreement on this call, at step ``(op number, call, of)`` (``of``: the dispatch it
        is or belongs to). A closed op refuses locally: its peers closed it with it (``close`` agrees)."""
        if self._closed:
            raise EpStateError("EpDispatchCombineOp is closed")
        group, watch = self._rank_mask.collective()
        watch.check_usable()
        return agree_on_arguments(group, (self._number, call, of), weights_given, check, *args)

    def _check_combine(self, input, weights, routing, out, out_weights, geometry: Optional[tuple] = None,
                       options: Optional[tuple] = None) -> int:
        """Raise TypeError/ValueError naming a bad argument (EpStateError while a leg is in flight);
        return the token count."""
        self._refuse_in_flight()
        n = check_combine_args(self, input, weights, routing, out, out_weights)
        check_call_options(self, self._kernels.schedule, "combine", n, geometry, options=options)
        return n
