"""The rewrites that keep :func:`~derivgen.derive.rewrite.tidy`'s work bounded:
``sympy.factor_terms`` with each sub-expression's result remembered (:func:`factor_terms`:
the same result, each distinct sub-expression factored once per ``seen``), and a large
expression (:func:`size`) expanded with its polynomial denominators factored
(:func:`expand_factored`).
"""

from __future__ import annotations

import sympy
from sympy import Add, Basic, Dummy, Mul
from sympy.core.exprtools import gcd_terms
from sympy.core.mul import _keep_coeff
from sympy.utilities.iterables import iterable

from derivgen.symbolic.reduce import expand


def factor_terms(expr: sympy.Expr, seen: dict[sympy.Basic, sympy.Basic]) -> sympy.Expr:
    """``sympy.factor_terms(expr)`` (its default flags), each sub-expression's result kept in
    ``seen`` and reused: SymPy's walk redoes a sub-expression wherever it recurs, and tidy
    factors its sums three times over (each coefficient, their sum by means, the whole), so a
    second order's closed forms, whose terms share long denominators, were factored again
    and again. A transcription of SymPy 1.14's ``factor_terms``; the tests hold it to it."""

    def do(e: sympy.Basic) -> sympy.Basic:
        try:
            return seen[e]
        except (KeyError, TypeError):  # TypeError: an unhashable iterable
            pass
        out = _do(e)
        try:
            seen[e] = out
        except TypeError:
            pass
        return out

    def _do(e: sympy.Basic) -> sympy.Basic:
        from sympy.concrete.summations import Sum
        from sympy.integrals.integrals import Integral

        is_iterable = iterable(e)
        if not isinstance(e, Basic) or e.is_Atom:
            return type(e)([do(i) for i in e]) if is_iterable else e
        if e.is_Pow or e.is_Function or is_iterable or not hasattr(e, "args_cnc"):
            args = e.args
            new = tuple([do(a) for a in args])
            return e if new == args else e.func(*new)
        if isinstance(e, (Sum, Integral)):
            return sympy.factor_terms(e)
        cont, p = e.as_content_primitive(radical=False, clear=False)
        if p.is_Add:
            terms = [do(a) for a in Add.make_args(p)]
            # a common negative sign, which gcd_terms does not take out
            if not any(a.as_coeff_Mul()[0].extract_multiplicatively(-1) is None for a in terms):
                cont = -cont
                terms = [-a for a in terms]
            # exp(-(x + 2)) kept from gcd_terms, which would write exp(-x - 2)
            special = {}
            for i, a in enumerate(terms):
                _, x = a.as_base_exp()
                if x.is_Mul and x != Mul(*x.args):
                    terms[i] = Dummy()
                    special[terms[i]] = a
            p = gcd_terms(Add._from_args(terms), isprimitive=True, clear=False, fraction=False).xreplace(special)
        elif p.args:
            p = p.func(*[do(a) for a in p.args])
        return _keep_coeff(cont, p, clear=False, sign=True)

    return do(sympy.sympify(expr))


def size(e: sympy.Basic) -> int:
    """The nodes of ``e``'s tree (a cheap measure: a tenth of ``sympy.count_ops``' time)."""
    return sum(1 for _ in sympy.preorder_traversal(e))


def expand_factored(e: sympy.Expr) -> sympy.Expr:
    """``expand(e)`` with its polynomial denominators factored rather than multiplied out:
    1/(N·n·v² - n·v² + ...)² -> 1/(n²(N - 1)²(ε + v)⁴). ``expand`` writes every denominator
    multiplied out, and a second order's closed forms repeat a few of them in hundreds of
    terms, each expanded again on every pass; held as symbols while the numerators are
    expanded, each distinct one is factored once (they are short polynomials), and the terms
    then share their factors, which factoring the sums by common terms finds cheaply."""
    powers = {p for p in e.atoms(sympy.Pow) if p.base.is_Add and p.exp.is_Integer and p.exp < 0}
    bases = sorted({p.base for p in powers}, key=sympy.default_sort_key)
    held = {b: Dummy(f"D{i}") for i, b in enumerate(bases)}
    e = expand(e.xreplace({p: held[p.base] ** p.exp for p in powers}))
    return e.xreplace({d: sympy.factor(expand(b)) for b, d in held.items()})
