"""Names: how symbols are shown to people, and how generated code names things.

Display names (``DisplayNames``) map a spec's symbols to the forms people read
(μ, σ², x̂, γ ...) and order the terms of a sum as people write them; the
document printers and the comments of generated code share them.

Code names: the generated NumPy and C keep every name of their own --
loop variables, accumulators, reductions, coefficients, temporaries -- in a
namespace no spec identifier can reach. Spec identifiers are lower-case
(``[a-z][a-z0-9_]*``); derivgen's own names start with an upper-case letter
(``Grp``, ``Mean_g_xhat``, ``K_xhat``, ``Aux1``) or, in Python, an underscore
(``_chunk``, ``_np``). A user may therefore call a statistic ``s``, ``m``,
``base`` or ``mu_t``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import sympy
from sympy.printing.str import StrPrinter

from derivgen.symbolic import functions
from derivgen.symbolic.reduce import Mean

_ELEMENT = {"x", "dy", "g", "xhat"}


class _Shown(Protocol):
    """A named quantity as display names read it (a :class:`derivgen.spec.Named`)."""

    latex: str
    text: str


class _Layer(Protocol):
    """What display names read of a layer: a :class:`derivgen.spec.Spec` (typed by shape,
    because this stage sits below the spec stage)."""

    options: tuple[Any, ...]
    params: tuple[Any, ...]
    normalized: Any

    @property
    def symbols(self) -> Mapping[str, _Shown]:
        """The spec's names and their symbols."""


class DisplayNames:
    """How a layer's symbols are shown, by name: ``latex`` and ``text`` forms (μ, σ², x̂ ...),
    the names of element values (``element``: x, ∂L/∂y, g, x̂ and the parameters) and of the
    options (``options``), which the term order reads. ``extra`` adds names a later stage
    introduces (the second order's cotangents and tangents) without overriding the spec's."""

    def __init__(self, spec: _Layer | None = None, extra: Mapping[str, _Shown] | None = None) -> None:
        self.latex: dict[str, str] = {"dy": r"\frac{\partial L}{\partial y}", "g": "g", "x": "x", "N": "N"}
        self.text: dict[str, str] = {"dy": "∂L/∂y", "g": "g", "x": "x", "N": "N"}
        self.element = set(_ELEMENT)
        self.options: set[str] = set()
        self.code: dict[str, str] = {}  # names that comments of generated code spell otherwise
        self.indexed: set[str] = set()  # element values whose display already shows the index i
        if spec is not None:
            self.options = {o.name for o in spec.options}
            for n, item in spec.symbols.items():
                self.latex[n] = item.latex
                self.text[n] = item.text
            self.element |= {p.name for p in spec.params}
            for m in getattr(spec, "masks", ()):  # leading(p): an element value, written as in the spec
                self.element.add(m.name)
                self.indexed.add(m.name)
                self.code[m.name] = f"leading({m.option})"
            if spec.normalized is not None:
                self.element.add(spec.normalized.name)
        for n, item in (extra or {}).items():
            self.latex.setdefault(n, item.latex)
            self.text.setdefault(n, item.text)


def _term_key(names: DisplayNames) -> Callable[[sympy.Expr], tuple]:
    """The sort key of a sum's terms in the order people write them (see the comments)."""

    def key(t: sympy.Expr) -> tuple:
        syms = {str(s) for s in t.free_symbols}
        neg = t.could_extract_minus_sign()
        degree = sum(
            1
            for f in sympy.Mul.make_args(t)
            if {str(s) for s in f.free_symbols} & names.element and not isinstance(f, Mean)
        )
        return (
            neg,  # positive terms first
            -degree if not neg else 0,  # gamma*xhat + beta
            sympy.count_ops(t),  # simple before complex: g - mean(g) - ...
            bool(syms & names.options),  # eps and friends last
            sympy.default_sort_key(t),
        )

    return key


class _Ordered:
    """Order sums as people write them: x - μ, g - ⟨g⟩ - x̂⟨g x̂⟩, σ² + ε."""

    def _as_ordered_terms(self, expr: sympy.Expr, order: str | None = None) -> list[sympy.Expr]:
        return sorted(expr.args, key=_term_key(self.names))


class TextSpelling(functions.SpellsFunctions):
    """StrPrinter mixin: elementary functions as ``text(u)`` of their table entry
    (derivgen.symbolic.functions), a square root as ``sqrt(u)`` and ``1/sqrt(u)``."""

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        return f"{fn.text}({self.stringify(expr.args, ', ')})"

    def _print_GroupMax(self, expr: sympy.Expr) -> str:
        return f"max({self._print(expr.args[0])})"

    def _print_GroupMin(self, expr: sympy.Expr) -> str:
        return f"min({self._print(expr.args[0])})"

    def _print_Pow(self, expr: sympy.Pow, rational: bool = False) -> str:
        root = functions.half_power_sign(expr)
        if rational or not root:
            return super()._print_Pow(expr, rational)
        text = f"{functions.half_power().text}({self._print(expr.base)})"
        return text if root > 0 else f"{self._print(sympy.S.One)}/{text}"


class CodeTextPrinter(TextSpelling, _Ordered, StrPrinter):
    """Plain identifiers, natural term order: for comments in generated code."""

    def __init__(self, names: DisplayNames) -> None:
        super().__init__({"order": None})
        self.names = names

    def _print_Mean(self, expr: Mean) -> str:
        return f"mean({self._print(expr.args[0])})"

    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        return self.names.code.get(expr.name, expr.name)


def code_text(expr: sympy.Expr, spec: _Layer | None = None) -> str:
    """``expr`` as plain text for a comment in generated code (``mean(x - mu)``, terms in
    natural order), with ``spec``'s names."""
    return CodeTextPrinter(DisplayNames(spec)).doprint(expr)


def ordered_names(spec: _Layer | None) -> DisplayNames:
    """The display names the code printers order terms by, for ``spec``."""
    return DisplayNames(spec)


def derived(name: str, tag: str) -> str:
    """The code name derivgen gives a value derived from a user's name: ``mean_Out``
    (tag an upper-case word), unique because user names are unique and lower-case."""
    assert tag[:1].isupper()
    return f"{name}_{tag}"
