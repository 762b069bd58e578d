"""The targeted rewrites that bring an expression to closed form, shared by both orders: x
written in the coordinate and the means reduced by the algebra (:func:`closed_form`), sums
collected by products of means and element monomials with per-group coefficients factored
(:func:`tidy`, :func:`tidy_windows`), and the closed forms in the fewest run-time means
(:func:`fewest_closed_forms`; :func:`merge_linear` for means met only linearly). No
``sympy.simplify``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy
from sympy import Add, Mul

from derivgen.derive.results import G
from derivgen.derive.terms import expand_factored, factor_terms, size
from derivgen.spec.model import Statistic, X
from derivgen.symbolic import functions
from derivgen.symbolic.block import BlockFacts, BlockMean, block_mean
from derivgen.symbolic.fewest import fewest_means
from derivgen.symbolic.reduce import Mean, ReductionAlgebra, expand, means
from derivgen.symbolic.window import Window, pull


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


def _nice_group(e: sympy.Expr, seen: dict[sympy.Basic, sympy.Basic]) -> sympy.Expr:
    """A per-group coefficient, factored (small expressions only)."""
    if e.is_Atom or sympy.count_ops(e) > 400:
        return factor_terms(e, seen)
    f = sympy.factor(e, deep=False)
    if sympy.count_ops(f) > sympy.count_ops(factor_terms(e, seen)):
        f = factor_terms(e, seen)
    num, den = sympy.fraction(f)
    return _nice_signs(num) / den if den != 1 else _nice_signs(f)


# an expression larger than this (nodes, terms.size) is expanded with its polynomial
# denominators factored (terms.expand_factored), not multiplied out: the double backward of
# tests/regressions/tensors/masked_second_order_time (masked statistics, a quadratic output)
# has two closed forms of 127,000 and 84,000 nodes (679 and 443 terms over a dozen
# denominators, each multiplied out in every term); tidied as the others they took 32 s and
# 18 s, most of it in factor_terms, and came out at 52,000 and 36,000 count_ops; factored,
# 9 s and 5 s, and 5,700 and 4,700. The largest a catalogue, zoo or regression layer tidies
# is under half of it (9,700, switchnorm's second order): theirs are as they were.
LARGE = 20_000


def tidy(e: sympy.Expr, element: set[sympy.Symbol]) -> sympy.Expr:
    """Collect by products of means (group and block means), then by element monomials; factor
    each per-group coefficient; a large sum's denominators factored first (see ``LARGE``)."""
    e = expand_factored(e) if size(e) > LARGE else expand(e)
    if e == 0:
        return e
    seen: dict[sympy.Basic, sympy.Basic] = {}  # factor_terms' results, shared by the three passes
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
                el * _nice_group(Add(*gs), seen)
                for el, gs in sorted(by_elem.items(), key=lambda kv: sympy.default_sort_key(kv[0]))
            ]
        )
        out.append(m * (factor_terms(coef, seen) if len(by_elem) > 1 else coef))
    return _nice_signs(factor_terms(Add(*out), seen))


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


_MERGE_MAX_ATOMS = 24  # beyond these sizes the linear merge is not attempted (as fewest_closed_forms)
_MERGE_MAX_OPS = 4000


def merge_linear(exprs: list[sympy.Expr], element: Iterable[sympy.Symbol]) -> list[sympy.Expr]:
    """Group means that every output reads linearly (never times another mean) with the same
    coefficients up to a number, as one mean: Σ_k c_k·⟨u_k⟩·A = ⟨Σ_k c_k·u_k⟩·A. A gate's
    derivative expanded into monomials (⟨x̂·∂L/∂y·w·δz·σ(z)⟩, ⟨x̂·∂L/∂y·w·z·δz·σ(z)⟩, ...)
    becomes the one mean of their sum, which :func:`fewest_closed_forms`
    leaves apart where the outputs also hold products of means. Exact (linearity of the mean);
    outputs it does not touch are returned as they are, and so are outputs too large to try."""
    found = sorted({a for e in exprs for a in e.atoms(Mean)}, key=sympy.default_sort_key)
    atoms = [a for a in found if not any(b != a and b.has(a) for b in found)]  # the outermost
    if not 2 <= len(atoms) <= _MERGE_MAX_ATOMS or sum(sympy.count_ops(e) for e in exprs) > _MERGE_MAX_OPS:
        return exprs
    sym = {a: sympy.Dummy(f"M{k}", real=True) for k, a in enumerate(atoms)}
    rs = set(sym.values())
    hidden = [expand(e.xreplace(sym)) for e in exprs]
    # each mean's coefficient in each output, from the expanded terms: a term with two means
    # (or a mean squared) makes its means ineligible
    coef = {r: [sympy.S.Zero] * len(exprs) for r in rs}
    nonlinear: set[sympy.Symbol] = set()
    for i, h in enumerate(hidden):
        for term in sympy.Add.make_args(h):
            ds = term.free_symbols & rs
            if not ds:
                continue
            (r,) = ds if len(ds) == 1 else (None,)
            if r is None or term.as_powers_dict().get(r) != 1:
                nonlinear |= ds
                continue
            coef[r][i] += term.xreplace({r: sympy.S.One})
    groups: list[tuple[sympy.Expr, list[tuple[sympy.Expr, sympy.Expr]]]] = []
    for a in atoms:
        r = sym[a]
        if r in nonlinear or all(c == 0 for c in coef[r]):
            continue
        for rep, members in groups:
            lam = _number_ratio(coef[r], coef[sym[rep]])
            if lam is not None:
                members.append((a, lam))
                break
        else:
            groups.append((a, [(a, sympy.S.One)]))
    merged = [(rep, members) for rep, members in groups if len(members) > 1]
    if not merged:
        return exprs
    put: dict[sympy.Symbol, sympy.Expr] = {}
    values: dict[sympy.Expr, sympy.Expr] = {}
    for k, (rep, members) in enumerate(merged):
        holder = Mean(sympy.Dummy(f"P{k}", real=True))
        put[sym[rep]] = holder
        values[holder] = Mean(sympy.factor_terms(expand(sympy.Add(*(lam * m.args[0] for m, lam in members)))))
        for m, _ in members[1:]:
            put[sym[m]] = sympy.S.Zero
    touched = {sym[m] for _, members in merged for m, _ in members}
    back = {d: a for a, d in sym.items() if d not in touched}
    element = set(element)
    out = []
    for e, h in zip(exprs, hidden):
        if not h.free_symbols & touched:
            out.append(e)
            continue
        out.append(tidy(h.xreplace(put).xreplace(back), element).xreplace(values))
    return out


def _number_ratio(a: list[sympy.Expr], b: list[sympy.Expr]) -> sympy.Expr | None:
    """The number λ with a = λ·b in every entry (both zero in the same entries), else None."""
    lam = None
    for u, v in zip(a, b):
        if (u == 0) != (v == 0):
            return None
        if u == 0:
            continue
        if lam is None:  # the candidate: the ratio of the leading terms' numbers
            (cu, _), (cv, _) = (sympy.Add.make_args(w)[0].as_coeff_Mul() for w in (expand(u), expand(v)))
            lam = cu / cv
        if expand(u - lam * v) != 0:
            return None
    return lam
