"""Several plans that share one args layout, launched in order with a single packing (the plans of
one op's step: :class:`LaunchGroup`)."""
from __future__ import annotations

import ctypes
from typing import Any, Iterable

from .packing import check_struct_type, layout_difference
from .plan import Plan, bind_launch_buffers

__all__ = ["LaunchGroup"]


class LaunchGroup:
    """Several plans sharing one args layout, launched in order with a single packing.

    Construction raises ``ValueError`` if the plans' ``layout`` (the full ``(name, offset, size)``
    sequence) differ — naming the first difference — or if they live on different devices or
    runtimes, or if there are none. Geometry and function handles are bound up front.
    """

    def __init__(self, plans: Iterable[Plan]):
        self.plans: tuple[Plan, ...] = tuple(plans)
        if not self.plans:
            raise ValueError("LaunchGroup needs at least one plan")
        first = self.plans[0]
        for i, p in enumerate(self.plans[1:], 1):
            diff = layout_difference(first.layout, p.layout, first.schema.size, p.schema.size)
            if diff:
                raise ValueError(f"LaunchGroup: plan {i} ({p.name}, {p.schema.name}) has a different args layout "
                                 f"than plan 0 ({first.name}, {first.schema.name}): {diff}")
            if p.device != first.device:
                raise ValueError(f"LaunchGroup: plan {i} ({p.name}) is on device {p.device}, plan 0 on {first.device}")
            if p.runtime is not first.runtime:
                raise ValueError(f"LaunchGroup: plan {i} ({p.name}) uses another runtime than plan 0")
        self.layout = first.layout
        self.schema = first.schema
        self.device = first.device
        self._ctype = first._ctype
        self._packer = first._packer
        self._pack = self._packer.pack
        bind_launch_buffers(self)
        self._launchers = tuple(p._launch for p in self.plans)
        self._stream = first._stream

    def __len__(self) -> int:
        return len(self.plans)

    def __repr__(self) -> str:
        return f"<LaunchGroup {[p.name for p in self.plans]} device={self.device}>"

    def args(self, **fields: Any) -> Any:
        """A new reusable args struct of the shared layout (see :meth:`Plan.args`)."""
        return self._packer.struct(fields if fields else None)

    def launch(self, *struct: Any, **fields: Any) -> None:
        """Pack once, then launch every plan in order on the current stream (or launch a struct)."""
        if struct:
            if len(struct) != 1 or fields:
                raise TypeError("LaunchGroup.launch() takes one args struct or keyword fields, not both")
            return self.launch_struct(struct[0])
        self._pack(self._buf, fields)
        stream = self._stream()
        kp = self._kp_addr
        for launch in self._launchers:
            launch(stream, kp)

    def launch_struct(self, struct: Any) -> None:
        """Launch every plan with one already packed struct."""
        if type(struct) is not self._ctype:
            check_struct_type(struct, self.layout, self.schema.size, "LaunchGroup")
        self._kp_user[0] = ctypes.addressof(struct)
        stream = self._stream()
        kp = self._kp_user_addr
        for launch in self._launchers:
            launch(stream, kp)
