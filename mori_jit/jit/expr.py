"""Shared host/device arithmetic: an expression is evaluated in Python and emitted as C++.

Derived quantities (threads per block, receive capacity, validity, ...) are needed both by Python
(launch geometry, error messages) and by device code (``__launch_bounds__``, strides). Each is
written once as a :class:`Derived` over :data:`C` (the config) and becomes, in the generated header,
``constexpr <type> Name(const Cfg& c) { return ...; }`` — plain constexpr, no ``__host__
__device__``, so the header compiles with a host-only ``g++ -std=c++20``.

Integer ``/`` and ``%`` follow C++ (truncation toward zero), so both sides agree on negatives.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

__all__ = ["Expr", "C", "Derived", "where", "max_", "min_", "lit"]


class Expr(abc.ABC):
    """A node of an integer/bool expression over config fields."""

    @abc.abstractmethod
    def eval(self, cfg: Any) -> Any:
        """The value for config ``cfg`` (C++ integer semantics)."""

    @abc.abstractmethod
    def cpp(self) -> str:
        """The C++ expression text (over ``c``, the config)."""

    # arithmetic
    def __add__(self, o): return _Bin("+", self, lit(o))
    def __radd__(self, o): return _Bin("+", lit(o), self)
    def __sub__(self, o): return _Bin("-", self, lit(o))
    def __rsub__(self, o): return _Bin("-", lit(o), self)
    def __mul__(self, o): return _Bin("*", self, lit(o))
    def __rmul__(self, o): return _Bin("*", lit(o), self)
    def __truediv__(self, o): return _Bin("/", self, lit(o))
    def __rtruediv__(self, o): return _Bin("/", lit(o), self)
    def __mod__(self, o): return _Bin("%", self, lit(o))
    # comparisons (Python's `==` is kept for identity: use .eq / .ne)
    def __lt__(self, o): return _Bin("<", self, lit(o))
    def __le__(self, o): return _Bin("<=", self, lit(o))
    def __gt__(self, o): return _Bin(">", self, lit(o))
    def __ge__(self, o): return _Bin(">=", self, lit(o))
    def eq(self, o):
        """C++ ``==`` (Python's ``==`` stays identity, so expressions stay hashable)."""
        return _Bin("==", self, lit(o))

    def ne(self, o):
        """C++ ``!=``."""
        return _Bin("!=", self, lit(o))

    # logic: & | ~ mean && || !
    def __and__(self, o): return _Bin("&&", self, lit(o))
    def __or__(self, o): return _Bin("||", self, lit(o))
    def __invert__(self): return _Not(self)
    __hash__ = object.__hash__


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "/": _trunc_div, "%": lambda a, b: a - b * _trunc_div(a, b),
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
    "&&": lambda a, b: bool(a) and bool(b), "||": lambda a, b: bool(a) or bool(b),
}


class _Lit(Expr):
    def __init__(self, v: Any):
        self.v = v

    def eval(self, cfg):
        return self.v

    def cpp(self):
        if isinstance(self.v, bool):
            return "true" if self.v else "false"
        if hasattr(self.v, "cpp"):  # a CEnum member
            return self.v.cpp()
        return str(int(self.v))


def lit(v: Any) -> Expr:
    """Wrap a Python constant (int, bool, enum member) as an expression; expressions pass through."""
    return v if isinstance(v, Expr) else _Lit(v)


class _Field(Expr):
    def __init__(self, name: str):
        self.name = name

    def eval(self, cfg):
        v = getattr(cfg, self.name)
        return v

    def cpp(self):
        return f"c.{self.name}"


class _Bin(Expr):
    def __init__(self, op: str, a: Expr, b: Expr):
        self.op, self.a, self.b = op, a, b

    def eval(self, cfg):
        a, b = self.a.eval(cfg), self.b.eval(cfg)
        if self.op in "/%" and b == 0:
            raise ZeroDivisionError(f"division by zero in {self.cpp()}")
        return _OPS[self.op](a, b)

    def cpp(self):
        return f"({self.a.cpp()} {self.op} {self.b.cpp()})"


class _Not(Expr):
    def __init__(self, a: Expr):
        self.a = a

    def eval(self, cfg):
        return not self.a.eval(cfg)

    def cpp(self):
        return f"(!{self.a.cpp()})"


class _Where(Expr):
    def __init__(self, cond: Expr, a: Expr, b: Expr):
        self.cond, self.a, self.b = cond, a, b

    def eval(self, cfg):
        return self.a.eval(cfg) if self.cond.eval(cfg) else self.b.eval(cfg)

    def cpp(self):
        return f"({self.cond.cpp()} ? {self.a.cpp()} : {self.b.cpp()})"


def where(cond: Any, a: Any, b: Any) -> Expr:
    """C++ ``cond ? a : b``; also how table lookups (e.g. bytes per dtype) are written."""
    return _Where(lit(cond), lit(a), lit(b))


def max_(a: Any, b: Any) -> Expr:
    """The larger of ``a`` and ``b`` (a ``where``, so C++ needs no ``<algorithm>``)."""
    return where(lit(a) > lit(b), a, b)


def min_(a: Any, b: Any) -> Expr:
    """The smaller of ``a`` and ``b``."""
    return where(lit(a) < lit(b), a, b)


class _Fields:
    """``C.hiddenDim`` is the config field ``hiddenDim`` (``c.hiddenDim`` in C++)."""

    def __getattr__(self, name: str) -> Expr:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Field(name)


C = _Fields()


class Derived(Expr):
    """A named derived quantity: ``Name(cfg)`` in Python, ``constexpr T Name(const Cfg& c)`` in C++.

    A Derived may be used inside other expressions (emitted as a call), so definitions compose.
    """

    def __init__(self, name: str, cfg_type: str, expr: Any, ctype: str = "int", doc: str = ""):
        self.name, self.cfg_type, self.expr, self.ctype, self.doc = name, cfg_type, lit(expr), ctype, doc

    def __call__(self, cfg: Any) -> Any:
        v = self.expr.eval(cfg)
        return bool(v) if self.ctype == "bool" else int(v)

    def eval(self, cfg):
        return self(cfg)

    def cpp(self):
        return f"{self.name}(c)"

    def cpp_definition(self) -> str:
        """The ``constexpr`` function that defines this quantity in the generated header."""
        doc = f"// {self.doc}\n" if self.doc else ""
        return f"{doc}constexpr {self.ctype} {self.name}(const {self.cfg_type}& c) {{ return {self.expr.cpp()}; }}"
