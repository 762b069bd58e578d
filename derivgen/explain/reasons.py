"""What a derivation's steps say about its terms: the display names of its symbols
(:class:`_Names`), the terms that are exactly zero and why (the definitions of the
statistics; a group maximum that y does not depend on), and the ones kept (:func:`facts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy

from derivgen.derive.results import ModeDerivation, Partial
from derivgen.explain.printers import latex_expr, text_expr
from derivgen.spec.model import DY, Named, Spec, Statistic, X
from derivgen.symbolic.reduce import Mean, ReductionAlgebra

_NEGLIGIBLE = (
    "exactly, so any term proportional to it — the “1/N²” term that hand derivations "
    "drop as negligible — is not small but exactly zero"
)


class _Names:
    """Display names of the symbols of one derivation (spec names and auxiliaries)."""

    def __init__(self, spec: Spec, statistics: Iterable[Statistic], coordinate: Named | None = None):
        self.spec = spec
        self.named = {n.symbol.name: n for n in spec.symbols.values()}
        self.named.update({s.symbol.name: s for s in statistics})
        if coordinate is not None:
            self.named[coordinate.symbol.name] = coordinate

    def latex(self, sym: sympy.Basic) -> str:
        """A symbol's name in LaTeX."""
        n = self.named.get(getattr(sym, "name", None))
        return n.latex if n is not None else sympy.latex(sym)

    def text(self, sym: sympy.Basic) -> str:
        """A symbol's name in text."""
        n = self.named.get(getattr(sym, "name", None))
        return n.text if n is not None else str(sym)

    def expr_text(self, e: sympy.Expr) -> str:
        """An expression in text."""
        return text_expr(e, self.spec, extra=self.named)

    def expr_latex(self, e: sympy.Expr) -> str:
        """An expression in LaTeX (no element subscripts)."""
        return latex_expr(e, self.spec, subscript=False, extra=self.named)


def _why_zero(stats: Iterable[Statistic], show: Callable[[sympy.Expr], str]) -> str:
    """Why a term vanishes: the definitions of the statistics it uses, or that its terms cancel."""
    defs = [f"{s.text} = {show(s.expr)}" for s in stats]
    return " and ".join(defs) if defs else "its terms cancel"


def _why_zero_text(p: Partial, names: _Names) -> str:
    return f"{names.expr_text(p.raw)} = {names.expr_text(p.linear)} = 0 because " + _why_zero(
        p.because, names.expr_text
    )


def _why_kept_text(p: Partial, names: _Names) -> str:
    return f"{names.expr_text(p.raw)} = {names.expr_text(p.linear)}, which is not zero in general: kept"


def _through_mean_text(p: Partial, names: _Names) -> str:
    return f"∂{p.stat.text}/∂{names.text(p.wrt)} through the mean {names.expr_text(p.atom)}"


def _selection_zero(p: Partial, names: _Names) -> tuple[str, str]:
    """Why a group maximum (minimum) gets no gradient: ∂L/∂s is zero identically."""
    st = p.stat
    return (
        f"∂L/∂{st.text} through the group {names.expr_text(p.atom)}",
        (
            f"∂L/∂{st.text} = {'' if p.raw == 0 else names.expr_text(p.raw) + ' = '}0 for every ∂L/∂y: "
            "y does not change when "
            f"{st.text} shifts (it only keeps the arithmetic in range), so no gradient flows through "
            f"{st.text} and the backward needs no mask of the elements that attain it"
        ),
    )


def facts(mode: ModeDerivation) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(vanishing, kept): the terms of one mode's derivation that are exactly zero and the
    ones kept, with reasons (text)."""
    spec = mode.spec
    names = _Names(spec, mode.statistics)
    vanishing, kept = [], []
    for p in mode.partials:
        if p.kind == "selection" and p.value == 0:
            vanishing.append(_selection_zero(p, names))
        if p.kind == "zero":
            vanishing.append((_through_mean_text(p, names), _why_zero_text(p, names)))
        elif p.kind == "kept":
            kept.append((_through_mean_text(p, names), _why_kept_text(p, names)))
    if mode.sum_xhat_zero:
        lin = _linear_mean(spec, mode.normalized_expr)
        vanishing.append(
            (
                f"Σ_j {spec.normalized.text}_j",
                f"{names.expr_text(Mean(spec.normalized.symbol))} = {names.expr_text(lin)} = 0 {_NEGLIGIBLE}.",
            )
        )
    return vanishing, kept


def _linear_mean(spec: Spec, xhat_def: sympy.Expr) -> sympy.Expr:
    """⟨x̂⟩ by linearity of the mean, in the spec's statistics (zero for a centred x̂)."""
    varying = {X, DY} | {p.symbol for p in spec.params if not p.scalar} | spec.mask_symbols | spec.tensor_symbols
    varying |= {spec.core.symbol} if spec.core is not None else set()
    return sympy.factor_terms(ReductionAlgebra(varying).canon(Mean(xhat_def)))
