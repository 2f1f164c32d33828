"""Spec: everything about one kernel kind, in one class.

A Spec owns its Cfg type, its args schema, the entry (symbol) name, the Jinja template of the whole
translation unit, the launch geometry and its source dependencies. The rendered text is the
specialization identity: the key is computed over it (see :mod:`mori_jit.jit.key`).

To add a kernel, subclass :class:`Spec` in a module named ``*_spec.py``/``specs.py`` inside the
package, declare its generated header, and call :func:`~mori_jit.jit.registry.register` — nothing
else changes (see ``mori_jit/examples/axpy_spec.py``).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, Mapping

import jinja2

from .args import ArgsSchema
from .devlib import DeviceLibrary
from .fields import apply_request, describe, render_cfg
from .paths import templates_dir
from .toolchain import Toolchain

__all__ = ["Spec", "Geometry", "platform_header"]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Launch geometry: grid and block dimensions and dynamic shared memory bytes."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0


def platform_header(toolchain: Toolchain) -> str:
    """The vendor platform header, chosen on the host by arch (so the choice is in the text)."""
    return f"platform/{toolchain.vendor}.hpp"


@functools.lru_cache(maxsize=8)
def _jinja_env(tdir: str) -> jinja2.Environment:
    # No bytecode cache on disk: Jinja unpickles it, so a file planted there would run as the user,
    # and parsing the templates costs about 3 ms per process (a cached one about 1 ms).
    return jinja2.Environment(loader=jinja2.FileSystemLoader(tdir), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


class Spec(abc.ABC):
    """Base class of kernel specs. Subclasses set the class attributes and the ``template_vars``.

    Exception contract: ``make_cfg``/``apply_request`` raise :class:`~mori_jit.jit.fields.ConfigError`
    for a bad request; rendering never touches the environment or the compiler.
    """

    #: registry name (``mori-jit render <name>``)
    name: str = ""
    #: the Cfg dataclass
    cfg_type: type = object
    #: the args struct declaration
    args: ArgsSchema
    #: template file under ``templates/``
    template: str = ""
    #: directories under the source root whose files are hashed into the key
    deps: tuple[str, ...] = ("kernels",)
    #: device libraries the kernel is device-linked against (their headers are on the include path,
    #: their archives and headers enter the key, their hooks run on each loaded module)
    device_libraries: tuple[DeviceLibrary, ...] = ()

    def default_cfg(self, toolchain: Toolchain) -> Any:
        """The config used when a request sets nothing (arch-dependent defaults go here)."""
        return self.cfg_type()

    def precompile_cfgs(self, toolchain: Toolchain) -> list[Any]:
        """The configs ``mori-jit precompile`` builds for this spec on ``toolchain`` (default: the default config)."""
        return [self.default_cfg(toolchain)]

    def make_cfg(self, toolchain: Toolchain, request: Mapping[str, Any] | None = None) -> Any:
        """Default config for ``toolchain`` with ``request`` (field name → value) applied."""
        return apply_request(self.default_cfg(toolchain), request or {})

    @abc.abstractmethod
    def entry_name(self, cfg: Any) -> str:
        """The kernel symbol: written into the source and used for the module lookup."""

    @abc.abstractmethod
    def geometry(self, cfg: Any) -> Geometry:
        """Launch geometry for ``cfg``."""

    def template_vars(self, cfg: Any, toolchain: Toolchain) -> dict[str, Any]:
        """Spec-specific template variables (body header, element types, ...)."""
        return {}

    def source_deps(self) -> tuple[str, ...]:
        """Directories under the source root whose files' contents enter the cache key."""
        return self.deps

    def module_init_hooks(self) -> tuple[Callable[[int], None], ...]:
        """What runs on each module loaded from this spec's binary, in order, given the driver's
        module handle (default: each device library's :meth:`~mori_jit.jit.devlib.DeviceLibrary.init_module`)."""
        return tuple(lib.init_module for lib in self.device_libraries)

    def describe(self, cfg: Any) -> dict[str, Any]:
        """``cfg`` as a JSON-able dict (``mori-jit describe``)."""
        return describe(cfg)

    def render_source(self, cfg: Any, toolchain: Toolchain) -> str:
        """The complete translation unit for ``cfg`` on ``toolchain.arch``."""
        if type(cfg) is not self.cfg_type:
            raise TypeError(f"{self.name}: expected a {self.cfg_type.__name__}, got {type(cfg).__name__}")
        tmpl = _jinja_env(str(templates_dir())).get_template(self.template)
        return tmpl.render(spec=self.name, arch=toolchain.arch, vendor=toolchain.vendor,
                           platform_header=platform_header(toolchain), cfg=render_cfg(cfg),
                           cfg_type=self.cfg_type.__name__, args_type=self.args.name,
                           entry=self.entry_name(cfg), **self.template_vars(cfg, toolchain))
