"""The element coordinate of a mode's closed forms.

The engine (:mod:`derivgen.derive.first`) writes every closed form in one element
coordinate, so that polynomials in x are never expanded into raw powers of x:

* the spec's own x̂ (``[normalized]``);
* else the coordinate the output uses without naming it -- z = (x - μ)·ρ written
  inline, once or several times -- which the engine names itself
  (:func:`find_implicit`), shown as x̂, with g = ∂L/∂y·∂y/∂x̂ as for a named one;
* else the centred x - μ for the group mean μ when a statistic gives it
  (:func:`closed_form_coordinate`).

Everything here reads the statistics of the mode and the reduction algebra that
knows them; nothing is changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
from sympy import Add, Mul

from derivgen.spec.model import Named, Spec, Statistic, X
from derivgen.symbolic import domain
from derivgen.symbolic.reduce import Mean, ReductionAlgebra, means, selections


@dataclass(frozen=True)
class ImplicitCoordinate:
    """The coordinate u = ``definition`` the output normalizes x by without [normalized]
    (named ``named`` by the engine), and y written in it (``output``)."""

    named: Named
    definition: sympy.Expr
    output: sympy.Expr


def x_dependent(stats: tuple[Statistic, ...] | list[Statistic]) -> frozenset[sympy.Symbol]:
    """The statistics whose values depend on x (through a mean of x, or another such)."""
    dep: set[sympy.Symbol] = set()
    for st in stats:
        if any(m.args[0].has(X) for m in [*means(st.expr), *selections(st.expr)]) or st.expr.free_symbols & dep:
            dep.add(st.symbol)
    return frozenset(dep)


class _Search:
    """The affine-in-x subexpressions of one output, read against one reduction algebra."""

    def __init__(self, y_full: sympy.Expr, alg: ReductionAlgebra, xdep: frozenset[sympy.Symbol]) -> None:
        self.y_full, self.alg, self.xdep = y_full, alg, xdep

    def group_level(self, e: sympy.Expr) -> bool:
        """One value per group: free of x and of every element symbol."""
        return not e.has(X) and not self.alg.is_varying(e)

    def affine(self, e: sympy.Expr) -> bool:
        """a·x + b with a ≠ 0 and a, b one value per group (x itself too)."""
        if not e.has(X):
            return False
        slope = sympy.diff(e, X)
        return slope != 0 and self.group_level(slope) and self.group_level(e.subs(X, 0))

    def candidates(self) -> list[sympy.Expr]:
        """Affine-in-x subexpressions of the output that involve statistics of x: (x - μ)·ρ,
        also where SymPy split a power of it (γ·ρ²·(x - μ)² holds (x - μ)·ρ)."""
        found: list[sympy.Expr] = []
        for node in sympy.preorder_traversal(self.y_full):
            if node != X and self.affine(node):
                found.append(node)
            if node.is_Mul:
                found += self._split_powers(Mul.make_args(node))
        out = []
        for candidate in found:
            if (candidate.free_symbols & self.xdep) and candidate not in out:
                out.append(candidate)
        return out

    def _split_powers(self, factors: tuple[sympy.Expr, ...]) -> list[sympy.Expr]:
        """In a product, (x - μ)^k·ρ^k read as ((x - μ)·ρ)^k: the affine bases with their scales."""
        found = []
        for f in factors:
            base, k = f.as_base_exp()
            if not (k.is_Integer and k > 0 and self.affine(base)):
                continue
            scale = []
            for h in factors:
                hb, he = h.as_base_exp()
                if h is not f and self.group_level(h) and h.free_symbols & self.xdep and (he / k).is_Rational:
                    scale.append(hb ** (he / k))
            if scale:
                found.append(base * Mul(*scale))
        return found

    def rewrite_in(self, candidate: sympy.Expr, u: sympy.Symbol) -> tuple[sympy.Expr, int]:
        """y with every additive term that depends on x only through ``candidate`` written in
        u (the others keep x: a direct path such as t·x); and how many terms that is."""
        slope = sympy.diff(candidate, X)
        x_of_u = sympy.expand((u - candidate.subs(X, 0)) / slope)
        through = candidate.free_symbols & self.xdep
        terms, clean = [], 0
        for t in Add.make_args(self.y_full):
            t2 = t.xreplace({X: x_of_u})
            if t.has(X) and t2.has(u) and not (t2.free_symbols & through):
                terms.append(t2)
                clean += 1
            else:
                terms.append(t)
        return Add(*terms), clean

    def score(self, candidate: sympy.Expr, clean: int) -> tuple:
        """The most terms of y through ``candidate``, then the most statistics, the fewest
        other group values, the smallest expression."""
        return (
            clean,
            len(candidate.free_symbols & self.xdep),
            -len(candidate.free_symbols - self.xdep - {X}),
            -sympy.count_ops(candidate),
        )


def find_implicit(
    spec: Spec, stats: tuple[Statistic, ...] | list[Statistic], y_full: sympy.Expr, alg: ReductionAlgebra
) -> ImplicitCoordinate | None:
    """A spec without [normalized] whose output still normalizes x -- z = (x - μ)·ρ written
    inline, once or several times -- gets the same closed form as one that names z: the
    coordinate u = (x - μ)·ρ, shown as x̂ (or u where the spec uses x̂), and y written in it.
    Candidates are the affine-in-x subexpressions of the output over statistics of x; the one
    through which most terms of y depend on x wins (then the one over the most statistics --
    (x - μ)·ρ over x - μ -- and the fewest other group values). None when there is none, or
    y does not depend on it."""
    xdep = x_dependent(stats)
    if not xdep:
        return None
    search = _Search(y_full, alg, xdep)
    taken = {item.text for item in spec.symbols.values()}
    text, latex = ("x̂", r"\hat{x}") if "x̂" not in taken else ("u", "u")
    u = domain.symbol("Xn")
    best = None
    for candidate in search.candidates():
        y_hat, clean = search.rewrite_in(candidate, u)
        if clean == 0:
            continue
        score = search.score(candidate, clean)
        if best is None or score > best[0]:
            best = (score, candidate, y_hat)
    if best is None:
        return None
    _, candidate, y_hat = best
    if sympy.diff(y_hat, u) == 0:
        return None
    return ImplicitCoordinate(Named("Xn", u, latex, text), candidate, y_hat)


def _centre(y_full: sympy.Expr, alg: ReductionAlgebra) -> sympy.Expr:
    """μ of the deviation x - μ the output uses; else the group mean, if a statistic gives it."""
    for node in sympy.preorder_traversal(y_full):
        if node.is_Add and X in node.args and not (node - X).has(X) and not alg.is_varying(node - X):
            return sympy.expand(X - node)
    return alg.canon(Mean(X))


def closed_form_coordinate(
    spec: Spec,
    stats: tuple[Statistic, ...] | list[Statistic],
    y_full: sympy.Expr,
    alg: ReductionAlgebra,
    implicit: ImplicitCoordinate | None,
) -> tuple[Named | None, sympy.Expr | None]:
    """The element coordinate of the closed forms and its definition: the spec's x̂, or the
    one its output uses without naming it; without either, x - μ for the group mean μ when a
    statistic gives it, so that polynomials in x are written (and computed) in powers of the
    centred x - μ, never expanded into raw powers of x. (None, None) when there is none."""
    if spec.normalized is not None:
        return spec.normalized, spec.normalized_expr
    if implicit is not None:
        return implicit.named, implicit.definition
    centre = _centre(y_full, alg)
    if centre.has(Mean) or not centre.free_symbols:
        return None, None
    by_symbol = {s.symbol: s for s in stats}
    if centre in by_symbol:
        text, latex = f"(x - {by_symbol[centre].text})", f"(x - {by_symbol[centre].latex})"
    else:
        inner_t, inner_l = str(centre), sympy.latex(centre)
        if centre.is_Add:  # x - (m + log(s)), not x - m + log(s)
            inner_t, inner_l = f"({inner_t})", rf"\left({inner_l}\right)"
        text, latex = f"(x - {inner_t})", f"(x - {inner_l})"
    sym = domain.symbol("Xc")
    return Named("Xc", sym, latex, text), X - centre
