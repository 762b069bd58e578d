"""The elementary functions, as one table.

Every function a spec expression may call (``sqrt``, ``exp``, ``log``, ``abs``,
``tanh``), and ``sign`` (which only appears as the derivative of ``abs``), is one
:class:`Elementary` entry of :data:`TABLE`: how the parser builds it, how it is
differentiated, what is known about its sign and where it is defined, and how
each target spells it. The parser (:mod:`derivgen.spec.expr`), the engine's
derivative rules, :mod:`derivgen.symbolic.domain`, :mod:`derivgen.tools.evaluate`, the code
printers, the PyTorch target (:mod:`derivgen.torch._target`), the document
printers and the names a spec may not declare all read this table, so adding
a function is one entry here and a test (``tests/symbolic/test_functions.py``).

This is a bottom-layer module: it imports SymPy and the standard library only.

``sqrt`` is special: SymPy writes ``sqrt(u)`` as the power ``u**(1/2)``, so it has
no node class of its own (``node`` is None). The engine differentiates it, and
:mod:`derivgen.symbolic.domain` reasons about it, by the rules for non-integer powers; its
entry gives the parser its constructor and the targets their spelling of a
half power. Its derivative and sign entries state the same rules, and the test
checks them against SymPy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy

# What a value is known to be on the layer's domain (derivgen.symbolic.domain re-exports these).
REAL, NONNEG, POSITIVE = 0, 1, 2


@dataclass(frozen=True)
class Elementary:
    """One elementary function F of one argument u.

    ``derivative(f, u)`` is F'(u), written with ``f`` standing for F(u) where that
    is cheaper (tanh' = 1 - f²): the engine differentiates a statistic s = c·F(u)
    through s itself. ``sign(level)`` is what F(u) is known to be (REAL, NONNEG,
    POSITIVE) given what u is known to be; ``requires`` is what u must be for F(u)
    to be defined (a spec whose argument is known never to be that is rejected).
    The C spellings are a function name (printed ``name(u)``) or a template with
    ``{0}`` for the printed argument. ``latex`` is an operator name printed
    ``\\op{\\left(u \\right)}`` (a power as ``\\op^{k}``), or a template with ``{0}``
    (a power appended as ``^{k}``).
    ``text`` is the name plain text and comments print it as: ``text(u)``.
    ``arity`` is how many arguments the parser takes; the derivative, sign and
    domain rules are written for one, as every entry has.
    """

    name: str
    build: Callable[[sympy.Expr], sympy.Expr]
    node: type | None
    derivative: Callable[[sympy.Expr, sympy.Expr], sympy.Expr]
    kind: str
    sign: Callable[[int], int]
    requires: int
    numpy: str
    c_double: str
    c_float: str
    torch: str
    scalar: Callable[[float], float]
    latex: str
    text: str
    arity: int = 1
    in_language: bool = True

    def c(self, ctype: str) -> str:
        """The C spelling for element type ``ctype`` ("float" or "double")."""
        return self.c_float if ctype == "float" else self.c_double


def call(spelling: str, arg: str) -> str:
    """A target's text for a function applied to the printed argument ``arg``:
    ``spelling(arg)``, or ``spelling`` with ``{0}`` replaced where it is a template."""
    return spelling.format(arg) if "{0}" in spelling else f"{spelling}({arg})"


def _nonnegative(level: int) -> int:
    """Sign rule: non-negative, positive where the argument is."""
    return POSITIVE if level == POSITIVE else NONNEG


def _positive(level: int) -> int:
    """Sign rule: positive whatever the argument."""
    return POSITIVE


def _unknown(level: int) -> int:
    """Sign rule: nothing known."""
    return REAL


def _same(level: int) -> int:
    """Sign rule: what the argument is (an odd, increasing function through 0)."""
    return level


def _abs(a: float) -> float:
    """|a| for a Python number."""
    return -a if a < 0 else a


def _sign(a: float) -> int:
    """sign(a) for a Python number: -1, 0 or 1."""
    return (a > 0) - (a < 0)


TABLE: dict[str, Elementary] = {}


def register(fn: Elementary) -> Elementary:
    """Add ``fn`` to the table (a name already there is an error); returns it."""
    if fn.name in TABLE:
        raise ValueError(f"elementary function {fn.name!r} is already in the table")
    TABLE[fn.name] = fn
    return fn


def unregister(name: str) -> None:
    """Remove the entry ``name`` (tests that register a function of their own)."""
    del TABLE[name]


register(
    Elementary(
        "sqrt",
        sympy.sqrt,
        None,
        lambda f, u: 1 / (2 * f),
        "square root",
        _nonnegative,
        NONNEG,
        numpy="sqrt",
        c_double="sqrt",
        c_float="sqrtf",
        torch="sqrt",
        scalar=math.sqrt,
        latex=r"\sqrt{{{0}}}",
        text="sqrt",
    )
)
register(
    Elementary(
        "exp",
        sympy.exp,
        sympy.exp,
        lambda f, u: f,
        "exponential",
        _positive,
        REAL,
        numpy="exp",
        c_double="exp",
        c_float="expf",
        torch="exp",
        scalar=math.exp,
        latex="e^{{{0}}}",
        text="exp",
    )
)
register(
    Elementary(
        "log",
        sympy.log,
        sympy.log,
        lambda f, u: 1 / u,
        "logarithm",
        _unknown,
        POSITIVE,
        numpy="log",
        c_double="log",
        c_float="logf",
        torch="log",
        scalar=math.log,
        latex=r"\log{{\left({0} \right)}}",
        text="log",
    )
)
register(
    Elementary(
        "abs",
        sympy.Abs,
        sympy.Abs,
        lambda f, u: sympy.sign(u),
        "absolute value",
        _nonnegative,
        REAL,
        numpy="abs",
        c_double="fabs",
        c_float="fabsf",
        torch="abs",
        scalar=_abs,
        latex=r"\left|{{{0}}}\right|",
        text="Abs",
    )
)
register(
    Elementary(
        "tanh",
        sympy.tanh,
        sympy.tanh,
        lambda f, u: 1 - f**2,
        "tanh",
        _same,
        REAL,
        numpy="tanh",
        c_double="tanh",
        c_float="tanhf",
        torch="tanh",
        scalar=math.tanh,
        latex=r"\tanh",
        text="tanh",
    )
)
register(
    Elementary(
        "sign",
        sympy.sign,
        sympy.sign,
        lambda f, u: sympy.S.Zero,
        "sign",
        _unknown,
        REAL,
        numpy="sign",
        c_double="((({0}) > 0) - (({0}) < 0))",
        c_float="((({0}) > 0) - (({0}) < 0))",
        torch="sign",
        scalar=_sign,
        latex=r"\operatorname{sign}",
        text="sign",
        in_language=False,
    )
)


def language() -> dict[str, Elementary]:
    """The functions a spec expression may call, by name, in table order."""
    return {n: fn for n, fn in TABLE.items() if fn.in_language}


def of_class(cls: type) -> Elementary | None:
    """The entry whose SymPy class is ``cls`` or a base of it (None: not a table
    function; a square root is a power)."""
    for fn in TABLE.values():
        if fn.node is not None and issubclass(cls, fn.node):
            return fn
    return None


def of_node(e: sympy.Basic) -> Elementary | None:
    """The entry of the SymPy node ``e`` (see :func:`of_class`)."""
    return of_class(type(e))


def of_numpy_name(name: str) -> Elementary | None:
    """The entry spelled ``name`` in NumPy (and by the PyTorch target), or None."""
    return next((fn for fn in TABLE.values() if fn.numpy == name), None)


def half_power() -> Elementary:
    """The entry targets spell a power ``u**(1/2)`` with: ``sqrt``."""
    return TABLE["sqrt"]


class SpellsFunctions:
    """Printer mixin: a node of a table function is printed by the printer's
    ``_print_elementary(fn, expr, **kwargs)``, which spells it from the entry ``fn``
    (instead of SymPy's own printing of that class)."""

    def _print(self, expr: sympy.Basic, **kwargs: Any) -> str:
        fn = of_node(expr) if isinstance(expr, sympy.Function) else None
        if fn is None:
            return super()._print(expr, **kwargs)
        return self._print_elementary(fn, expr, **kwargs)


def half_power_sign(e: sympy.Expr) -> int:
    """1 when ``e`` is a square root u**(1/2), -1 for u**(-1/2), else 0."""
    if not e.is_Pow:
        return 0
    return 1 if e.exp == sympy.S.Half else (-1 if e.exp == -sympy.S.Half else 0)
