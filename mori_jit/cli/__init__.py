"""``mori-jit``: inspect, build and manage the JIT cache from the shell.

Verbs (``mori-jit <verb> --help`` describes each; ``mori-jit --version`` prints the version)::

    mori-jit info [--arch A]                      arch, compiler + signature, engines, source root, cache, env
    mori-jit render SPEC [--arch A] [--set k=v ...]   the translation unit
    mori-jit key SPEC [--arch A] [--set k=v ...]      the hex cache key
    mori-jit describe SPEC [--arch A] [--set k=v ...] JSON: spec, entry, cfg fields, schema
    mori-jit compile SPEC [--arch A] [--set k=v ...]  build (or hit); prints the entry directory
    mori-jit precompile [--arch A] [-j N]          everything the shipped specs need
    mori-jit cache path|ls|verify|clear

``--arch`` builds a toolchain for that arch (:func:`~mori_jit.jit.toolchain.make_toolchain`, no
process-wide state); without it the arch is ``MORI_JIT_ARCH``, else the current device, and for
``precompile`` on a machine without a GPU the installed compiler's (nvcc: sm_90a, hipcc: gfx90a). ``--set``
values go through ``spec.make_cfg(toolchain, request)`` (numeric strings and enum names are coerced
there). Bad input exits non-zero with one ``mori-jit: error: ...`` line on stderr and no traceback
(``MORI_JIT_VERBOSE=2`` shows it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import traceback
import warnings
from typing import Iterator, Sequence

from .build import cmd_compile, cmd_describe, cmd_key, cmd_precompile, cmd_render, precompile_targets
from .cache import cmd_cache
from .common import PROG, CliError, Parser, Terminated, UsageError, arch_name, error_line, package_version, positive_int
from .info import cmd_info

__all__ = ["main", "precompile_targets", "CliError", "UsageError"]



def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="mori-jit: inspect, build and cache JIT GPU kernels.")
    p.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def verb(name, help_):  # the help line doubles as the description that the verb's --help shows
        return sub.add_parser(name, help=help_, description=help_ + ".")

    def arch_opt(sp):
        sp.add_argument("--arch", type=arch_name, help="target arch (gfx90a, gfx942, sm_90a, ...); default: "
                                                        "MORI_JIT_ARCH, else the current device")

    def spec_verb(name, help_):
        sp = verb(name, help_)
        sp.add_argument("spec", help="spec name (see 'mori-jit info')")
        arch_opt(sp)
        sp.add_argument("--set", action="extend", nargs="+", metavar="FIELD=VALUE", default=[],
                        help="config field overrides (enum names and numeric strings are accepted)")
        return sp

    sp = verb("info", "show the arch, compilers, launch bindings, source root, cache and settings")
    arch_opt(sp)
    sp.set_defaults(fn=cmd_info)
    for name, help_, fn in (
            ("render", "print the translation unit a config renders to (needs no compiler)", cmd_render),
            ("key", "print the cache key of a config: its source, toolchain and headers hashed", cmd_key),
            ("describe", "print the spec, kernel entry, config, geometry and request schema as JSON", cmd_describe),
            ("compile", "build one config into the cache (or find it there) and print its entry directory",
             cmd_compile)):
        spec_verb(name, help_).set_defaults(fn=fn)

    sp = verb("precompile", "compile every kernel the shipped specs (or one EP config) need for one arch")
    sp.add_argument("--arch", type=arch_name,
                    help="target arch (gfx90a, gfx942, sm_90a, ...); default: MORI_JIT_ARCH, else the current "
                         "device, else the installed compiler's (nvcc: sm_90a, hipcc: gfx90a)")
    sp.add_argument("-j", "--jobs", type=positive_int, default=None, help="parallel compiles (default: CPU count)")
    sp.add_argument("--ep", action="extend", nargs="+", metavar="KEY=VALUE", default=[],
                    help="EP op configuration to precompile variants for (see precompile_targets)")
    sp.set_defaults(fn=cmd_precompile)

    sp = verb("cache", "manage the kernel cache: print its path, list, verify or clear it")
    sp.add_argument("action", choices=["path", "ls", "verify", "clear"])
    sp.add_argument("--remove", action="store_true", help="verify: delete corrupt entries")
    sp.set_defaults(fn=cmd_cache)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 error, 2 bad usage, 128 + the signal when one
    stopped it: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP; 141 when the reader of stdout left, as for a
    program that SIGPIPE ends, without a message).

    Python warnings raised while a command runs (torch warns at import when e.g. numpy is missing)
    are held back: after success they are printed as ``mori-jit: warning:`` lines, after an error
    only with ``MORI_JIT_VERBOSE`` >= 1, so an error stays one line.
    """
    with warnings.catch_warnings(record=True) as caught:
        status, error = _run(argv)
    if error is None or _verbose() >= 1:
        for line in dict.fromkeys(" ".join(str(w.message).split()) for w in caught):
            print(f"{PROG}: warning: {line}", file=sys.stderr)
    if error is not None:
        print(error, file=sys.stderr)
    return status


def _verbose() -> int:
    try:
        from ..jit import knobs
        return knobs.log.verbose
    except Exception:  # pragma: no cover - a malformed variable must not hide the real error
        return 0


#: The signals that stop a command as Ctrl-C does: ``kill`` (SIGTERM) and a closed terminal (SIGHUP).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise :class:`Terminated` in the main thread (their default action
    ends the process at once, leaving the compilers running and their build directories behind);
    the previous handlers come back after. Elsewhere than the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, raise_terminated) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(argv: Sequence[str] | None) -> tuple[int, str | None]:
    """Parse and run one command: (exit status, the one error line or None)."""
    try:
        with _stop_signals_raise():
            args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
            return args.fn(args), None
    except SystemExit as e:  # --help
        return (e.code if isinstance(e.code, int) else (0 if e.code is None else 1)), None
    except KeyboardInterrupt:
        return 128 + signal.SIGINT, f"{PROG}: interrupted"
    except Terminated as e:
        return 128 + e.signum, f"{PROG}: stopped by {signal.Signals(e.signum).name}"
    except BrokenPipeError:  # the reader left (``mori-jit info | head``): nothing to tell, and no one to tell it
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE, None
    except BaseException as e:  # noqa: BLE001 - the one place errors become exit codes
        verbose = _verbose()
        if verbose >= 2:
            traceback.print_exc()
        elif verbose >= 1 and not isinstance(e, CliError):
            print(str(e), file=sys.stderr)
        return (2 if isinstance(e, UsageError) else 1), f"{PROG}: error: {error_line(e)}"


def _stdout_to_devnull() -> None:
    """Point the stdout descriptor at /dev/null, so the interpreter's last flush of the closed pipe
    at exit raises nothing either."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stdout without a descriptor (a caller's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
