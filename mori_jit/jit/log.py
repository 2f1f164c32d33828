"""Logging: every module logs through ``logging.getLogger(__name__)``, under the ``mori_jit`` logger.

``MORI_JIT_VERBOSE`` (:attr:`mori_jit.jit.knobs.LogKnobs.verbose`) maps to that logger's level: 1
is ``INFO`` (compiles, rebuilt entries, lock waits), 2 and above ``DEBUG`` (also compile commands
and cache hits). Set, it also has mori-jit write those records to stderr itself, as ``[mori-jit]
message`` (and not pass them on to the application's handlers, which would print them twice),
unless the application gave the ``mori_jit`` logger handlers of its own. Unset or 0, the logger is
left to the application's logging configuration (by default only warnings show).
:func:`apply_verbosity` reads the variable at call time; the compile path calls it on each build.
"""
from __future__ import annotations

import logging
import sys

from . import knobs

__all__ = ["LOGGER_NAME", "level_for", "apply_verbosity"]

LOGGER_NAME = "mori_jit"


def level_for(verbose: int) -> int:
    """The logging level of a ``MORI_JIT_VERBOSE`` value (0 → WARNING, 1 → INFO, 2+ → DEBUG)."""
    return logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (not the one at creation: tests and tools swap it)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("[mori-jit] %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the property always answers
        pass


_handler = _StderrHandler()


def apply_verbosity() -> logging.Logger:
    """Apply ``MORI_JIT_VERBOSE`` (read now) to the ``mori_jit`` logger and return that logger."""
    logger = logging.getLogger(LOGGER_NAME)
    verbose = knobs.log.verbose
    ours = _handler in logger.handlers
    if verbose <= 0:
        if ours:  # the variable was unset since: hand the logger back as it was
            logger.removeHandler(_handler)
            logger.setLevel(logging.NOTSET)
            logger.propagate = True
        return logger
    logger.setLevel(level_for(verbose))
    if not ours and not logger.handlers:
        logger.addHandler(_handler)
        logger.propagate = False
    return logger
