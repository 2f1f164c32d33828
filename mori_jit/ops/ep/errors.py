"""Every error the EP op raises, under one root: ``except EpError`` catches them all.

Each class also derives from the built-in exception a caller would expect (``ValueError`` for a bad
value, ``TypeError`` for a bad type, ``RuntimeError`` for a failure at run time), so code written
against the built-ins keeps working. Which need ``op.reset()``: :class:`EpDeviceError` and its
subclass :class:`EpCapacityError` (a backend that does not sync the host reports both from
``check()`` or the op's next call).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from mori_jit.jit.fields import ConfigError

__all__ = ["EpError", "EpConfigError", "EpArgumentError", "EpArgumentTypeError", "EpUnsupportedError",
           "EpStateError", "EpMemoryError", "EpBuildError", "EpPeerError", "EpDeviceError", "EpCapacityError", "ConfigError",
           "jit_errors_as_ep_errors"]


class EpError(Exception):
    """The root of every error the EP op raises."""


class EpConfigError(EpError, ConfigError):
    """A config field (or a combination of fields) the op cannot serve; the message names the field,
    the value and what is allowed. Raised at construction, on every rank, before anything is built.
    A :class:`~mori_jit.jit.fields.ConfigError` (a ``ValueError``), as the JIT's config errors are."""


class EpArgumentError(EpError, ValueError):
    """A call's argument has a value the op refuses (a shape, an alignment, an overlap, a stale
    routing); the message names the argument, the value and what is allowed. Nothing was launched."""


class EpArgumentTypeError(EpError, TypeError):
    """A call's argument has the wrong type, dtype or device. Nothing was launched."""


class EpUnsupportedError(EpError, NotImplementedError):
    """The chosen backend cannot serve this config or call; the message lists everything missing."""


class EpStateError(EpError, RuntimeError):
    """The op's state refuses the call: it is closed, the ranks are at different steps (every rank
    raises it, naming each rank's step), or an earlier failure left a collective of the process
    group unfinished (then every later call on the group raises it)."""


class EpMemoryError(EpError, RuntimeError):
    """The symmetric arena's memory could not be set up (IPC across hosts, an NVSHMEM bootstrap)."""


class EpBuildError(EpError, RuntimeError):
    """The backend could not build or load its kernels: a compiler, toolchain, source or driver
    error of the JIT (the message is the JIT's; ``__cause__`` is the JIT's exception)."""


class EpPeerError(EpError, RuntimeError):
    """A peer rank refused its arguments of this call (no rank ran it), or a peer failed, died or did
    not arrive while this rank waited for it in a host collective (within 2 x ``MORI_EP_TIMEOUT_S``).
    The message names the rank or the call."""


class EpDeviceError(EpError, RuntimeError):
    """A kernel recorded an error (a timed-out wait, a short combine input); the op needs ``reset()``.

    ``peer``: the rank a timed-out wait waited for (None for other errors), the rank that
    ``MORI_EP_MASK_ON_TIMEOUT`` masks."""

    def __init__(self, *args, peer=None):
        super().__init__(*args)
        self.peer = peer


class EpCapacityError(EpDeviceError):
    """More (token, expert) pairs reached a local expert than ``cfg.expert_capacity`` rows hold.

    Never a silent truncation: the ``torch`` backend raises it from the ``dispatch`` itself, on
    every rank, before any row moves (the ranks' counts are gathered first, so none is left inside a
    collective and every rank may retry); a backend that does not sync the host (``hip``) raises it from ``check()`` or the
    op's next call on the rank whose expert overflowed, until ``op.reset()`` (collective).
    """


@contextlib.contextmanager
def jit_errors_as_ep_errors() -> Iterator[None]:
    """Re-raise the JIT's errors escaping the block as the op's: a kernel config the JIT refuses
    (a :class:`ConfigError`, e.g. from a ``MORI_EP_CFG_*`` override) as :class:`EpConfigError`, a
    failed build or load as :class:`EpBuildError`. The op's own errors pass through."""
    try:
        yield
    except EpError:
        raise
    except ConfigError as e:
        raise EpConfigError(str(e)) from e
    except Exception as e:
        if isinstance(e, _loaded_build_errors()):
            raise EpBuildError(str(e)) from e
        raise


#: The JIT's build and load errors, by module: looked up only in modules already imported (an
#: exception of a module never imported cannot have been raised), so the ``torch`` backend's
#: construction imports none of the JIT's compile or runtime machinery.
_BUILD_ERRORS = (("mori_jit.jit.compile", "CompileError"), ("mori_jit.jit.toolchain", "ToolchainError"),
                 ("mori_jit.jit.paths", "SourceRootError"), ("mori_jit.jit.runtime.base", "DriverError"))


def _loaded_build_errors() -> tuple[type, ...]:
    return tuple(getattr(sys.modules[m], n) for m, n in _BUILD_ERRORS if m in sys.modules)
