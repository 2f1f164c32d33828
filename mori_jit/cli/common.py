"""What every verb of the CLI shares: its errors, argument helpers, and one-line error messages."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

__all__ = ["PROG", "package_version", "CliError", "UsageError", "Terminated", "Parser", "positive_int", "arch_name",
           "parse_sets", "resolve_arch", "toolchain_for", "toolchain_and_origin", "spec_named", "spec_cfg",
           "ensure_headers", "warn_stale_headers", "fmt_s", "compile_error_line", "error_line"]

PROG = "mori-jit"


def package_version() -> str:
    """The installed distribution's version, or ``(not installed)`` for a bare checkout."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("mori-jit")
    except (ImportError, PackageNotFoundError):
        return "(not installed)"


class CliError(Exception):
    """A user-facing error: printed as one ``mori-jit: error: ...`` line."""


class UsageError(CliError):
    """Bad command-line syntax (exit status 2)."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (``signum``). Raised in the main thread by the CLI's handler, so a
    command stops the way Ctrl-C stops it; a ``BaseException``, as ``KeyboardInterrupt`` is, so that
    no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see '{self.prog} --help')")



def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text, 0)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def arch_name(text: str) -> str:
    """argparse type: an arch mori-jit builds for (an empty or unknown one is refused, listing the
    known archs, before anything renders)."""
    from ..jit.toolchain import ToolchainError, check_arch
    try:
        check_arch(text)
    except ToolchainError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_sets(items: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise CliError(f"--set expects FIELD=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def resolve_arch(arch: str | None, *, from_compiler: bool = False) -> tuple[str | None, str]:
    """(arch, where it came from) or (None, why none is resolvable).

    The order is ``--arch``, ``MORI_JIT_ARCH``, the current device, and with ``from_compiler`` the
    default arch of the installed compiler (``precompile`` on a build machine without a GPU).
    """
    from ..jit import knobs, toolchain
    from ..jit.toolchain import ToolchainError, compiler_default_arch, detect_arch
    if arch is not None:  # (given, even empty: the caller checks it, never falls back)
        return arch, "--arch"
    env = knobs.compiler.arch
    if env:
        return env, "MORI_JIT_ARCH"
    try:
        return detect_arch(), "current device"
    except ToolchainError as e:
        no_device = str(e).rstrip(".")
    if not from_compiler:
        return None, no_device
    try:
        found, compiler = compiler_default_arch()
    except ToolchainError as e:
        return None, f"{no_device}; {e}"
    return found, f"the {toolchain.COMPILER_NAME[toolchain.vendor_of(found)]} at {compiler}, as no GPU is visible"


def toolchain_for(arch: str | None, *, need_compiler: bool = True, from_compiler: bool = False):
    """The toolchain for ``--arch`` / MORI_JIT_ARCH / the device (/ the installed compiler).

    Rendering never runs the compiler, so ``render``/``describe`` work without one
    (``need_compiler=False`` gives a toolchain with an empty compiler and signature).
    """
    return toolchain_and_origin(arch, need_compiler=need_compiler, from_compiler=from_compiler)[0]


def toolchain_and_origin(arch: str | None, *, need_compiler: bool = True, from_compiler: bool = False):
    """(:func:`toolchain_for`, where its arch came from, as :func:`resolve_arch` says)."""
    from ..jit.toolchain import make_toolchain
    resolved, why = resolve_arch(arch, from_compiler=from_compiler)
    if resolved is None:
        raise CliError(f"no arch: {why.rstrip('.')}; or pass --arch (e.g. --arch gfx90a, --arch sm_90a)")
    return make_toolchain(resolved, need_compiler=need_compiler), why


def spec_named(name: str):
    from ..jit.registry import get_spec
    try:
        return get_spec(name)
    except KeyError as e:
        raise CliError(e.args[0]) from None


def spec_cfg(args, *, need_compiler: bool = True):
    spec = spec_named(args.spec)
    tc = toolchain_for(args.arch, need_compiler=need_compiler)
    cfg = spec.make_cfg(tc, parse_sets(args.set))
    return spec, tc, cfg


def ensure_headers() -> None:
    """Regenerate stale generated headers before compiling (they are part of what is compiled)."""
    from ..jit.codegen import stale_headers, write_headers
    from ..jit.paths import kernels_dir
    kd = kernels_dir()
    stale = stale_headers(kd)
    if not stale:
        return
    try:
        written = write_headers(kd)
    except OSError as e:
        raise CliError(f"generated headers {', '.join(stale)} in {kd} are stale and cannot be rewritten: "
                       f"{e.strerror or e}") from None
    print(f"{PROG}: regenerated {', '.join(written)} in {kd}", file=sys.stderr)


def warn_stale_headers() -> None:
    from ..jit.codegen import stale_headers
    from ..jit.paths import kernels_dir
    stale = stale_headers(kernels_dir())
    if stale:
        print(f"{PROG}: warning: generated headers {', '.join(stale)} are stale; 'mori-jit compile' "
              f"regenerates them, which changes this key", file=sys.stderr)


def fmt_s(s: float) -> str:
    return f"{s:6.2f}s"


def compile_error_line(e) -> str:
    lines = [ln.strip() for ln in (e.stderr or "").splitlines() if ln.strip()]
    pick = next((ln for ln in lines if re.search(r"\berror\b", ln, re.I)), lines[-1] if lines else "(no output)")
    kept = f"source kept at {e.source_path}" if e.source_path else "MORI_JIT_KEEP_FAILED=1 keeps the source"
    return (f"{e.step} {e.spec} failed (exit {e.returncode}): {pick} "
            f"[{kept}; MORI_JIT_VERBOSE=1 prints the command and the full output]")


def error_line(e: BaseException) -> str:
    from ..jit.compile import CompileError
    if isinstance(e, CompileError):
        return compile_error_line(e)
    if isinstance(e, KeyError) and e.args:
        msg = str(e.args[0])
    else:
        msg = str(e) or type(e).__name__
    from ..jit.fields import ConfigError
    from ..jit.paths import SourceRootError
    from ..jit.toolchain import ToolchainError
    known = (CliError, ConfigError, ToolchainError, SourceRootError, OSError, ValueError)
    if not isinstance(e, known):
        msg = f"{type(e).__name__}: {msg} (MORI_JIT_VERBOSE=2 shows the traceback)"
    return "; ".join(ln.strip() for ln in msg.splitlines() if ln.strip())


