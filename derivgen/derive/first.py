"""The derivation engine: reverse mode through group reductions, in general N.

For one mode of a spec (statistics s_1..s_K, normalized coordinate x̂, output
y) it derives, as a careful person does by hand:

1. the statistics as a *program* (:func:`atomize`): every group mean the
   statistics are not linear in, and every square root, power, exp, log,
   abs or tanh of group values inside a larger statistic, is named as an
   auxiliary statistic. The engine then knows every mean the forward
   computes, and every derivative is rational in named values
   (d√u/du = 1/(2√u) is 1/(2·a) for the named a = √u) -- so the closed form
   is the same whether a user writes one statistic or three;
2. the adjoint of every statistic, latest first (∂L/∂s_k), through the
   partial derivatives of the program, with the terms that vanish by the
   definitions of the statistics recorded with their reasons
   (∂σ²/∂μ ∝ Σ(x-μ) = 0) and the ones that look like they vanish but do
   not recorded as kept;
3. ∂L/∂x and the gradients of per-channel parameters: element-level, with
   per-group coefficients; rewritten in the normalized coordinate x̂ and in
   g = ∂L/∂y · ∂y/∂x̂, where they collapse to compact closed forms with few
   group reductions; per-group inputs and scalar parameters that enter the
   statistics get per-group gradients.

No ``sympy.simplify``: only linearity of means, known statistics (from
:mod:`derivgen.symbolic.reduce`), substitution of x̂, ``expand`` and ``factor`` on
small per-group coefficients, ``factor_terms``. The result is plain data
(:class:`ModeDerivation`); the document for people is built from it in
:mod:`derivgen.explain.steps`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import sympy
from sympy import Add, Mul

from derivgen.derive.coordinate import ImplicitCoordinate, closed_form_coordinate, find_implicit
from derivgen.spec.model import DY, Mode, N, Named, Spec, Statistic, X
from derivgen.symbolic import domain, functions
from derivgen.symbolic.block import BLOCK_AXES, BlockFacts, BlockMean, block_mean, hide_blocks
from derivgen.symbolic.fewest import fewest_means
from derivgen.symbolic.reduce import SELECTIONS, GroupMax, Mean, ReductionAlgebra, expand, hide_means, means, selections
from derivgen.symbolic.window import Window, pull

G = sympy.Symbol("g", real=True)


class DerivationError(ValueError):
    """The engine cannot derive what a spec asks for; the message names the file and field."""


@dataclass(frozen=True)
class Reduction:
    """A per-group reduction the backward computes at run time: name = Mean(arg)."""

    name: str
    symbol: sympy.Symbol
    arg: sympy.Expr

    @property
    def atom(self) -> Mean:
        """The mean this reduction computes, as a Mean atom of the closed forms."""
        return Mean(self.arg)


@dataclass(frozen=True)
class Partial:
    """One partial derivative of a statistic, as the derivation shows it.

    kind: "group" (∂s/∂v for an earlier group value v), "element" (∂s/∂x_i or
    ∂s/∂p_i through a mean), "zero" (∂s/∂v through a mean that vanishes by the
    definitions of the statistics) or "kept" (one that looks like it might
    vanish but does not)."""

    stat: Statistic
    wrt: sympy.Symbol
    kind: str
    value: sympy.Expr
    atom: Mean | None = None
    raw: sympy.Expr | None = None  # the mean of ∂r/∂v as written (zero / kept)
    linear: sympy.Expr | None = None  # the same after linearity alone (zero) / canonical (kept)
    because: tuple[Statistic, ...] = ()  # the statistics whose definitions make it zero


@dataclass(frozen=True)
class ParamGrad:
    """∂L/∂p = (sum of ``element`` over the axes p does not span) + (sum of ``group`` over groups)."""

    element: sympy.Expr
    group: sympy.Expr = sympy.S.Zero


@dataclass(frozen=True)
class MeanFacts:
    """What the engine's reduction algebra knew when a derivation finished: the element
    symbols, those whose means are never known (∂L/∂y, g), the element symbols defined
    through x (the coordinate), and every mean the statistics determine. Later stages
    (the second order) build their own working algebra from it (:meth:`algebra`)."""

    varying: frozenset[sympy.Symbol]
    active: frozenset[sympy.Symbol]
    derived: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    known: tuple[tuple[sympy.Expr, sympy.Expr], ...]

    @classmethod
    def of(cls, alg: ReductionAlgebra) -> MeanFacts:
        """A copy of what ``alg`` knows now."""
        return cls(frozenset(alg.varying), frozenset(alg.active), tuple(alg.derived.items()), tuple(alg.known.items()))

    def algebra(self, element: frozenset[sympy.Symbol] = frozenset()) -> ReductionAlgebra:
        """A fresh algebra that knows these facts, with ``element`` as further element
        symbols whose means are never known (the second order's cotangents and tangents)."""
        alg = ReductionAlgebra(self.varying | element, dict(self.derived), active=self.active | element)
        alg.known.update(self.known)
        return alg


@dataclass(frozen=True)
class ModeDerivation:
    """The first-order derivation of one mode, as plain data: the program of statistics,
    the partial derivatives, the adjoints, the closed forms and their reductions -- and what
    later stages need to go on from them (the coordinate, the algebra's facts, the rules of
    the statistics' elementary functions). Made by :func:`derive_mode`; never changed."""

    spec: Spec
    mode: str
    user_statistics: tuple[Statistic, ...]  # as the spec writes them
    statistics: tuple[Statistic, ...]  # the program: user statistics and auxiliaries, in order
    normalized_expr: sympy.Expr | None  # x̂ in terms of x and statistics
    output: sympy.Expr  # y in terms of x̂ (or x) and params
    g: sympy.Expr | None  # g = dy * ∂y/∂x̂, when used
    dx: sympy.Expr  # closed form, Mean atoms over g, x̂, dy
    grads: dict[str, ParamGrad]  # per parameter
    dinputs: dict[str, sympy.Expr]  # per-group value
    reductions: tuple[Reduction, ...]  # run-time reductions of the backward
    partials: tuple[Partial, ...] = ()
    adjoints: dict[sympy.Symbol, sympy.Expr] = field(default_factory=dict)  # ∂L/∂s, closed form
    sum_xhat_zero: bool = False  # mean(x̂) = 0 exactly (the "negligible" term)
    coordinate: Named | None = None  # the closed forms' element coordinate: x̂, or the centred x - μ
    coordinate_expr: sympy.Expr | None = None
    implicit_coordinate: bool = False  # x̂ named by the engine: the output uses it without [normalized]
    output_in_coordinate: sympy.Expr | None = None  # y written in that x̂ (direct paths keep x)
    x_in_coordinate: sympy.Expr | None = None  # x written in the coordinate (when it is affine in x)
    element: frozenset[sympy.Symbol] = frozenset()  # the element symbols of the closed forms
    mean_facts: MeanFacts | None = field(default=None, repr=False)
    self_rules: dict[sympy.Symbol, _SelfRule] = field(default_factory=dict, repr=False)  # s = c·F(u)
    blocks: tuple[Statistic, ...] = ()  # the block statistics (element values, one per block), in order
    dtensors: dict[str, sympy.Expr] = field(default_factory=dict)  # element-level ∂L/∂t per tensor input
    dcore: sympy.Expr | None = None  # ∂L/∂h for the spec's core value h (dx = dcore·∂h/∂x)
    chain: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂h/∂v for x and each tensor in h
    direct: dict[str, sympy.Expr] = field(default_factory=dict)  # a tensor's gradient beside dcore·chain (the outputs')

    @property
    def dparams(self) -> dict[str, sympy.Expr]:
        """The element-level part of each parameter gradient (all of it unless the parameter
        is a scalar that enters the statistics)."""
        return {k: v.element for k, v in self.grads.items()}

    @property
    def aux(self) -> tuple[Statistic, ...]:
        """The auxiliary statistics the engine named."""
        return tuple(s for s in self.statistics if s.aux)

    @property
    def normalized_symbol(self) -> sympy.Symbol | None:
        """x̂: the spec's, or the one the engine named for an output that normalizes x inline."""
        if self.spec.normalized is not None or self.implicit_coordinate:
            return self.coordinate.symbol
        return None

    @property
    def output_in_normalized(self) -> sympy.Expr:
        """y with x̂ as a symbol (y itself when there is no x̂)."""
        return self.output_in_coordinate if self.implicit_coordinate else self.output

    @property
    def block_reductions(self) -> tuple[BlockMean, ...]:
        """The block means of ∂L/∂y the backward computes at run time (one pass each: instance,
        then sample, then batch ones), beside its group means (:attr:`reductions`)."""
        exprs = [self.dx, *self.dinputs.values(), *(g.element + g.group for g in self.grads.values())]
        found = {b for e in exprs for b in e.atoms(BlockMean) if b.has(*self.spec.cotangents, G)}
        order = list(BLOCK_AXES)
        return tuple(sorted(found, key=lambda b: (order.index(b.kind), sympy.default_sort_key(b))))

    @property
    def reduction_counts(self) -> dict[str, int]:
        """The backward's run-time means by kind: {"group": n} and, where it has block means,
        their count per kind ("instance", "sample", "batch"), in that order."""
        out = {"group": len(self.reductions)}
        for b in self.block_reductions:
            out[b.kind] = out.get(b.kind, 0) + 1
        return out

    @property
    def reduction_summary(self) -> str:
        """The counts as a reader sees them: "2" (group means only), "2 group + 2 instance",
        "2 sample + 2 batch" (no group mean)."""
        counts = self.reduction_counts
        if len(counts) == 1:
            return str(counts["group"])
        return " + ".join(f"{n} {kind}" for kind, n in counts.items() if n)

    def lowered(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace Mean atoms by the reduction symbols of the backward program."""
        return expr.xreplace({r.atom: r.symbol for r in self.reductions})

    @property
    def dx_lowered(self) -> sympy.Expr:
        """∂L/∂x over the reduction symbols."""
        return self.lowered(self.dx)


# ------------------------------------------------------------------ the program


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
            return  # differentiated through the elements it selects (_Deriver._through_selection)
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


# ------------------------------------------------------------------ tidy closed forms


def _flip(f: sympy.Expr) -> sympy.Expr:
    """-f, expanded: a difference turned round (μ - x̄ -> x̄ - μ)."""
    return sympy.expand(-f)


def _nice_signs(e: sympy.Expr) -> sympy.Expr:
    """-α(μ - x̄)/σ -> α(x̄ - μ)/σ and (α - 1)(μ - x̄) -> (1 - α)(x̄ - μ): a product's sign is
    absorbed by a difference, and differences with a negative constant are turned round in pairs."""
    if not e.is_Mul:
        return e
    coeff, rest = e.as_coeff_Mul()
    factors = list(Mul.make_args(rest))
    adds = [i for i, f in enumerate(factors) if f.is_Add]
    if not adds:
        return e
    wants = [i for i in adds if any(t.is_Number and t < 0 for t in factors[i].args)]
    flip: list[int] = []
    if coeff < 0:
        first = wants[0] if wants else adds[0]
        flip.append(first)
        coeff = -coeff
        wants = [i for i in wants if i != first]
    while len(wants) >= 2:
        flip += wants[:2]
        wants = wants[2:]
    if wants:
        others = [i for i in adds if i not in flip and i != wants[0]]
        if others:
            flip += [wants[0], others[0]]
    for i in flip:
        factors[i] = _flip(factors[i])
    return coeff * Mul(*factors)


def _nice_group(e: sympy.Expr) -> sympy.Expr:
    """A per-group coefficient, factored (small expressions only)."""
    if e.is_Atom or sympy.count_ops(e) > 400:
        return sympy.factor_terms(e)
    f = sympy.factor(e, deep=False)
    if sympy.count_ops(f) > sympy.count_ops(sympy.factor_terms(e)):
        f = sympy.factor_terms(e)
    num, den = sympy.fraction(f)
    return _nice_signs(num) / den if den != 1 else _nice_signs(f)


def tidy(e: sympy.Expr, element: set[sympy.Symbol]) -> sympy.Expr:
    """Collect by products of means (group and block means), then by element monomials; factor
    each per-group coefficient."""
    e = expand(e)
    if e == 0:
        return e
    by_means: dict[sympy.Expr, list] = {}
    for t in Add.make_args(e):
        m = Mul(*[f for f in Mul.make_args(t) if f.has(Mean, BlockMean)])
        by_means.setdefault(m, []).append(t / m)
    out = []
    for m in sorted(by_means, key=sympy.default_sort_key):
        by_elem: dict[sympy.Expr, list] = {}
        for t in by_means[m]:
            el = Mul(*[f for f in Mul.make_args(t) if f.free_symbols & element])
            by_elem.setdefault(el, []).append(t / el)
        coef = Add(
            *[
                el * _nice_group(Add(*gs))
                for el, gs in sorted(by_elem.items(), key=lambda kv: sympy.default_sort_key(kv[0]))
            ]
        )
        out.append(m * (sympy.factor_terms(coef) if len(by_elem) > 1 else coef))
    return _nice_signs(sympy.factor_terms(Add(*out)))


# ------------------------------------------------------------------ the derivation


def _reduction_name(arg: sympy.Expr, names: dict[sympy.Symbol, str]) -> str:
    """``Mean_g_xhat2`` for a monomial of named element symbols with positive integer powers,
    else ""."""
    parts = []
    for f in sorted(Mul.make_args(arg), key=sympy.default_sort_key):
        b, e = f.as_base_exp()
        base = names.get(b, None) if isinstance(b, sympy.Symbol) else None
        if base is None or not (e == 1 or (e.is_Integer and e > 0)):
            return ""
        parts.append(base if e == 1 else f"{base}{e}")
    return "Mean_" + "_".join(parts)


def name_reductions(
    spec: Spec,
    coordinate: Named | None,
    exprs: Iterable[sympy.Expr],
    extra: dict[sympy.Symbol, str] | None = None,
) -> tuple[Reduction, ...]:
    """The Mean atoms of ``exprs`` as named reductions (Mean_g_xhat ...), in a fixed order;
    ``extra`` names further element symbols (the second order's cotangents and tangents)."""
    atoms = set()
    for e in exprs:
        atoms |= set(means(e))
    names = {X: "x", DY: "dy", G: "g", **{p.symbol: p.name for p in spec.params}, **(extra or {})}
    names.update({t.symbol: t.name for t in spec.tensors})
    names.update({o.cotangent: o.cotangent.name for o in spec.outputs})
    if spec.core is not None:
        names[spec.core.symbol] = spec.core.name
    names.update({m.symbol: m.name for m in spec.masks})  # Mean_Lead_p_dx_x
    if coordinate is not None:
        names[coordinate.symbol] = coordinate.name
    out, used = [], set()
    for i, atom in enumerate(sorted(atoms, key=sympy.default_sort_key)):
        nm = _reduction_name(atom.args[0], names) or f"Mean_{i}"
        while nm in used:
            nm += "_"
        used.add(nm)
        out.append(Reduction(nm, sympy.Symbol(nm, real=True), atom.args[0]))
    return tuple(out)


def closed_form(
    expr: sympy.Expr,
    alg: ReductionAlgebra,
    x_in_coordinate: sympy.Expr | None,
    element: set[sympy.Symbol] | frozenset[sympy.Symbol],
) -> sympy.Expr:
    """``expr`` in the coordinate (x replaced by ``x_in_coordinate``), reduced by the algebra
    (linearity, known statistics), tidied over the ``element`` symbols."""
    e = expr
    if x_in_coordinate is not None:
        # masks (step, indicator) keep x as the forward wrote it: a group maximum's tie test
        # must compare the very values the forward compared, not x rewritten through x̂
        masks = {m: sympy.Dummy(real=True) for m in e.atoms(functions.Step, functions.Indicator) if m.has(X)}
        e = e.xreplace(masks).subs(X, x_in_coordinate).xreplace({d: m for m, d in masks.items()})
    e = alg.canon(expand(alg.canon(e)))
    return tidy_windows(tidy(e, element), element)


def tidy_windows(e: sympy.Expr, element: set[sympy.Symbol] | frozenset[sympy.Symbol]) -> sympy.Expr:
    """``e`` with each window's argument tidied and its group-constant factors taken out of
    it (α·β/n out of windowᵀ(α·β·∂L/∂y·x/(n·D^(β+1))))."""
    if not e.has(Window):
        return e
    e = e.replace(
        lambda a: isinstance(a, Window), lambda w: Window(sympy.powsimp(sympy.factor_terms(w.body)), w.size, w.args[2])
    )
    return tidy(pull(e, element), element)


def _solver(xhat: sympy.Symbol, xhat_def: sympy.Expr) -> sympy.Expr | None:
    """x as a function of x̂ when x̂ is affine in x with a group-constant slope."""
    slope = sympy.diff(xhat_def, X)
    if slope == 0 or slope.has(X):
        return None
    intercept = xhat_def.subs(X, 0)
    return sympy.expand((xhat - intercept) / slope)


def check_derivatives(spec: Spec, where: str, e: sympy.Expr) -> None:
    """Raise :class:`DerivationError` where SymPy could not differentiate (an unevaluated
    Derivative or Subs) or the derivative is undefined (zoo, nan)."""
    if e.has(sympy.Derivative, sympy.Subs) or e.has(sympy.zoo, sympy.nan):
        raise DerivationError(
            f"{spec.source}: {where}: cannot differentiate this expression "
            f"(it is not differentiable where the layer is defined)"
        )


def block_facts(
    blocks: Iterable[Statistic], element: Iterable[sympy.Symbol], channel: Iterable[sympy.Symbol]
) -> BlockFacts:
    """What rewrites block means exactly: the block statistics' kinds and the block means
    they define (B(x) = m), beside the ``element`` symbols and per-channel parameters."""
    blocks = tuple(blocks)
    return BlockFacts(
        set(element),
        {b.symbol: b.kinds for b in blocks},
        set(channel),
        {b.expr: b.symbol for b in blocks if isinstance(b.expr, BlockMean)},
    )


def derive_mode(spec: Spec, mode_name: str | None = None) -> ModeDerivation:
    """The first-order derivation of one mode of ``spec`` (the first mode by default)."""
    try:
        if spec.core is not None:
            return _through_core(spec, mode_name)
        return _Deriver(spec, spec.mode(mode_name)).run()
    except DerivationError:
        raise
    except (TypeError, ValueError, AttributeError, NotImplementedError, RecursionError) as exc:
        raise DerivationError(
            f"{spec.source}: the engine cannot derive this layer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'})"
        ) from None


def core_spec(spec: Spec) -> Spec:
    """The layer seen from its core value h (the one its statistics read): h in place of x in
    the statistics, the normalized coordinate and the outputs, and no values. Its derivation's
    ∂L/∂x is ∂L/∂h; the tensors h is computed from appear nowhere in it (the parser saw to that)."""
    u = {spec.core.symbol: X}

    def sub(st: Statistic) -> Statistic:
        return dataclasses.replace(st, expr=st.expr.xreplace(u))

    modes = tuple(
        dataclasses.replace(m, statistics=tuple(sub(s) for s in m.statistics), blocks=tuple(sub(b) for b in m.blocks))
        for m in spec.modes
    )
    used = {s for m in modes for st in m.statistics for s in st.expr.free_symbols}
    for e in [spec.output, *(o.expr for o in spec.outputs)]:
        used |= e.xreplace(u).free_symbols
    return dataclasses.replace(
        spec,
        modes=modes,
        normalized_expr=spec.normalized_expr.xreplace(u) if spec.normalized_expr is not None else None,
        output=spec.output.xreplace(u),
        outputs=tuple(dataclasses.replace(o, expr=o.expr.xreplace(u)) for o in spec.outputs),
        buffers=tuple(dataclasses.replace(b, update=b.update.xreplace(u)) for b in spec.buffers),
        values=(),
        core=None,
        tensors=tuple(t for t in spec.tensors if t.symbol in used),
    )


def _through_core(spec: Spec, mode_name: str | None) -> ModeDerivation:
    """The derivation of a layer whose statistics read a value h = f(x, t, ...): the layer's
    derivation in h (:func:`core_spec`), written back in h, then the chain rule through h:
    ∂L/∂x = ∂L/∂h·∂f/∂x and ∂L/∂t = ∂L/∂h·∂f/∂t (+ the paths from the outputs that read t),
    one closed form ∂L/∂h that every input's gradient shares."""
    cs = core_spec(spec)
    inner = _Deriver(cs, cs.mode(mode_name)).run()
    h = spec.core.symbol
    back = {X: h}

    def w(e):
        return e.xreplace(back) if isinstance(e, sympy.Basic) else e

    f = spec.core.expr
    dcore = w(inner.dx)
    chain = {"x": sympy.diff(f, X)}
    chain.update({t.name: sympy.diff(f, t.symbol) for t in spec.grad_tensors if f.has(t.symbol)})
    for d in chain.values():
        check_derivatives(spec, f"values.{spec.core.name}.expr", d)
    direct = {t.name: w(inner.dtensors.get(t.name, sympy.S.Zero)) for t in spec.grad_tensors}
    dtensors = dict(direct)
    for t in spec.grad_tensors:
        if t.name in chain:
            through = dcore if chain[t.name] == 1 else Mul(dcore, chain[t.name], evaluate=False)
            dtensors[t.name] = through + direct[t.name]
    grads = {k: ParamGrad(w(v.element), w(v.group)) for k, v in inner.grads.items()}
    for p in spec.params:  # a parameter inside h: its element gradient through h (∂f/∂p in x itself)
        d = sympy.diff(f, p.symbol)
        if d != 0:
            if p.scalar:
                raise DerivationError(
                    f"{spec.source}: values.{spec.core.name}.expr: a scalar parameter in the core value is not supported yet"
                )
            grads[p.name] = ParamGrad(grads[p.name].element + dcore * d if p.name in grads else dcore * d)
    dinputs = {k: w(v) for k, v in inner.dinputs.items()}
    for i in spec.inputs:  # a per-group input inside h: Σ over the group of ∂L/∂h·∂f/∂i
        d = sympy.diff(f, i.symbol)
        if d != 0:
            raise DerivationError(
                f"{spec.source}: values.{spec.core.name}.expr: a per-group input in the core value is not supported yet"
            )
    dx = dcore if chain["x"] == 1 else Mul(dcore, chain["x"], evaluate=False)
    return dataclasses.replace(
        inner,
        spec=spec,
        user_statistics=tuple(dataclasses.replace(s, expr=w(s.expr)) for s in inner.user_statistics),
        statistics=tuple(dataclasses.replace(s, expr=w(s.expr)) for s in inner.statistics),
        normalized_expr=w(inner.normalized_expr),
        output=spec.output,
        g=w(inner.g),
        dx=dx,
        grads=grads,
        dinputs=dinputs,
        reductions=name_reductions(
            spec,
            inner.coordinate,
            [
                dcore,
                *dinputs.values(),
                *dtensors.values(),
                *(g.element for g in grads.values()),
                *(g.group for g in grads.values()),
            ],
        ),
        partials=tuple(
            dataclasses.replace(
                pt, value=w(pt.value), atom=w(pt.atom), raw=w(pt.raw), linear=w(pt.linear), wrt=w(pt.wrt)
            )
            for pt in inner.partials
        ),
        adjoints={w(k): w(v) for k, v in inner.adjoints.items()},
        coordinate_expr=w(inner.coordinate_expr),
        output_in_coordinate=w(inner.output_in_coordinate),
        x_in_coordinate=w(inner.x_in_coordinate),
        element=frozenset(inner.element - {X}) | {h, X} | spec.tensor_symbols,
        mean_facts=None,
        blocks=tuple(dataclasses.replace(b, expr=w(b.expr)) for b in inner.blocks),
        dtensors=dtensors,
        dcore=dcore,
        chain=chain,
        direct=direct,
    )


@dataclass
class _Adjoints:
    """The reverse pass's state: ∂L/∂v of every group value, the element-level terms of
    ∂L/∂x and of each per-channel parameter's gradient, and the partials as shown."""

    group: dict[sympy.Symbol, sympy.Expr]
    terms: dict[sympy.Symbol, list[sympy.Expr]]
    partials: list[Partial] = field(default_factory=list)


class _Deriver:
    """One mode's reverse pass and closed forms (see the module docstring); used once, by
    :func:`derive_mode`, which returns its result as a :class:`ModeDerivation`."""

    def __init__(self, spec: Spec, mode: Mode) -> None:
        self.spec, self.mode = spec, mode
        self.channel = {p.symbol: p for p in spec.params if not p.scalar}
        self.scalar = {p.symbol: p for p in spec.params if p.scalar}
        # element values the closed forms read as symbols: the masks (no gradient), the
        # output's windows (their gradient reaches x through the transposed window) and the
        # block statistics (theirs through the same block means: reverse)
        self.blocks = mode.blocks
        self.masks = set(spec.mask_symbols) | set(spec.window_symbols) | {b.symbol for b in mode.blocks}
        self.masks |= spec.constant_tensor_symbols  # tensor inputs without a gradient: element constants
        self.tensors = [t.symbol for t in spec.grad_tensors]  # element values with a gradient, as x
        self.cotangents = set(spec.cotangents)
        self._use_normalized(spec.normalized.symbol if spec.normalized else None, spec.normalized_expr)
        varying = {X, G, *self.cotangents, *self.channel, *self.masks, *self.tensors}
        varying |= {self.xhat} if self.xhat is not None else set()
        self.alg = ReductionAlgebra(varying, active={G, *self.cotangents})
        inputs = {i.symbol for i in spec.inputs}
        self.program = Program(spec, mode.statistics, self.alg, inputs | set(self.scalar))
        self.group_diff = set(self.program.active)  # every group value with an adjoint
        self.implicit: ImplicitCoordinate | None = None
        if self.xhat is None and not spec.outputs:
            self._adopt(find_implicit(spec, self.program.stats, self.y_full, self.alg))
        self._use_coordinate(*closed_form_coordinate(spec, self.program.stats, self.y_full, self.alg, self.implicit))
        self.element_diff = [X, *self.channel, *self.tensors]
        self.bfacts = block_facts(mode.blocks, self.element, set(self.channel))

    def _use_normalized(self, xhat: sympy.Symbol | None, xhat_def: sympy.Expr | None) -> None:
        """The spec's x̂ (if any): y in full, y in x̂, and g = ∂L/∂y·∂y/∂x̂ where y uses x̂."""
        spec = self.spec
        self.xhat, self.xhat_def = xhat, xhat_def
        self.y_full = spec.output.xreplace({xhat: xhat_def}) if xhat is not None else spec.output
        self.y_hat = spec.output  # y with x̂ as a symbol (or y itself)
        self.others = [(o.cotangent, o.expr) for o in spec.outputs]  # the outputs beside y, x̂ as a symbol
        dy_dxhat = sympy.diff(spec.output, xhat) if xhat is not None else sympy.S.Zero
        if xhat is not None and any(e.has(xhat) for _, e in self.others):
            # several outputs read x̂: g is the adjoint of x̂ over all of them, Σ_k ∂L/∂y_k·∂y_k/∂x̂
            self.g_def = Add(DY * dy_dxhat, *(c * sympy.diff(e, xhat) for c, e in self.others))
            self.xhat_adjoint = G
            return
        self._set_g(dy_dxhat, xhat)

    def _set_g(self, dy_dxhat: sympy.Expr, xhat: sympy.Symbol | None) -> None:
        """The adjoint of x̂, ∂L/∂y·∂y/∂x̂ = c·g, with c the factors of ∂y/∂x̂ that are one value
        per group (an input, a scalar, N) kept out of g, so that they come out of the group
        means: g = ∂L/∂y·(the factors that vary within a group), or ∂L/∂y itself (no g)."""
        if dy_dxhat == 0:
            self.g_def, self.xhat_adjoint = None, sympy.S.Zero
            return
        varying = {X, DY, *self.channel, *self.masks, *self.tensors} | ({xhat} if xhat is not None else set())
        per_group, per_element = [], []
        for f in Mul.make_args(dy_dxhat):
            (per_element if f.free_symbols & varying else per_group).append(f)
        scale, h = Mul(*per_group), Mul(*per_element)
        if h == 1:
            self.g_def, self.xhat_adjoint = None, scale * DY
        else:
            self.g_def, self.xhat_adjoint = DY * h, scale * G

    def _use_coordinate(self, coord: Named | None, coord_def: sympy.Expr | None) -> None:
        """The closed forms' element coordinate: an element symbol, x written in it where it is
        affine in x, and the element symbols of the closed forms."""
        self.coord, self.coord_def = coord, coord_def
        xhat = coord.symbol if coord is not None else None
        if xhat is not None:
            self.alg.varying.add(xhat)
        self.to_xhat = _solver(xhat, coord_def) if xhat is not None else None
        self.element = {X, G, *self.cotangents, *self.channel, *self.masks, *self.tensors}
        self.element |= {xhat} if xhat is not None else set()

    def _adopt(self, implicit: ImplicitCoordinate | None) -> None:
        """Write the backward in the coordinate the output uses without naming it (x̂ = u,
        g = ∂L/∂y·∂y/∂u), as for a spec that names it."""
        if implicit is None:
            return
        u = implicit.named.symbol
        self.implicit = implicit
        self.xhat, self.xhat_def, self.y_hat = u, implicit.definition, implicit.output
        self._set_g(sympy.diff(implicit.output, u), u)
        self.alg.varying.add(u)

    def dL(self, v: sympy.Symbol) -> sympy.Expr:
        """∂L/∂y·∂y/∂v for one element, with the path through x̂ written in g = ∂L/∂y·∂y/∂x̂
        (the adjoint of x̂) and the direct paths in ∂L/∂y: γ·x̂ + β + t·x gives g·∂x̂/∂x + ∂L/∂y·t."""
        direct = DY * sympy.diff(self.y_hat, v) + Add(*(c * sympy.diff(e, v) for c, e in self.others))
        if self.g_def is not None and direct != 0 and not self.others:  # ∂L/∂y·exp(x̂)/S² is g/S² for g = ∂L/∂y·exp(x̂)
            q = sympy.cancel(direct / self.g_def)
            if not q.free_symbols & (self.element - {G}):
                direct = q * G
        if self.xhat_def is None or self.xhat_adjoint == 0:
            return direct
        return self.xhat_adjoint * sympy.diff(self.xhat_def, v) + direct

    # ---- 1. reverse pass through the program -----------------------------
    def reverse(self) -> _Adjoints:
        """∂L/∂s of every statistic, latest first, and the element-level terms of ∂L/∂x, ∂L/∂p."""
        group = {
            v: sympy.S.Zero if v in self.scalar else self.alg.canon(N * Mean(self.dL(v)))
            for v in sorted(self.group_diff, key=sympy.default_sort_key)
        }
        terms = {e: [self.dL(e)] for e in [X, *self.channel, *self.tensors]}
        terms.update({p: [] for p in self.scalar})  # element terms beside dL(p): through block statistics
        for w in self.spec.windows:  # W_i = Σ_d e(x_{i+d}): ∂L/∂x_j = e'(x_j)·Σ_d ∂L/∂W_{j-d}
            terms[X].append(sympy.diff(w.body, X) * w.expr.transpose(self.dL(w.symbol)))
        adj = _Adjoints(group, terms)
        self._through_blocks(adj)
        for st in reversed(list(self.program.stats)):
            if isinstance(st.expr, SELECTIONS):
                self._through_selection(st, adj)
                continue
            hidden, table = hide_means(st.expr, prefix=f"{st.name}_R")
            self._through_group_values(st, hidden, table, adj)
            for r, atom in table.items():
                coef = self.program.partial(st, r, hidden).xreplace(table)
                if coef != 0:
                    self._through_mean(st, coef, atom, adj)
        return adj

    def _through_blocks(self, adj: _Adjoints) -> None:
        """The block statistics, latest first: each one's adjoint is an element value (∂L/∂y·∂y/∂b
        and what later block statistics pass on); through b = F(x, ..., B(u)) it reaches the
        variables F names directly by ∂F/∂v, and those inside a block mean B(u) by the same
        block mean of the adjoint, B(b̄·∂F/∂B)·∂u/∂v (a block mean is its own transpose);
        group values get N·⟨b̄·∂F/∂s⟩. Block means are rewritten exactly as they are made
        (B(x - m) = 0 for m = B(x)), so what vanishes costs nothing."""
        if not self.blocks:
            return
        badj = {b.symbol: self.dL(b.symbol) for b in self.blocks}
        for b in reversed(self.blocks):
            a = self.bfacts.rewrite(badj[b.symbol])
            if a != 0:
                self._spread(a, b.expr, b, adj, badj)

    def _spread(
        self, a: sympy.Expr, e: sympy.Expr, b: Statistic, adj: _Adjoints, badj: dict[sympy.Symbol, sympy.Expr]
    ) -> None:
        """The adjoint ``a`` of the element value ``e`` (part of block statistic ``b``) to what it reads."""
        hidden, back = hide_blocks(e)
        where = f"statistics.{b.name}"
        for v in sorted(hidden.free_symbols, key=sympy.default_sort_key):
            d = sympy.diff(hidden, v).xreplace(back)
            check_derivatives(self.spec, where, d)
            if d == 0:
                continue
            if v in back:  # inside a block mean B(u): B(a·∂e/∂B) to what u reads
                inner = self.bfacts.rewrite(block_mean(a * d, back[v].kind))
                if inner != 0:
                    self._spread(inner, back[v].body, b, adj, badj)
            elif v == X or v in self.channel or v in self.scalar or v in self.tensors:
                adj.terms[v].append(a * d)
            elif v in badj:
                badj[v] = badj[v] + a * d
            elif v in self.group_diff:
                adj.group[v] = adj.group[v] + self.alg.canon(N * Mean(expand(a * d)))

    def _through_group_values(
        self, st: Statistic, hidden: sympy.Expr, table: dict[sympy.Dummy, Mean], adj: _Adjoints
    ) -> None:
        """s̄·∂s/∂v to every earlier group value v the definition of s names outside a mean."""
        sbar = adj.group[st.symbol]
        for v in sorted(hidden.free_symbols & self.group_diff, key=sympy.default_sort_key):
            d = self.program.partial(st, v, hidden).xreplace(table)
            check_derivatives(self.spec, f"statistics.{st.name}", d)
            if d != 0:
                adj.group[v] = adj.group[v] + sbar * d
                adj.partials.append(Partial(st, v, "group", d))

    def _through_mean(self, st: Statistic, coef: sympy.Expr, atom: Mean, adj: _Adjoints) -> None:
        """s̄·∂s/∂⟨r⟩ through one mean ⟨r⟩ of s: (1/N)·∂r/∂x_i to the elements, ⟨∂r/∂v⟩ to
        the group values inside r -- zero by the definitions of the statistics, or kept."""
        abar = adj.group[st.symbol] * coef
        rarg = atom.args[0]
        for elem in self.element_diff:
            de = sympy.diff(rarg, elem)
            check_derivatives(self.spec, f"statistics.{st.name}", de)
            if de != 0:
                adj.terms[elem].append(abar / N * de)
                adj.partials.append(Partial(st, elem, "element", sympy.factor_terms(coef / N * de), atom=atom))
        for v in sorted(rarg.free_symbols & self.group_diff, key=sympy.default_sort_key):
            raw = Mean(sympy.diff(rarg, v))
            val = self.alg.canon(raw)
            if any(not m.has(*self.cotangents, G) for m in means(val)):
                val = self._forward_mean(raw, st, adj.group)
            dr = Mean(sympy.factor_terms(sympy.diff(rarg, v)))
            if val == 0:
                lin = sympy.factor_terms(ReductionAlgebra(self.alg.varying).canon(raw))
                used = tuple(t for t in self.program.stats if isinstance(t.expr, Mean) and lin.has(t.symbol))
                adj.partials.append(Partial(st, v, "zero", sympy.S.Zero, atom=atom, raw=dr, linear=lin, because=used))
            else:
                adj.partials.append(
                    Partial(
                        st, v, "kept", sympy.factor_terms(coef * val), atom=atom, raw=dr, linear=sympy.factor_terms(val)
                    )
                )
                adj.group[v] = adj.group[v] + abar * val

    def _through_selection(self, st: Statistic, adj: _Adjoints) -> None:
        """s = max(r) (or min) over the group: s̄ goes to the elements where r_i = s, split
        evenly among them (PyTorch's amax), through ∂r_i/∂x_i -- unless s̄ is exactly zero by
        the algebra (a softmax's maximum: y does not change when s shifts), which is
        recorded as a vanishing term and costs the backward nothing."""
        r = st.expr.args[0]
        written = adj.group[st.symbol]
        if self.g_def is not None:  # g is a name for ∂L/∂y·h: the means of both must meet
            written = written.xreplace({G: self.g_def})
        sbar = self.alg.canon(expand(self.alg.canon(written)))
        if sbar == 0:
            adj.partials.append(Partial(st, X, "selection", sympy.S.Zero, atom=st.expr, raw=adj.group[st.symbol]))
            return
        tie = selection_tie(st)
        count = self.program.auxiliary(
            Mean(tie), st, "the share of the group that attains the " + _selection_kind(st.expr)
        )
        self.group_diff.add(count)
        adj.group.setdefault(count, sympy.S.Zero)
        share = tie / (N * count)
        for elem in self.element_diff:
            de = sympy.diff(r, elem)
            check_derivatives(self.spec, f"statistics.{st.name}", de)
            if de != 0:
                adj.terms[elem].append(adj.group[st.symbol] * share * de)
                adj.partials.append(Partial(st, elem, "selection", share * de, atom=st.expr))
        for v in sorted(r.free_symbols & self.group_diff, key=sympy.default_sort_key):
            d = self.alg.canon(Mean(tie * sympy.diff(r, v))) / count
            if d != 0:
                adj.group[v] = adj.group[v] + adj.group[st.symbol] * d
                adj.partials.append(Partial(st, v, "group", d))

    def _forward_mean(self, raw: Mean, st: Statistic, group_adj: dict[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
        """A mean of x alone that no statistic determines (⟨(x - μ)³⟩ from differentiating a
        fourth moment through μ, ⟨sign(x - μ)⟩ from a mean absolute deviation): an auxiliary
        the forward computes as written, two-pass, rather than a reduction of the backward or
        an expansion in raw moments of x."""
        _, vary = self.alg.split(sympy.factor_terms(raw.args[0]))
        sym = self.program.auxiliary(Mean(vary), st, "a mean the backward needs")
        group_adj.setdefault(sym, sympy.S.Zero)
        return self.alg.canon(raw)

    # ---- 2. closed forms ---------------------------------------------------
    def finish(self, expr: sympy.Expr) -> sympy.Expr:
        """In x̂, reduced by the algebra (linearity, known statistics), tidied; an auxiliary
        that a user's statistic is a multiple of written through that statistic."""
        e = closed_form(expr, self.alg, self.to_xhat, self.element)
        fold = self._folds()
        return tidy(e.xreplace(fold), self.element) if fold and e.free_symbols & set(fold) else e

    def _folds(self) -> dict[sympy.Symbol, sympy.Expr]:
        """a = s/k for an auxiliary a and a user's statistic s = k·a (k free of a, of x and of
        every auxiliary): ρ = a₁/τ gives a₁ = ρ·τ, so closed forms read ρ, not a₁."""
        out: dict[sympy.Symbol, sympy.Expr] = {}
        aux = {st.symbol for st in self.program.stats if st.aux}
        for st in self.program.stats:
            if st.aux or st.expr.has(Mean, *SELECTIONS):
                continue
            for a in st.expr.free_symbols & aux:
                k = sympy.cancel(st.expr / a)
                if a not in out and not k.free_symbols & aux and k != 0:
                    out[a] = st.symbol / k
        return out

    def _closed_forms(
        self, adj: _Adjoints
    ) -> tuple[sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr], dict[sympy.Symbol, sympy.Expr]]:
        """dx, the parameter and input gradients and the statistics' adjoints in closed form.

        Where the output uses x itself beside the coordinate (x·sigmoid(v·x)/σ), writing x as
        (x - μ) + μ would split one mean into two and print (x - μ) + μ inside functions: the
        closed forms are then also written in x as it is, and that version is kept when it
        needs fewer run-time means (with as many, the coordinate keeps differences centred)."""
        if self.to_xhat is not None:
            self.alg.derived = {self.coord.symbol: self.coord_def}
        written = self._closed_forms_in(adj)
        if self.to_xhat is None or not self.y_hat.has(X):
            return self._fewest(*written)
        to_xhat = self.to_xhat
        self.to_xhat = None
        plain = self._closed_forms_in(adj)
        if _mean_count(plain) < _mean_count(written):
            if self.implicit is None and self.spec.normalized is None:
                self.coord = self.coord_def = None  # the centred coordinate is not used
            return self._fewest(*plain)
        self.to_xhat = to_xhat
        return self._fewest(*written)

    def _closed_forms_in(
        self, adj: _Adjoints
    ) -> tuple[sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr], dict[sympy.Symbol, sympy.Expr]]:
        """The closed forms with x written as :attr:`to_xhat` says (or as itself)."""
        spec, finish = self.spec, self.finish
        dx = finish(Add(*adj.terms[X]))
        grads = {}
        for p in spec.params:
            if p.scalar:
                grads[p.name] = ParamGrad(
                    finish(self.dL(p.symbol) + Add(*adj.terms[p.symbol])), finish(adj.group[p.symbol])
                )
            else:
                grads[p.name] = ParamGrad(finish(Add(*adj.terms[p.symbol])))
        for t in spec.grad_tensors:  # beside the parameters until run() splits them off
            grads[t.name] = ParamGrad(finish(Add(*adj.terms[t.symbol])))
        dinputs = {i.name: finish(adj.group[i.symbol]) for i in spec.inputs}
        unname_g = {G: self.g_def} if self.g_def is not None else {}
        adjoints = {
            # a selection's adjoint with g written out: its terms meet (softmax's is zero)
            st.symbol: finish(
                adj.group[st.symbol].xreplace(unname_g) if isinstance(st.expr, SELECTIONS) else adj.group[st.symbol]
            )
            for st in self.program.stats
        }
        for where, e in [("output", dx), *((f"params.{k}", v.element + v.group) for k, v in grads.items())]:
            check_derivatives(spec, where, e)
        return dx, grads, dinputs, adjoints

    def _fewest(
        self,
        dx: sympy.Expr,
        grads: dict[str, ParamGrad],
        dinputs: dict[str, sympy.Expr],
        adjoints: dict[sympy.Symbol, sympy.Expr],
    ) -> tuple[sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr], dict[sympy.Symbol, sympy.Expr]]:
        """The closed forms in the fewest run-time means of ∂L/∂y (:mod:`derivgen.symbolic.fewest`):
        group means, then the block means of each kind, merged where their integrands or
        their coefficients in every output are proportional with a factor one value over
        the mean's domain (per group; per block). The coordinate is chosen before (a merge
        would join ⟨g·(x - μ)⟩ and μ·⟨g⟩ back into ⟨g·((x - μ) + μ)⟩); the statistics'
        adjoints stay as derived."""
        names = list(grads)
        exprs = [dx, *(grads[k].element for k in names), *(grads[k].group for k in names), *dinputs.values()]
        exprs = fewest_closed_forms(
            exprs,
            self.alg,
            self.bfacts,
            self.g_def,
            self.element,
            keep=lambda a: a.has(*self.cotangents, G),
            spell=self._speller(),
            centre=self._centre_blocks,
        )
        k = len(names)
        dx, elements, groups, ins = exprs[0], exprs[1 : 1 + k], exprs[1 + k : 1 + 2 * k], exprs[1 + 2 * k :]
        grads = {name: ParamGrad(e, gr) for name, e, gr in zip(names, elements, groups)}
        return dx, grads, dict(zip(dinputs, ins)), adjoints

    def _speller(self) -> Callable[[sympy.Expr], sympy.Expr]:
        """A sum as the reader knows it: k·num for a statistic s = num/den (num a sum) is k·den·s
        (a switchable norm's exp(vw_in)·σ²_in + exp(vw_ln)·σ²_ln + exp(vw_bn)·σ²_bn is vz·σ²)."""
        known = []
        for st in [*self.program.stats, *self.blocks]:
            if st.expr.has(Mean, BlockMean, *SELECTIONS):
                continue
            num, den = sympy.fraction(sympy.together(st.expr))
            if num.is_Add:
                known.append((expand(num), den, st.symbol))
        for y in {self.spec.output, self.y_hat}:  # the output's own sums (1 + x + x²/2)
            for a in sympy.preorder_traversal(y):
                if a.is_Add and a.free_symbols & self.element and not a.has(Mean, BlockMean, *SELECTIONS):
                    known.append((expand(a), sympy.S.One, a))

        def spell(f: sympy.Expr) -> sympy.Expr:
            if not f.is_Add:
                return f
            ef = expand(f)
            for num, den, s in known:
                if len(Add.make_args(ef)) != len(Add.make_args(num)):
                    continue
                k = sympy.cancel(ef / num)
                if (
                    not k.has(X, *self.cotangents, G)
                    and not (k.free_symbols & self.element)
                    and expand(ef - k * num) == 0
                ):
                    return Mul(k, den, s, evaluate=False)  # 2·(1 + x + x²/2), not distributed
            return f

        return spell

    def _centre_blocks(self, exprs: list[sympy.Expr], kind: str) -> list[list[sympy.Expr]]:
        """The block means of ∂L/∂y of one kind written about their block's own mean of x:
        ⟨∂L/∂y·(x - μ_in)⟩ rather than ⟨∂L/∂y·x⟩ or ⟨∂L/∂y·((x - μ) + μ)⟩ (x in the group's
        coordinate) -- one rewrite of ``exprs`` per block statistic mean(x, kind), latest
        first (a spec may name the same mean twice and use the later one)."""
        centres = [st.symbol for st in reversed(self.blocks) if st.expr == block_mean(X, kind)]
        to_x = {self.coord.symbol: self.coord_def} if self.to_xhat is not None else {}
        z = sympy.Dummy("z", real=True)
        facts = BlockFacts(self.bfacts.element | {z}, self.bfacts.kinds, self.bfacts.channel, self.bfacts.known)
        found = {b for e in exprs for b in e.atoms(BlockMean) if b.kind == kind and b.has(*self.cotangents, G)}
        out = []
        for m in centres:
            table = {}
            for b in found:
                u = expand(b.body.xreplace(to_x) if to_x else b.body)
                if u.has(X) and _polynomial_in_x(u):
                    table[b] = facts.rewrite(block_mean(expand(u.subs(X, z + m)), kind)).xreplace({z: X - m})
            if table:
                out.append([tidy(e.xreplace(table), self.element) if e.has(*table) else e for e in exprs])
        return out

    def _sum_xhat_zero(self) -> bool:
        """⟨x̂⟩ = 0 exactly for the spec's x̂."""
        return self.spec.normalized is not None and self.to_xhat is not None and self.alg.canon(Mean(self.xhat)) == 0

    def run(self) -> ModeDerivation:
        """The derivation as data."""
        spec = self.spec
        adj = self.reverse()
        dx, grads, dinputs, adjoints = self._closed_forms(adj)
        dtensors = {t.name: grads.pop(t.name).element for t in spec.grad_tensors}
        sum_zero = self._sum_xhat_zero()
        results = [dx, *dinputs.values(), *(g.element for g in grads.values()), *(g.group for g in grads.values())]
        results += list(dtensors.values())
        uses_g = self.g_def is not None and any(e.has(G) for e in results)
        return ModeDerivation(
            spec=spec,
            mode=self.mode.name,
            user_statistics=self.mode.statistics,
            statistics=tuple(self.program.stats),
            normalized_expr=self.xhat_def,
            output=spec.output,
            g=self.g_def if uses_g else None,
            dx=dx,
            grads=grads,
            dinputs=dinputs,
            reductions=name_reductions(spec, self.coord, results),
            partials=tuple(adj.partials),
            adjoints=adjoints,
            sum_xhat_zero=sum_zero,
            coordinate=self.coord,
            coordinate_expr=self.coord_def,
            implicit_coordinate=self.implicit is not None,
            output_in_coordinate=self.y_hat if self.implicit is not None else None,
            x_in_coordinate=self.to_xhat,
            element=frozenset(self.element),
            mean_facts=MeanFacts.of(self.alg),
            self_rules=dict(self.program.rules),
            blocks=tuple(self.blocks),
            dtensors=dtensors,
        )


def _mean_count(forms: tuple) -> int:
    """How many distinct group means the closed forms (dx, grads, dinputs, adjoints) read."""
    dx, grads, dinputs, _ = forms
    exprs = [dx, *dinputs.values(), *(g.element + g.group for g in grads.values())]
    return len({m for e in exprs for m in means(e)})


def fewest_closed_forms(
    exprs: list[sympy.Expr],
    alg: ReductionAlgebra,
    bfacts: BlockFacts,
    g_def: sympy.Expr | None,
    element: Iterable[sympy.Symbol],
    keep: Callable[[sympy.Expr], bool] = lambda a: True,
    spell: Callable[[sympy.Expr], sympy.Expr] = lambda e: e,
    centre: Callable[[list[sympy.Expr], str], list[list[sympy.Expr]]] | None = None,
) -> list[sympy.Expr]:
    """``exprs`` (closed forms, linear in the run-time values) in the fewest run-time means
    (:mod:`derivgen.symbolic.fewest`): their group means, then their block means kind by
    kind, among those ``keep`` accepts, merged where integrands or coefficients are
    proportional with a factor one value over the mean's domain (``alg`` says what varies
    within a group, ``bfacts`` within a block; ``element`` are the closed forms' element
    symbols); integrands are compared with g written out as ``g_def``; ``centre(exprs, kind)`` rewrites the block means of a kind before they are
    merged (one rewrite per centre), the first kept that is then as few."""
    unname_g = {G: g_def} if g_def is not None else {}
    element = set(element)

    def retidy(e: sympy.Expr) -> sympy.Expr:
        return tidy(e, element)

    def written_out(u: sympy.Expr) -> sympy.Expr:
        return u.xreplace(unname_g) if unname_g else u

    def atoms(found: Iterable[sympy.Expr]) -> list[sympy.Expr]:
        return sorted({a for a in found if keep(a)}, key=sympy.default_sort_key)

    exprs = fewest_means(
        exprs,
        lambda es: atoms(m for e in es for m in means(e)),
        lambda m: m.args[0],
        Mean,
        lambda f: not alg.is_varying(f),
        written_out,
        spell,
        retidy,
    )

    def of_kind(exprs: list[sympy.Expr], kind: str) -> list[sympy.Expr]:
        return atoms(b for e in exprs for b in e.atoms(BlockMean) if b.kind == kind)

    def merged(exprs: list[sympy.Expr], kind: str) -> list[sympy.Expr]:
        return fewest_means(
            exprs,
            lambda es: of_kind(es, kind),
            lambda b: b.body,
            lambda u: block_mean(u, kind),
            lambda f: bfacts.constant(f, kind),
            written_out,
            spell,
            retidy,
        )

    for kind in sorted({b.kind for e in exprs for b in e.atoms(BlockMean)}):
        best = merged(exprs, kind)
        # about a block mean of x, where that needs no more means (the fewest of the centres)
        centred = [merged(c, kind) for c in (centre(exprs, kind) if centre is not None else [])]
        if centred:
            fewest = min(centred, key=lambda c: len(of_kind(c, kind)))
            if len(of_kind(fewest, kind)) <= len(of_kind(best, kind)):
                best = fewest
        exprs = best
    return exprs


def _polynomial_in_x(u: sympy.Expr) -> bool:
    """Is the expanded ``u`` a polynomial in x (x in no function, root or denominator)?"""
    for term in Add.make_args(u):
        for f in Mul.make_args(term):
            if f.has(X) and not (f == X or (f.is_Pow and f.base == X and f.exp.is_Integer and f.exp > 0)):
                return False
    return True


def mode_depends_on_x(mode: ModeDerivation, s: sympy.Symbol) -> bool:
    """Does the statistic ``s`` of ``mode`` depend on x (through a mean, or another statistic)?"""
    defs = {st.symbol: st.expr for st in mode.statistics}
    e = defs[s]
    return bool(e.has(Mean, *SELECTIONS)) or any(mode_depends_on_x(mode, t) for t in e.free_symbols if t in defs)
