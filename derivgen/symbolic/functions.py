"""The elementary functions, as one table.

Every function a spec expression may call (``sqrt``, ``exp``, ``log``, ``abs``,
``tanh``, ``sigmoid``, ``softplus``, ``erf``, ``stop_gradient``, and the selections ``maximum``,
``minimum``, ``clip``), and the functions that only appear in derivatives
(``sign`` of ``abs``; the masks ``step`` and ``indicator`` of the selections),
is one :class:`Elementary` entry of :data:`TABLE`: how the parser builds it, how it is
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

from derivgen.symbolic.nodes import (
    Clip,
    Indicator,
    Maximum,
    Minimum,
    Sigmoid,
    Softplus,
    Step,
    StopGradient,
)

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
    ``arity`` is how many arguments the parser takes. A function of one argument
    has a ``derivative`` rule; one of several (the selections) has none: its SymPy
    class's ``fdiff`` gives each partial derivative, as masks (``step``,
    ``indicator``). ``sign(*levels)`` takes one level per argument.
    ``numpy`` names a NumPy function, or (``numpy_in_runtime``) a function of
    :mod:`derivgen.runtime` where NumPy has none (``_rt.sigmoid``). ``torch`` names
    a function of the ``torch`` module, called with the arguments and then the
    constants ``torch_extra`` (heaviside's value at zero). ``unfold`` writes the function with
    ``Abs`` and ``sign`` where it holds off its kinks (the proof splits cases on
    them); ``None`` where the function is smooth. ``triton`` names the Triton target's function
    where it is not the entry's name (:attr:`triton_name`); the JAX target finds its function by
    the entry's names (``derivgen.jax._target``). Every target's spellings are checked against
    this table (``tests/codegen/test_targets.py``).
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
    numpy_in_runtime: bool = False
    torch_extra: tuple[float, ...] = ()
    unfold: Callable[..., sympy.Expr] | None = None
    derivative_note: str = ""
    triton: str = ""

    @property
    def triton_name(self) -> str:
        """The ``triton.jit`` function of ``derivgen.triton._target`` the Triton kernels call
        (``_tt.<name>``): ``triton`` where the entry gives one, else the entry's name."""
        return self.triton or self.name

    def c(self, ctype: str) -> str:
        """The C spelling for element type ``ctype`` ("float" or "double")."""
        return self.c_float if ctype == "float" else self.c_double


def call(spelling: str, *args: str) -> str:
    """A target's text for a function applied to the printed arguments ``args``:
    ``spelling(a, b)``, or ``spelling`` with ``{0}``, ``{1}`` ... replaced where it is a template."""
    return spelling.format(*args) if "{0}" in spelling else f"{spelling}({', '.join(args)})"


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
        c_double="Dg_exp",
        c_float="Dg_expf",
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
        c_double="Dg_log",
        c_float="Dg_logf",
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
        c_double="Dg_tanh",
        c_float="Dg_tanhf",
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


# the selections, sigmoid, softplus, stop_gradient and the masks are SymPy functions of our own
# (derivgen.symbolic.nodes)


def _max_level(*levels: int) -> int:
    """Sign rule of a maximum: at least what its larger argument is known to be."""
    return max(levels)


def _min_level(*levels: int) -> int:
    """Sign rule of a minimum: what its smaller argument is known to be."""
    return min(levels)


def _clip_level(e: int, lo: int, hi: int) -> int:
    """Sign rule of clip(e, lo, hi) = minimum(maximum(e, lo), hi)."""
    return min(max(e, lo), hi)


def _step_value(t: float) -> float:
    return 1.0 if t > 0 else (0.0 if t < 0 else 0.5)


def _sigmoid_value(u: float) -> float:
    """sigmoid(u) for a Python number, without overflow for large |u|."""
    if u >= 0:
        return 1.0 / (1.0 + math.exp(-u))
    z = math.exp(u)
    return z / (1.0 + z)


def _as_abs(kind: str) -> Callable[..., sympy.Expr]:
    """The selections written with |.| and sign (valid where no argument is at a kink)."""

    def maximum(a, b):
        return (a + b + sympy.Abs(a - b)) / 2

    def minimum(a, b):
        return (a + b - sympy.Abs(a - b)) / 2

    def clip(e, lo, hi):
        return minimum(maximum(e, lo), hi)

    def step(t):
        return (1 + sympy.sign(t)) / 2

    return {"maximum": maximum, "minimum": minimum, "clip": clip, "step": step, "indicator": step}[kind]


register(
    Elementary(
        "sigmoid",
        Sigmoid,
        Sigmoid,
        lambda f, u: f * (1 - f),
        "sigmoid",
        _positive,
        REAL,
        numpy="sigmoid",
        numpy_in_runtime=True,
        c_double="Dg_sigmoid",
        c_float="Dg_sigmoidf",
        torch="sigmoid",
        scalar=_sigmoid_value,
        latex=r"\operatorname{sigmoid}",
        text="sigmoid",
    )
)


def _softplus_value(u: float) -> float:
    """log(1 + exp(u)) for a Python number, without overflow."""
    return max(u, 0.0) + math.log1p(math.exp(-abs(u)))


register(
    Elementary(
        "softplus",
        Softplus,
        Softplus,
        lambda f, u: Sigmoid(u),
        "softplus",
        _positive,
        REAL,
        numpy="softplus",
        numpy_in_runtime=True,
        c_double="Dg_softplus",
        c_float="Dg_softplusf",
        torch="logaddexp",
        torch_extra=(0.0,),
        scalar=_softplus_value,
        latex=r"\operatorname{softplus}",
        text="softplus",
    )
)
register(
    Elementary(
        "erf",
        sympy.erf,
        sympy.erf,
        lambda f, u: 2 * sympy.exp(-(u**2)) / sympy.sqrt(sympy.pi),
        "error function",
        _same,
        REAL,
        numpy="erf",
        numpy_in_runtime=True,
        c_double="Dg_erf",
        c_float="Dg_erff",
        torch="erf",
        scalar=math.erf,
        latex=r"\operatorname{erf}",
        text="erf",
    )
)
register(
    Elementary(
        "stop_gradient",
        StopGradient,
        StopGradient,
        lambda f, u: sympy.S.Zero,
        "stop-gradient",
        _same,
        REAL,
        numpy="stop_gradient",
        numpy_in_runtime=True,
        c_double="({0})",
        c_float="({0})",
        torch="detach",
        scalar=lambda u: u,
        latex=r"\operatorname{sg}",
        text="stop_gradient",
        unfold=lambda e: e,
        derivative_note="zero: the value is used, no gradient flows through it (.detach())",
    )
)
register(
    Elementary(
        "maximum",
        Maximum,
        Maximum,
        None,
        "maximum",
        _max_level,
        REAL,
        numpy="maximum",
        c_double="Dg_fmax",
        c_float="Dg_fmaxf",
        torch="maximum",
        scalar=max,
        latex=r"\max",
        text="maximum",
        arity=2,
        unfold=_as_abs("maximum"),
        derivative_note="step(a - b) to a and step(b - a) to b: the larger gets the gradient, a tie splits it evenly",
    )
)
register(
    Elementary(
        "minimum",
        Minimum,
        Minimum,
        None,
        "minimum",
        _min_level,
        REAL,
        numpy="minimum",
        c_double="Dg_fmin",
        c_float="Dg_fminf",
        torch="minimum",
        scalar=min,
        latex=r"\min",
        text="minimum",
        arity=2,
        unfold=_as_abs("minimum"),
        derivative_note="step(b - a) to a and step(a - b) to b: the smaller gets the gradient, a tie splits it evenly",
    )
)
register(
    Elementary(
        "clip",
        Clip,
        Clip,
        None,
        "clip",
        _clip_level,
        REAL,
        numpy="clip",
        c_double="Dg_fmin(Dg_fmax({0}, {1}), {2})",
        c_float="Dg_fminf(Dg_fmaxf({0}, {1}), {2})",
        torch="clamp",
        scalar=lambda e, lo, hi: min(max(e, lo), hi),
        latex=r"\operatorname{clip}",
        text="clip",
        arity=3,
        unfold=_as_abs("clip"),
        derivative_note=(
            "indicator(e - lo)·indicator(hi - e) to e (the closed interval), "
            "1 - indicator(e - lo) to lo, 1 - indicator(hi - e) to hi"
        ),
    )
)
register(
    Elementary(
        "step",
        Step,
        Step,
        lambda f, u: sympy.S.Zero,
        "step",
        lambda level: POSITIVE if level == POSITIVE else NONNEG,
        REAL,
        numpy="step",
        numpy_in_runtime=True,
        # two selects added, not one nested in the other: GCC vectorizes these on AVX2 too (the
        # nested form only with AVX-512's masks); the same values, 0.5 at ±0 and at NaN
        c_double="((({0}) > 0 ? 0.5 : 0.0) + (({0}) < 0 ? 0.0 : 0.5))",
        c_float="((({0}) > 0 ? 0.5f : 0.0f) + (({0}) < 0 ? 0.0f : 0.5f))",
        torch="heaviside",
        torch_extra=(0.5,),
        scalar=_step_value,
        latex=r"\left[{0} > 0\right]",
        text="step",
        in_language=False,
        unfold=_as_abs("step"),
    )
)
register(
    Elementary(
        "indicator",
        Indicator,
        Indicator,
        lambda f, u: sympy.S.Zero,
        "indicator",
        lambda level: POSITIVE if level >= NONNEG else NONNEG,
        REAL,
        numpy="indicator",
        numpy_in_runtime=True,
        c_double="(({0}) >= 0 ? 1.0 : 0.0)",
        c_float="(({0}) >= 0 ? 1.0f : 0.0f)",
        torch="heaviside",
        torch_extra=(1.0,),
        scalar=lambda t: 1.0 if t >= 0 else 0.0,
        latex=r"\left[{0} \geq 0\right]",
        text="indicator",
        in_language=False,
        unfold=_as_abs("indicator"),
    )
)

CONSTANTS: dict[str, sympy.Expr] = {"pi": sympy.pi}
"""Named constants a spec expression may use (a spec may not declare these names)."""


def unfold(e: sympy.Expr) -> sympy.Expr:
    """``e`` with every table function that has an ``unfold`` written through |.| and sign
    (the selections and masks), and stop-gradients replaced by their argument: equal to
    ``e`` wherever no selection is at a kink."""
    out = e
    for fn in TABLE.values():
        if fn.unfold is not None and fn.node is not None and out.has(fn.node):
            out = out.replace(lambda a, c=fn.node: isinstance(a, c), lambda a, f=fn.unfold: f(*a.args))
    return out


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


def numpy_path(fn: Elementary) -> str:
    """Where generated NumPy finds the entry: ``numpy.<name>`` or ``derivgen.runtime.<name>``."""
    return ("runtime." if fn.numpy_in_runtime else "numpy.") + fn.numpy


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
