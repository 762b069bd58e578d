"""The statistics of one mode as a *program* (step 1 of :mod:`derivgen.derive.first`): every
group mean the statistics are not linear in, and every square root, power, exp, log, abs or
tanh of group values inside a larger statistic, named as an auxiliary statistic
(:class:`Program`); a statistic s = c·F(u) differentiated through its own value
(:func:`statistic_partial`), and a group maximum's (minimum's) ties (:func:`selection_tie`,
:func:`selection_count`). Shared by the first and the second order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sympy
from sympy import Mul

from derivgen.spec.model import Spec, Statistic
from derivgen.symbolic import domain, functions
from derivgen.symbolic.reduce import SELECTIONS, GroupMax, Mean, ReductionAlgebra, means, selections


@dataclass
class _SelfRule:
    """s = c·F(u): ∂s/∂u written through s itself."""

    func: type
    coef: sympy.Expr
    arg: sympy.Expr
    exp: sympy.Expr | None = None

    def du(self, s: sympy.Symbol) -> sympy.Expr:
        """∂s/∂u, with F(u) written s/c: c·F'(u) rational in s where F is a power."""
        f = s / self.coef
        if self.func is sympy.Pow:
            q = self.exp
            if q.is_Rational and ((q - 1) / q).is_Integer:
                return self.coef * q * f ** ((q - 1) / q)  # √u: 1/(2√u); u^(-1/2): -u^(-3/2)/2
            return self.coef * q * f / self.arg
        return self.coef * functions.of_class(self.func).derivative(f, self.arg)


def _elementary(e: sympy.Expr) -> bool:
    """A non-integer power or a function of derivgen.symbolic.functions' table: a group-level
    function whose derivative the engine writes through its own value."""
    if e.is_Pow:
        return not e.exp.is_Integer
    fn = functions.of_node(e)
    return fn is not None and fn.derivative is not None  # the selections: SymPy's fdiff


def _self_rule(expr: sympy.Expr, active: set) -> _SelfRule | None:
    """expr = c·F(u) with c free of differentiable values: the rule, else None."""
    coef, rest = [], []
    for f in Mul.make_args(expr):
        (rest if f.free_symbols & active else coef).append(f)
    if len(rest) != 1 or not _elementary(rest[0]):
        return None
    node = rest[0]
    if node.is_Pow:
        return _SelfRule(sympy.Pow, Mul(*coef), node.base, node.exp)
    return _SelfRule(type(node), Mul(*coef), node.args[0])


class Program:
    """The statistics of one mode with their auxiliaries, and what they tell about means.

    ``stats`` is the program in order (each user statistic preceded by the auxiliaries it
    needs), ``rules`` the statistics s = c·F(u) differentiated through their own value, and
    ``alg`` (shared with the caller) learns every statistic's definition."""

    def __init__(
        self, spec: Spec, stats: tuple[Statistic, ...], alg: ReductionAlgebra, differentiable: set[sympy.Symbol]
    ) -> None:
        self.spec = spec
        self.alg = alg
        self.active = set(differentiable)  # group values with adjoints (inputs, scalar params)
        self.stats: list[Statistic] = []
        self.rules: dict[sympy.Symbol, _SelfRule] = {}
        self._by_def: dict[sympy.Expr, sympy.Symbol] = {}
        for st in stats:
            self._add(st)

    def auxiliary(self, expr: sympy.Expr, origin: Statistic, why: str) -> sympy.Symbol:
        """The symbol of an auxiliary statistic defined as ``expr``, named for ``why`` it is
        needed in ``origin`` (one already defined the same way is reused: the same computation)."""
        if expr in self._by_def:
            return self._by_def[expr]
        k = sum(1 for s in self.stats if s.aux) + 1
        sym = domain.symbol(f"Aux{k}", domain.sign_level(expr))
        st = Statistic(
            sym.name, sym, f"a_{{{k}}}", f"a{_subscript(k)}", expr=expr, expr_text=f"{why} in {origin.name}", aux=True
        )
        self._append(st)
        return sym

    def _append(self, st: Statistic) -> None:
        """Add ``st`` to the program as it is: its rule if it is c·F(u), what it tells the algebra."""
        self.stats.append(st)
        self.active.add(st.symbol)
        self._by_def.setdefault(st.expr, st.symbol)
        if isinstance(st.expr, SELECTIONS):
            return  # differentiated through the elements it selects (ReversePass._through_selection)
        rule = _self_rule(st.expr, self.active - {st.symbol}) if not st.expr.has(Mean) else None
        if rule is not None:
            self.rules[st.symbol] = rule
        if st.expr.has(Mean):
            self.alg.learn(st.symbol, st.expr)

    def _add(self, st: Statistic) -> None:
        """Add a user's statistic, naming first what it needs as auxiliaries (steps 1-3)."""
        expr = st.expr
        # 0. a group maximum or minimum is a statistic of its own, computed as written
        if isinstance(expr, SELECTIONS):
            self._append(st)
            return
        inner = [a for a in selections(expr) if a != expr]
        if inner:
            expr = expr.xreplace({a: self.auxiliary(a, st, "a group " + _selection_kind(a)) for a in inner})
        # 1. a mean inside another mean's argument is computed first: an auxiliary
        while True:
            nested = [i for m in means(expr) for i in means(m.args[0]) if not means(i.args[0])]
            if not nested:
                break
            expr = expr.xreplace({m: self.auxiliary(m, st, "a mean") for m in nested})
        # 2. so are the means a statistic is not linear in (those the engine could not solve for)
        canonical = self.alg.canon(expr)
        if _has_elementary_mean(expr) or (canonical.has(Mean) and not self.alg.solvable(canonical)):
            # every mean of it, as written (two-pass; never rewritten through other means, which
            # could turn ⟨(x - μ)²⟩ into ⟨x²⟩ - μ²)
            expr = expr.xreplace({atom: self.auxiliary(atom, st, "a mean") for atom in means(expr)})
        elif canonical.has(Mean):
            expr = expr.xreplace({atom: self._by_def[atom] for atom in means(expr) if atom in self._by_def})
        # 3. square roots, powers, exp, log, abs, tanh of group values inside a larger expression
        rule = _self_rule(expr, self.active)
        if rule is None:
            expr = self._name_elementary(expr, st)
        else:
            inner = self._name_elementary(rule.arg, st)
            if inner != rule.arg:
                expr = expr.xreplace({rule.arg: inner})
        self._append(Statistic(st.name, st.symbol, st.latex, st.text, expr=expr, expr_text=st.expr_text))

    def _name_elementary(self, expr: sympy.Expr, st: Statistic) -> sympy.Expr:
        """``expr`` with every elementary function of differentiable group values (outside means)
        replaced by an auxiliary, innermost first."""

        def visit(e: sympy.Expr) -> sympy.Expr:
            if e.is_Atom or isinstance(e, Mean):
                return e
            args = [visit(a) for a in e.args]
            e2 = e.func(*args) if any(a is not b for a, b in zip(args, e.args)) else e
            if _elementary(e2) and e2.free_symbols & self.active and not e2.has(Mean):
                return self.auxiliary(e2, st, "a " + _kind(e2))
            return e2

        return visit(expr)

    def partial(self, st: Statistic, v: sympy.Symbol, hidden: sympy.Expr) -> sympy.Expr:
        """∂(definition of st)/∂v, with ``hidden`` the definition with its means as symbols."""
        return statistic_partial(self.rules, st, v, hidden)


def statistic_partial(
    rules: dict[sympy.Symbol, _SelfRule], st: Statistic, v: sympy.Symbol, hidden: sympy.Expr
) -> sympy.Expr:
    """∂(definition of st)/∂v, with ``hidden`` the definition with its means as symbols; a
    statistic s = c·F(u) with a rule in ``rules`` is differentiated through its own value."""
    rule = rules.get(st.symbol)
    if rule is not None:
        return rule.du(st.symbol) * sympy.diff(rule.arg, v)
    return sympy.diff(hidden, v)


def selection_tie(st: Statistic) -> sympy.Expr:
    """For s = max(r) (or min): 1 where r_i = s, else 0 -- the elements that share s̄."""
    r = st.expr.args[0]
    return functions.Indicator(r - st.symbol) * functions.Indicator(st.symbol - r)


def selection_count(statistics: Iterable[Statistic], st: Statistic) -> sympy.Symbol | None:
    """The auxiliary statistic mean(tie) of the selection ``st`` (how much of the group attains
    it), or None: the first order found s̄ = 0 identically (y does not depend on s), so no
    derivative of any order flows through s."""
    want = Mean(selection_tie(st))
    return next((t.symbol for t in statistics if t.expr == want), None)


def _selection_kind(e: sympy.Expr) -> str:
    """ "maximum" or "minimum"."""
    return "maximum" if type(e) is GroupMax else "minimum"


def _kind(e: sympy.Expr) -> str:
    """What an elementary node is, in words (for an auxiliary's origin: "a square root in s")."""
    if e.is_Pow:
        return functions.half_power().kind if e.exp == sympy.S.Half else "power"
    return functions.of_node(e).kind


def _has_elementary_mean(e: sympy.Expr) -> bool:
    """Does ``e`` hold an elementary function of a mean (√⟨x²⟩, log⟨x⟩ ...)?"""
    return any(_elementary(n) and n.has(Mean) for n in sympy.preorder_traversal(e))


def _subscript(k: int) -> str:
    """``k`` in Unicode subscript digits (a₁₂)."""
    return str(k).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))
