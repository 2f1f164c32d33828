"""Bounded waits on the EP op's host collectives (docs/design.md §6, "Ranks out of step").

A rank that waits in a collective for a peer that never joins it would wait until the process
group's timeout (30 minutes by default) and then fail without naming the peer. The op's host
collectives (the ranks' agreement on each call, the ``torch`` backend's exchanges, the agreement
before ``close`` and ``reset``) are started asynchronously and waited for here, so that a rank
raises :class:`EpPeerError` within a bound:

* a peer process that dies closes its connections: the collective fails at once (gloo: within
  tens of milliseconds);
* a peer that raises while its peers wait in a collective it will then never join records its
  error in the group's store (:data:`FAILED_KEY`); a waiting rank reads that record every
  :data:`POLL_S` and raises with it;
* a peer that does neither (it never makes the call, or hangs elsewhere): the wait gives up after
  twice ``MORI_EP_TIMEOUT_S`` (:func:`host_timeout_s`: 60 s by default). ``MORI_EP_TIMEOUT_S`` is
  how long the kernels spin-wait for a peer, and a peer may reach a host collective one whole such
  wait late (the ``hip`` backend's recovery: every rank calls ``reset()``, one of them after its
  kernel gave up on a peer); twice that leaves as much again for the host work around it. Ranks in
  step arrive within milliseconds of each other, yet one may lag for seconds (a first call, a long
  GEMM, a checkpoint); a minute leaves that room, is still far below the process group's timeout
  (30 minutes by default), and the error names the call it waited in.

A collective that a rank leaves unfinished stays pending in the process group, where the next
collective of any caller on the group would pair with it. So the rank that gives up or raises
records it, and the group is then *failed* for the EP op on every rank that learns of it: each
later call, ``close``/``reset`` and a new op on the group raises :class:`EpStateError`. Destroy the
process group and make a new one (and new ops on it).
"""
from __future__ import annotations

import datetime
import time
import weakref
from typing import Any, Callable, Optional

import torch.distributed as dist

from mori_jit.ops.ep import knobs
from mori_jit.ops.ep.errors import EpPeerError, EpStateError

__all__ = ["GroupWatch", "watch_of", "Exchange", "host_timeout_s", "FAILED_KEY", "POLL_S"]

#: The group store's key of the first failure a rank recorded (the group's store is per group).
FAILED_KEY = "mori_ep/failed"
#: How often a waiting rank reads the failure record: a store round trip (~30 µs on one host).
POLL_S = 0.02
_REMEDY = "destroy the process group and make a new one (and new ops on it)"

_WATCHES: "weakref.WeakKeyDictionary[Any, GroupWatch]" = weakref.WeakKeyDictionary()


def host_timeout_s() -> float:
    """How long a rank waits for its peers in a host collective: twice ``MORI_EP_TIMEOUT_S`` (see
    the module)."""
    return 2 * knobs.ep.timeout_s


def watch_of(group) -> "GroupWatch":
    """The :class:`GroupWatch` of ``group`` (one per process group in a process)."""
    watch = _WATCHES.get(group)
    if watch is None:
        watch = _WATCHES[group] = GroupWatch(group)
    return watch


class GroupWatch:
    """What this process knows of one process group's EP calls: how many ops were made on it (an
    op's number, the same on every rank: ops are made collectively, in order), and whether the
    group failed (a collective left pending)."""

    def __init__(self, group):
        self.rank = dist.get_rank(group)
        self._store = _store_of(group)
        # gloo's waits block on the work's condition variable and give up after a timeout with the
        # work untouched: the host wakes when the collective ends. Other backends' waits order a
        # stream and return, so their completion is polled.
        self._blocking_waits = _backend_of(group) == "gloo"
        self.ops_made = 0
        #: the failure record that made this group unusable for the op, None while it is usable
        self.failed: Optional[str] = None

    def take_op_number(self) -> int:
        """The next op's number on this group (1, 2, ...)."""
        self.ops_made += 1
        return self.ops_made

    def check_usable(self, ask_the_store: bool = False) -> None:
        """Raise :class:`EpStateError` if the group failed (as this rank knows, or, with
        ``ask_the_store``, as any rank recorded: one store round trip)."""
        if self.failed is None and ask_the_store:
            self.failed = self._recorded()
        if self.failed is not None:
            raise EpStateError(f"the process group's EP calls failed earlier ({self.failed}); {_REMEDY}")

    def fail(self, record: str) -> str:
        """Record that this rank leaves a collective of the group unfinished (the first record on
        the group wins); return the record that stands."""
        if self._store is not None:
            try:
                record = _text(self._store.compare_set(FAILED_KEY, "", record))
            except Exception:  # noqa: BLE001 - the store is best effort: its host may be the dead peer
                pass
        if self.failed is None:
            self.failed = record
        return self.failed

    def _recorded(self) -> Optional[str]:
        if self._store is None:
            return None
        try:
            return _text(self._store.get(FAILED_KEY)) if self._store.check([FAILED_KEY]) else None
        except Exception:  # noqa: BLE001 - as in fail()
            return None

    def wait(self, work, what: str) -> None:
        """Wait for the collective ``work`` (started with ``async_op=True``); ``what`` names it in
        errors. Raises :class:`EpPeerError` when a peer recorded a failure, when the collective
        fails (a peer's process died), or after :func:`host_timeout_s`."""
        if not work.is_completed():
            self._wait_slowly(work, what)
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - the collective failed: a peer died, its connections closed
            record = self.fail(f"{what}: a collective of the group failed on rank {self.rank} "
                               f"({type(e).__name__}: {_short(e)})")
            raise EpPeerError(f"{record}; {_REMEDY}") from e

    def _wait_slowly(self, work, what: str) -> None:
        timeout = host_timeout_s()
        start = time.monotonic()
        read_at, pause = start + POLL_S, 20e-6
        slice_ = datetime.timedelta(seconds=POLL_S)
        while not work.is_completed():
            now = time.monotonic()
            if now >= read_at:
                record = self._recorded()
                if record is not None:
                    self.failed = self.failed or record
                    raise EpPeerError(f"{what}: a peer failed ({record}); {_REMEDY}")
                read_at = now + POLL_S
            if now - start >= timeout:
                record = self.fail(f"{what}: rank {self.rank} waited {timeout:g} s (2 x MORI_EP_TIMEOUT_S) for its "
                                   f"peers, which did not join it")
                raise EpPeerError(f"{record}; {_REMEDY}")
            if self._blocking_waits:
                try:
                    work.wait(timeout=slice_)
                except RuntimeError:  # (timed out, or failed: is_completed() tells, and wait() re-raises a failure)
                    pass
            else:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)


class Exchange:
    """The collectives of one call of a leg, on ``group``. With a ``watch``, each is waited for by
    it, and a rank that leaves the call on an exception (``with exchange: ...``) while a peer may
    still wait in one of its ``expected`` collectives records that (the group fails). Without one
    (:meth:`plain`), they are plain blocking collectives: the reference functions' default."""

    def __init__(self, group, watch: Optional[GroupWatch] = None, what: str = "", expected: int = 0):
        self.group, self._watch, self._what, self._expected, self._done = group, watch, what, expected, 0

    @classmethod
    def plain(cls, group) -> "Exchange":
        return cls(group)

    def all_gather(self, outs: list, t) -> None:
        """``dist.all_gather(outs, t)`` on the group."""
        self._run(dist.all_gather(outs, t, group=self.group, async_op=self._watch is not None))

    def all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int]) -> None:
        """``dist.all_to_all_single(out, inp, out_splits, in_splits)`` on the group."""
        self._run(dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group,
                                         async_op=self._watch is not None))

    def post_all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int]) -> Callable[[], None]:
        """Start ``dist.all_to_all_single(out, inp, out_splits, in_splits)`` and return what waits for
        it (with the watch's bound). This rank has joined it: it counts as made."""
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        self._done += 1
        watch, what = self._watch, self._what
        if watch is None:
            return work.wait
        return lambda: watch.wait(work, what)

    def stop(self) -> None:
        """Every rank ends the call here, with the same outcome (an error every rank raises alike):
        no collective of it is left for a peer to wait in."""
        self._done = self._expected

    def _run(self, work) -> None:
        if self._watch is not None:
            self._watch.wait(work, self._what)
        self._done += 1

    def __enter__(self) -> "Exchange":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self._watch is not None and self._done < self._expected:
            self._watch.fail(f"rank {self._watch.rank} raised {type(exc).__name__} in {self._what}, where its peers "
                             f"wait in the exchange it left ({_short(exc)})")


def _backend_of(group) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - a group torch.distributed does not know: poll it
        return ""


def _store_of(group):
    try:  # (a private helper of torch.distributed; without it, waits are bounded by the timeout alone)
        from torch.distributed.distributed_c10d import _get_process_group_store
        return _get_process_group_store(group)
    except Exception:  # noqa: BLE001
        return None


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _short(e: BaseException, limit: int = 400) -> str:
    s = str(e)
    return s if len(s) <= limit else s[:limit] + "..."
