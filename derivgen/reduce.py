"""Group reductions as first-class symbolic objects.

``Mean(e)`` is the mean of the element-level expression ``e`` over one
normalization group (a row for layer norm, a channel for batch norm, ...).
The group size is the symbol ``N``; ``sum(e)`` is written ``N*Mean(e)``.

:class:`ReductionAlgebra` knows which symbols vary inside a group (``x``,
``dy``, per-element parameters, ``xhat``...) and applies the rules a careful
person uses by hand, without ``sympy.simplify``:

* linearity: ``Mean(a + b) = Mean(a) + Mean(b)``, ``Mean(c*a) = c*Mean(a)``
  for ``c`` constant over the group, ``Mean(c) = c``;
* known statistics: ``Mean(x) = mu`` when ``mu`` is defined as ``mean(x)``,
  and anything solvable from that (``Mean(x**2) = var + mu**2`` -- used only
  symbolically, never to compute a statistic).
"""

from __future__ import annotations

import sympy
from sympy import Add, Mul


class Mean(sympy.Function):
    """Mean over the normalization group (unevaluated; see ReductionAlgebra)."""

    nargs = 1

    @classmethod
    def eval(cls, arg):  # never auto-evaluate: rewriting is explicit
        return None


def means(expr: sympy.Basic) -> list[Mean]:
    """Mean atoms in ``expr`` in a deterministic order."""
    return sorted(expr.atoms(Mean), key=sympy.default_sort_key)


def hide_means(expr: sympy.Expr, prefix: str = "R"):
    """Replace each Mean atom by a fresh symbol; returns (expr, {symbol: atom})."""
    atoms = means(expr)
    table = {m: sympy.Symbol(f"_{prefix}{i}") for i, m in enumerate(atoms)}
    return expr.xreplace(table), {s: m for m, s in table.items()}


class ReductionAlgebra:
    def __init__(self, varying: set[sympy.Symbol]):
        self.varying = set(varying)
        self.known: dict[sympy.Expr, sympy.Expr] = {}

    def is_varying(self, expr: sympy.Expr) -> bool:
        """Does ``expr`` vary inside a group (ignoring symbols inside Mean)?"""
        hidden, _ = hide_means(expr)
        return bool(hidden.free_symbols & self.varying)

    def split(self, term: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
        """term = const * varying."""
        const, vary = [], []
        for f in Mul.make_args(term):
            (vary if self.is_varying(f) else const).append(f)
        return Mul(*const), Mul(*vary)

    def canon(self, expr: sympy.Expr) -> sympy.Expr:
        """Apply linearity and known statistics to every Mean in ``expr``."""
        if not expr.has(Mean):
            return expr

        def rewrite(m: Mean) -> sympy.Expr:
            arg = sympy.expand(self.canon(m.args[0]), power_base=False, log=False)
            total = sympy.S.Zero
            for term in Add.make_args(arg):
                const, vary = self.split(term)
                if vary == 1:
                    total += const
                else:
                    total += const * self.known.get(vary, Mean(vary))
            return total

        return expr.replace(lambda e: isinstance(e, Mean), rewrite)

    def learn(self, stat: sympy.Symbol, definition: sympy.Expr) -> sympy.Expr | None:
        """Record what ``stat = definition`` tells about one unknown mean.

        If the canonical definition is linear in exactly one unknown Mean atom
        ``A`` (for example ``var = Mean(x**2) - mu**2``), solve it for ``A``.
        Returns the canonical definition.
        """
        c = self.canon(definition)
        hidden, table = hide_means(c)
        if len(table) == 1:
            (r, atom), = table.items()
            coef = sympy.diff(hidden, r)
            if coef != 0 and not coef.has(r):
                rest = hidden.subs(r, 0)
                self.known[atom.args[0]] = sympy.expand((stat - rest) / coef)
        return c
