"""Expressions for people: LaTeX and plain text with a layer's display names.

Two small printers over SymPy's own: spec symbols print with their display
names (μ, σ², x̂, γ ...), element-level symbols carry the subscript i outside
a group mean, and ``Mean(e)`` prints as ⟨e⟩ (LaTeX) or mean(e) (text).

:func:`latex_expr` and :func:`text_expr` are what the steps and the documents print with;
:func:`mode_names` gives a mode's display names beyond the spec's.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy
from sympy.printing.latex import LatexPrinter
from sympy.printing.str import StrPrinter

from derivgen.derive.results import ModeDerivation
from derivgen.spec.model import _GREEK, Named, Spec
from derivgen.symbolic import functions
from derivgen.symbolic.functions import SpellsFunctions, call
from derivgen.symbolic.naming import DisplayNames, TextSpelling, _Ordered


class _Equal(sympy.Function):
    """Display only: indicator(t)·indicator(-t), the mask of t = 0 (the elements that attain a
    group maximum), printed [u = v] for t = u - v."""

    nargs = 1


def _equalities(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with every product indicator(t)·indicator(-t) written as :class:`_Equal` (t)."""
    if not isinstance(expr, sympy.Basic) or not expr.has(functions.Indicator):
        return expr

    def pair(m: sympy.Mul) -> sympy.Expr:
        inds = [f for f in m.args if isinstance(f, functions.Indicator)]
        used: set[int] = set()
        out = []
        for i, a in enumerate(inds):
            if i in used:
                continue
            j = next(
                (
                    j
                    for j in range(i + 1, len(inds))
                    if j not in used and sympy.expand(inds[j].args[0] + a.args[0]) == 0
                ),
                None,
            )
            if j is not None:
                used |= {i, j}
                out.append(_Equal(a.args[0]))
        if not used:
            return m
        rest = [f for f in m.args if not (isinstance(f, functions.Indicator) and inds.index(f) in used)]
        return sympy.Mul(*rest, *out, evaluate=False) if out else m

    return expr.replace(lambda e: e.is_Mul and e.has(functions.Indicator), pair)


def _sides(t: sympy.Expr, element: set[str]) -> tuple[sympy.Expr, sympy.Expr]:
    """t = u - v: (u, v), the terms of t without and with a minus sign, the side with element
    values (``element``: their names) first: [|x| = m], not [m = |x|]."""
    terms = sympy.Add.make_args(t)
    u = sympy.Add(*[a for a in terms if not a.could_extract_minus_sign()])
    v = sympy.Add(*[-a for a in terms if a.could_extract_minus_sign()])

    def has_element(e: sympy.Expr) -> bool:
        return any(s.name in element for s in e.free_symbols)

    return (v, u) if has_element(v) and not has_element(u) else (u, v)


class DerivLatexPrinter(SpellsFunctions, _Ordered, LatexPrinter):
    """SymPy's LaTeX printer with the layer's display names: an element-level symbol carries
    the subscript i outside a group mean (``subscript``), ∂L/∂y prints as a fraction, and
    ``Mean(e)`` as ⟨e⟩."""

    def __init__(self, names: DisplayNames, subscript: bool = True, scalars: frozenset[str] = frozenset()):
        super().__init__({"mul_symbol": None, "fold_short_frac": False})
        self.names = names
        self.subscript = subscript
        self.scalars = scalars  # scalar parameters: one value, no element subscript
        self._depth = 0

    def _print_Symbol(self, expr, style="plain"):
        n = expr.name
        base = self.names.latex.get(n)
        if base is None:
            return super()._print_Symbol(expr)
        indexed = n in self.names.indexed or n in self.scalars
        if n in self.names.element and not indexed and self.subscript and self._depth == 0:
            if n == "dy":
                return r"\frac{\partial L}{\partial y_i}"
            return f"{{{base}}}_i" if not base.endswith("}") or "\\" in base else base + "_i"
        return base

    def _inside(self, e: sympy.Basic) -> str:
        """``e`` printed inside a group reduction or a window: no element subscripts there."""
        self._depth += 1
        try:
            return self._print(e)
        finally:
            self._depth -= 1

    def _print_Mean(self, expr):
        return rf"\left\langle {self._inside(expr.args[0])} \right\rangle"

    def _print_GroupMax(self, expr):
        return rf"\max_{{j}} {self._inside(expr.args[0])}"

    def _print_GroupMin(self, expr):
        return rf"\min_{{j}} {self._inside(expr.args[0])}"

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr, exp: str | None = None) -> str:
        """The entry's LaTeX: ``\\op^{exp}{\\left(u \\right)}``, or its template (then ``^{exp}``)."""
        args = [self._print(a) for a in expr.args]
        arg = ", ".join(args)
        if "{0}" in fn.latex:
            tex = fn.latex.format(*args)
            return tex if exp is None else rf"{tex}^{{{exp}}}"
        power = "" if exp is None else f"^{{{exp}}}"
        return rf"{fn.latex}{power}{{\left({arg} \right)}}"

    def _print_Pow(self, expr):
        root = functions.half_power_sign(expr)
        if not root:
            return super()._print_Pow(expr)
        tex = call(functions.half_power().latex, self._print(expr.base))
        return tex if root > 0 else rf"\frac{{1}}{{{tex}}}"

    def _print__Equal(self, expr):
        u, v = _sides(expr.args[0], self.names.element)
        return rf"\left[{self._print(u)} = {self._print(v)}\right]"

    def _print_Window(self, expr):
        inner, k = self._inside(expr.body), self._inside(expr.size)
        name = r"\operatorname{window}^{\top}" if expr.transposed else r"\operatorname{window}"
        return rf"{name}_{{{k}}}\left({inner} \right)"


class DerivTextPrinter(TextSpelling, _Ordered, StrPrinter):
    """SymPy's text printer with the layer's display names (μ, σ², x̂ ...); ``Mean(e)`` prints
    as mean(e)."""

    def __init__(self, names: DisplayNames):
        super().__init__({"order": None})
        self.names = names

    def _print_Symbol(self, expr):
        return self.names.text.get(expr.name, expr.name)

    def _print_Mean(self, expr):
        return f"mean({self._print(expr.args[0])})"

    def _print_Pi(self, expr):
        return "π"

    def _print__Equal(self, expr):
        u, v = _sides(expr.args[0], self.names.element)
        return f"[{self._print(u)} = {self._print(v)}]"

    def _print_Window(self, expr):
        name = "windowᵀ" if expr.transposed else "window"
        return f"{name}({self._print(expr.body)}, {self._print(expr.size)})"

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        if fn.name == "abs":  # |u|, as people write it
            return f"|{self._print(expr.args[0])}|"
        return super()._print_elementary(fn, expr)


class _Written(sympy.Symbol):
    """A constant as the spec wrote it (``1.2533141373155003``, ``sqrt(1.5707963267948966)``),
    standing in for its exact value when an expression is printed."""

    @classmethod
    def class_key(cls) -> tuple:
        return (1, 0, "Number")  # ordered as a number: first in a product

    def _sympystr(self, printer: object) -> str:
        return self.name

    def _latex(self, printer: object) -> str:
        if self.name.startswith("sqrt("):
            return rf"\sqrt{{{self.name[5:-1]}}}"
        return self.name


def _terminating(r: sympy.Rational) -> bool:
    """Whether ``r`` is a terminating decimal (its denominator has no prime but 2 and 5)."""
    q = r.q
    for f in (2, 5):
        while q % f == 0:
            q //= f
    return q == 1


def _long(r: sympy.Rational) -> bool:
    """A terminating decimal a person wrote as a decimal: seven or more significant digits, or
    a denominator of 1000 or more (0.044715 rather than 8943/200000; 0.1 stays 1/10)."""
    if r.is_Integer or not _terminating(r):
        return False
    return r.q >= 1000 or len(_decimal_text(abs(r)).replace(".", "").strip("0")) >= 7


def _decimals(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with its long decimal constants as the spec wrote them: 1.2533141373155003,
    held exactly as 12533141373155003/10**16, and sqrt(1.5707963267948966), which SymPy holds
    as 7·sqrt(320570678937734)/10**8, print as written rather than as ratios of huge
    integers. Only for printing: the values are exact."""
    if not isinstance(expr, sympy.Basic):
        return expr
    reps: dict = {}
    for m in expr.atoms(sympy.Mul):  # c·sqrt(k) = ±sqrt(c²·k)
        c, rest = m.as_coeff_Mul()
        roots = [
            f
            for f in sympy.Mul.make_args(rest)
            if f.is_Pow and f.base.is_Integer and f.exp == sympy.S.Half and f.base > 10**6
        ]
        if len(roots) != 1 or not c.is_Rational:
            continue
        square = c**2 * roots[0].base
        others = [f for f in sympy.Mul.make_args(rest) if f is not roots[0]]
        sign = -1 if c < 0 else 1
        if _long(square):
            reps[m] = sympy.Mul(sign, _Written(f"sqrt({_decimal_text(square)})", positive=True), *others)
        elif _long(1 / square):  # c·sqrt(k) = 1/sqrt(1/(c²·k))
            root = _Written(f"sqrt({_decimal_text(1 / square)})", positive=True)
            reps[m] = sympy.Mul(sign, sympy.Pow(root, -1), *others)
    out = expr.xreplace(reps) if reps else expr
    reps = {}
    for r in out.atoms(sympy.Rational):
        if _long(r):
            sym = _Written(_decimal_text(abs(r)), positive=True)
            reps[r] = sym if r > 0 else -sym
        elif r != 0 and _long(1 / r):  # a division by a decimal: 1/1.2533141373155003
            sym = sympy.Pow(_Written(_decimal_text(abs(1 / r)), positive=True), -1)
            reps[r] = sym if r > 0 else -sym
    return out.xreplace(reps) if reps else out


def _decimal_text(r: sympy.Rational) -> str:
    """A positive terminating decimal's digits: the shortest float spelling where it is exact,
    otherwise every digit."""
    short = repr(float(r))
    if "e" not in short and sympy.Rational(short) == r:
        return short
    digits = 0
    while (r * 10**digits).q != 1:
        digits += 1
    whole, frac = divmod(int(r * 10**digits), 10**digits)
    return f"{whole}.{frac:0{digits}d}"


def latex_expr(
    expr: sympy.Expr, spec: Spec | None = None, subscript: bool = True, extra: Mapping[str, Named] | None = None
) -> str:
    """``expr`` in LaTeX with the display names of ``spec`` and of ``extra`` (auxiliaries,
    the coordinate); element-level symbols subscripted with i unless ``subscript`` is False."""
    scalars = frozenset(p.name for p in spec.params if p.scalar) if spec is not None else frozenset()
    return DerivLatexPrinter(_shown(spec, extra), subscript, scalars).doprint(_equalities(_decimals(expr)))


class ShownAs(Named):
    """A display name in ``extra`` that overrides the spec's own (extra names otherwise only
    add): the second order writes the gradient arriving at an output as ∂L/∂h, where the
    first order's δh would read as one of its seeds."""


def _shown(spec: Spec | None, extra: Mapping[str, Named] | None) -> DisplayNames:
    """The display names of a derivation: the spec's, with an option whose default display
    abbreviates its name (momentum: m, defined nowhere in the derivation) shown by its name
    as the user passes it; the Greek letters (eps: ε) and a spec's own ``text`` stay."""
    names = DisplayNames(spec, extra)
    for n, item in (extra or {}).items():
        if isinstance(item, ShownAs):
            names.text[n], names.latex[n] = item.text, item.latex
    for o in spec.options if spec is not None else ():
        if (o.latex, o.text) == _GREEK.get(o.name) and o.text.isascii() and o.text != o.name:
            names.text[o.name] = o.name
            names.latex[o.name] = "\\mathrm{" + o.name.replace("_", "\\_") + "}"
    return names


def text_expr(expr: sympy.Expr, spec: Spec | None = None, extra: Mapping[str, Named] | None = None) -> str:
    """``expr`` in text with the display names of ``spec`` and ``extra``: ^ for powers, · for products."""
    s = DerivTextPrinter(_shown(spec, extra)).doprint(_equalities(_decimals(expr)))
    return s.replace("**", "^").replace("*", "·")


def mode_names(mode: ModeDerivation) -> dict:
    """Display names beyond the spec's: the auxiliaries and the centred coordinate."""
    out = {s.name: s for s in mode.statistics}
    if mode.coordinate is not None:
        out[mode.coordinate.name] = mode.coordinate
    return out


def _mode_title(mode: ModeDerivation, n_modes: int) -> str:
    if n_modes == 1:
        return ""
    return {"train": "Training mode", "eval": "Evaluation mode"}.get(mode.mode, mode.mode)
