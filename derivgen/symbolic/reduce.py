"""Group reductions as first-class symbolic objects.

``Mean(e)`` is the mean of the element-level expression ``e`` over one
normalization group (a row for layer norm, a channel for batch norm, ...).
The group size is the symbol ``N``; ``sum(e)`` is written ``N*Mean(e)``.
A mean knows what its argument tells: the mean of real values is real, of
non-negative values non-negative, of positive values positive.

:class:`ReductionAlgebra` knows which symbols vary inside a group (``x``,
``dy``, per-element parameters, ``xhat``...) and applies the rules a careful
person uses by hand, without ``sympy.simplify``:

* linearity: ``Mean(a + b) = Mean(a) + Mean(b)``, ``Mean(c*a) = c*Mean(a)``
  for ``c`` constant over the group, ``Mean(c) = c``;
* known statistics: every statistic is a linear relation among group means
  (``mu = Mean(x)``, ``var = Mean(x**2) - mu**2``, a kurtosis
  ``k = (Mean(x**4) - 4*mu*Mean(x**3) + ...)/var**2``); each relation is
  solved for its largest unknown mean, so any mean that is a combination of
  known ones reduces to statistics -- used only symbolically, never to
  compute a statistic;
* derived element symbols: a mean of ``xhat**k`` (no ``dy``) is rewritten
  through the definition of ``xhat`` and reduced the same way.
"""

from __future__ import annotations

import sympy
from sympy import Add, Mul


class SumFacts:
    """What a sum (or mean) of its first argument knows from it, for a SymPy function that
    sums element values (:class:`~derivgen.symbolic.window.Window`,
    :class:`~derivgen.symbolic.block.BlockMean`): real and finite where they are, of
    non-negative values non-negative, of non-positive values non-positive (otherwise
    unknown). Listed before ``sympy.Function`` among the bases, so these handlers win."""

    def _eval_is_extended_real(self) -> bool | None:
        return self.args[0].is_extended_real

    def _eval_is_extended_nonnegative(self) -> bool | None:
        return True if self.args[0].is_extended_nonnegative else None

    def _eval_is_extended_nonpositive(self) -> bool | None:
        return True if self.args[0].is_extended_nonpositive else None

    def _eval_is_finite(self) -> bool | None:
        return self.args[0].is_finite


class Mean(sympy.Function):
    """Mean over the normalization group (unevaluated; see ReductionAlgebra)."""

    nargs = 1

    @classmethod
    def eval(cls, arg: sympy.Expr) -> sympy.Expr | None:
        """Never evaluated on construction: every rewrite of a mean is explicit
        (:class:`ReductionAlgebra`)."""
        return None

    def _eval_is_extended_real(self) -> bool | None:
        return self.args[0].is_extended_real

    def _eval_is_finite(self) -> bool | None:
        return self.args[0].is_finite

    def _eval_is_extended_nonnegative(self) -> bool | None:
        return self.args[0].is_extended_nonnegative

    def _eval_is_extended_positive(self) -> bool | None:
        return self.args[0].is_extended_positive

    def _eval_is_extended_nonpositive(self) -> bool | None:
        return self.args[0].is_extended_nonpositive

    def _eval_is_extended_negative(self) -> bool | None:
        return self.args[0].is_extended_negative


class GroupMax(sympy.Function):
    """Maximum over the normalization group of an element-level expression (a statistic
    of its own: the engine never rewrites it). Its gradient goes to the elements that attain
    it, split evenly among ties (``torch.amax``)."""

    nargs = 1

    @classmethod
    def eval(cls, arg: sympy.Expr) -> sympy.Expr | None:
        return None

    def _eval_is_extended_real(self) -> bool | None:
        return self.args[0].is_extended_real

    def _eval_is_extended_nonnegative(self) -> bool | None:
        return self.args[0].is_extended_nonnegative

    def _eval_is_extended_positive(self) -> bool | None:
        return self.args[0].is_extended_positive


class GroupMin(GroupMax):
    """Minimum over the normalization group (see :class:`GroupMax`)."""


SELECTIONS = (GroupMax, GroupMin)


def selections(expr: sympy.Basic) -> list[GroupMax]:
    """The group maxima and minima in ``expr``, in a deterministic order."""
    return sorted((a for a in expr.atoms(GroupMax)), key=sympy.default_sort_key)


def hide_reductions(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with every group mean, maximum and minimum replaced by a fresh real symbol
    (what is left outside the reductions)."""
    atoms = [*means(expr), *selections(expr)]
    return expr.xreplace({a: sympy.Dummy(real=True) for a in atoms})


def means(expr: sympy.Basic) -> list[Mean]:
    """Mean atoms in ``expr`` in a deterministic order."""
    return sorted(expr.atoms(Mean), key=sympy.default_sort_key)


def hide_means(expr: sympy.Expr, prefix: str = "R") -> tuple[sympy.Expr, dict[sympy.Dummy, Mean]]:
    """Replace each Mean atom by a fresh real symbol; returns (expr, {symbol: atom})."""
    atoms = means(expr)
    table = {m: sympy.Dummy(f"{prefix}{i}", real=True) for i, m in enumerate(atoms)}
    return expr.xreplace(table), {s: m for m, s in table.items()}


def _opaque(e: sympy.Expr) -> bool:
    """A node expansion treats as an atom: a function other than a mean (tanh(x̂), |x - μ|,
    exp(...)) or a non-integer power (√(x̂² + 1)) -- expanding inside them helps nothing
    and turns √((x - μ)²/σ² + 1) into √(μ²/σ² - 2μx/σ² + x²/σ² + 1)."""
    return (isinstance(e, sympy.Function) and not isinstance(e, Mean)) or (e.is_Pow and not e.exp.is_Integer)


def expand(e: sympy.Expr, *, open_means: bool = False) -> sympy.Expr:
    """Polynomial expansion over sums, products, integer powers and means; every other
    function and every root stays as written (see :func:`_opaque`). A mean is expanded
    inside and then kept whole; with ``open_means`` SymPy expands it as it does any
    expression (a mean of a sum is split, as the code generators' monomials want)."""
    if not isinstance(e, sympy.Basic) or e.is_Atom:
        return e
    table: dict[sympy.Expr, sympy.Dummy] = {}

    def hide(node: sympy.Basic) -> sympy.Basic:
        """``node`` with its opaque nodes and means replaced by dummies (recorded in ``table``)."""
        if node.is_Atom:
            return node
        if _opaque(node):
            if node not in table:
                table[node] = sympy.Dummy(f"F{len(table)}", **_assumptions(node))
            return table[node]
        if isinstance(node, Mean) and not open_means:  # its argument expanded the same way, then hidden
            m = Mean(expand(node.args[0]))
            if m not in table:
                table[m] = sympy.Dummy(f"M{len(table)}", **_assumptions(m))
            return table[m]
        args = [hide(a) for a in node.args]
        return node.func(*args) if any(a is not b for a, b in zip(args, node.args)) else node

    hidden = sympy.expand(hide(e), power_base=False, log=False, deep=True)
    return hidden.xreplace({d: n for n, d in table.items()}) if table else hidden


def _assumptions(node: sympy.Expr) -> dict[str, bool]:
    """The sign assumptions a dummy standing for ``node`` keeps."""
    if node.is_positive:
        return {"positive": True}
    if node.is_nonnegative:
        return {"nonnegative": True}
    return {"real": True} if node.is_real else {}


class ReductionAlgebra:
    """What is known about group means, and the rules that rewrite them (see the module
    docstring): ``varying`` are the element symbols (the others are one value per group),
    ``known`` maps a mean's argument to its value in statistics (filled by :meth:`learn`),
    ``derived`` defines element symbols through x (x̂ = (x - μ)·ρ), and ``active`` are the
    element symbols whose means are never known (∂L/∂y, g)."""

    def __init__(
        self,
        varying: set[sympy.Symbol] | frozenset[sympy.Symbol],
        derived: dict[sympy.Symbol, sympy.Expr] | None = None,
        active: set[sympy.Symbol] | frozenset[sympy.Symbol] = frozenset(),
    ) -> None:
        self.varying = set(varying)
        self.known: dict[sympy.Expr, sympy.Expr] = {}  # mean argument -> group-level value
        self.derived = dict(derived or {})  # element symbol -> its definition (x̂)
        self.active = set(active)  # element symbols whose means are never known (dy, g)

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
        return expr.replace(lambda e: isinstance(e, Mean), self._rewrite)

    def _rewrite(self, m: Mean) -> sympy.Expr:
        arg = expand(self.canon(m.args[0]))
        total = sympy.S.Zero
        for term in Add.make_args(arg):
            const, vary = self.split(term)
            total += const * (sympy.S.One if vary == 1 else self._mean_of(vary))
        return total

    def _mean_of(self, vary: sympy.Expr) -> sympy.Expr:
        """The mean of one varying monomial: known, through x̂'s definition, or unknown."""
        if vary in self.known:
            return self.known[vary]
        if self.derived and not (vary.free_symbols & self.active) and vary.free_symbols & set(self.derived):
            through = self._rewrite(Mean(expand(vary.xreplace(self.derived))))
            if not through.has(Mean):
                return through
        return Mean(vary)

    def unknown(self, expr: sympy.Expr) -> list[Mean]:
        """The Mean atoms of the canonical ``expr`` (means no statistic determines)."""
        return means(self.canon(expr))

    def linear_in_unknowns(self, canonical: sympy.Expr) -> bool:
        """Is ``canonical`` a linear combination of its Mean atoms with group-level coefficients?"""
        hidden, table = hide_means(canonical)
        for r in table:
            coef = sympy.diff(hidden, r)
            if coef.has(*table) or not coef.free_symbols.isdisjoint(table):
                return False
        return True

    def _pivot(
        self, canonical: sympy.Expr
    ) -> tuple[sympy.Expr, dict[sympy.Dummy, Mean], sympy.Dummy, Mean, sympy.Expr]:
        """(hidden, table, pivot symbol, pivot atom, its coefficient) of a canonical definition."""
        hidden, table = hide_means(canonical)
        # the largest atom; of equal keys the last, as the last of a stable sort
        r, atom = max(reversed(table.items()), key=lambda kv: sympy.default_sort_key(kv[1]))
        return hidden, table, r, atom, sympy.diff(hidden, r)

    def solvable(self, canonical: sympy.Expr) -> bool:
        """Linear in its unknown means, and the coefficient of the one it is solved for is
        never zero (α·⟨x⟩ + (1 - α)·μ₀ with α ≥ 0 says nothing about ⟨x⟩ when α = 0)."""
        if not canonical.has(Mean) or not self.linear_in_unknowns(canonical):
            return False
        return bool(self._pivot(canonical)[4].is_nonzero)

    def learn(self, stat: sympy.Symbol, definition: sympy.Expr) -> sympy.Expr:
        """Record what ``stat = definition`` tells about the group means.

        The canonical definition must be linear in its unknown Mean atoms
        (see :meth:`linear_in_unknowns`); it is solved for the largest one,
        which from then on is known in terms of ``stat`` and the others.
        Returns the canonical definition.
        """
        canonical = self.canon(definition)
        if not self.solvable(canonical):
            return canonical
        hidden, table, r, atom, coef = self._pivot(canonical)
        rest = expand(hidden.subs(r, 0)).xreplace(table)
        value = expand((stat - rest) / coef)
        # keep every known value in terms of unknown atoms only
        for k, v in list(self.known.items()):
            if v.has(atom):
                self.known[k] = expand(v.xreplace({atom: value}))
        self.known[atom.args[0]] = value
        return canonical
