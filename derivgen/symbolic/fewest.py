"""The fewest run-time means a set of closed forms can be written in.

A backward is linear in ∂L/∂y, so each of its outputs (∂L/∂x, a parameter's or an input's
gradient) is ``rest + Σ_k M_k·A_k`` with M_k the means of ∂L/∂y it reads (group means, or
block means of one kind) and A_k what multiplies them. Two means can be one when

* their **integrands** are proportional with a factor c constant over the mean's domain
  (one value per group for a group mean, per block for a block mean): M_k = c·M_j. The
  integrands are compared with g written out, so ⟨x̂·g⟩ and ⟨x̂·∂L/∂y·w⟩ for g = ∂L/∂y·w
  are one mean;
* their **coefficients** are proportional in every output with such a factor λ:
  A_k = λ·A_j, so M_j·A_j + M_k·A_k = ⟨u_j + λ·u_k⟩·A_j -- one mean of the sum. A Taylor
  softmax's ⟨∂L/∂y⟩ + ⟨∂L/∂y·x⟩ + ⟨∂L/∂y·x²⟩/2 is ⟨∂L/∂y·(1 + x + x²/2)⟩, and an
  instance-layer norm's ⟨∂L/∂y·γ⟩ - ⟨∂L/∂y·γ·ρ⟩ is ⟨∂L/∂y·γ·(1 - ρ)⟩.

A factor is "constant over the domain" as the caller's predicate says: a per-channel
parameter is one value on an instance block, but not on a group that spans the channels.
A ratio is used only where it divides by nothing that may be zero (λ = 1/(1 - ρ) would)
and holds no reduction (it would put a mean inside a mean), and every identity is checked
exactly before it is used; where a check fails, the means stay as they were. Where the
outputs have fewer element directions than means, each direction gets one mean
(:func:`_merge_directions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sympy
from sympy import Add, Mul

from derivgen.symbolic.block import BlockMean
from derivgen.symbolic.reduce import Mean, expand
from derivgen.symbolic.window import Window

# beyond these sizes the merge is not attempted (the closed forms stay as derived)
_MAX_ATOMS = 24
_MAX_OPS = 4000
# a merge by directions is kept unless its integrands hold more than this many times the
# operations of the ones they replace, plus the slack (a guard against blow-ups: the named
# layers' closed forms are not merged by directions at all)
_READABLE_GROWTH = 20
_READABLE_SLACK = 400


def _top_level(e: sympy.Expr, atoms: set[sympy.Expr]) -> tuple[set[sympy.Expr], set[sympy.Expr]]:
    """(atoms reached through sums and products only, atoms met anywhere else) in ``e``."""
    top: set[sympy.Expr] = set()
    nested: set[sympy.Expr] = set()

    def walk(a: sympy.Basic, outside: bool) -> None:
        if a in atoms:
            (top if outside else nested).add(a)
            return
        if a.is_Atom:
            return
        inner = outside and (a.is_Add or a.is_Mul)
        for arg in a.args:
            walk(arg, inner)

    walk(e, True)
    return top, nested


def _vector(e: sympy.Expr, constant: Callable[[sympy.Expr], bool]) -> dict[sympy.Expr, sympy.Expr] | None:
    """``e`` as {varying monomial: constant coefficient} (expanded; functions and roots kept)."""
    out: dict[sympy.Expr, sympy.Expr] = {}
    for term in Add.make_args(expand(e)):
        const, vary = [], []
        for f in Mul.make_args(term):
            (const if constant(f) else vary).append(f)
        key = Mul(*vary)
        out[key] = out.get(key, sympy.S.Zero) + Mul(*const)
    return {k: v for k, v in out.items() if v != 0}


def _zero(e: sympy.Expr) -> bool:
    """Is ``e`` exactly zero (by expansion, or by cancelling a rational function)?"""
    if e == 0:
        return True
    x = expand(e)
    if x == 0:
        return True
    try:
        return sympy.cancel(sympy.together(x)) == 0
    except (sympy.PolynomialError, TypeError, ValueError):
        return False


def _nonzero(e: sympy.Expr) -> bool:
    """Is ``e`` provably never zero (a number, positive values, products and powers of them)?"""
    if e.is_nonzero:
        return True
    return all(
        f.is_nonzero or (f.is_Pow and f.base.is_nonzero) or (f.is_Pow and f.base.is_positive)
        for f in Mul.make_args(sympy.factor_terms(e))
    )


def _ratio(a: dict, b: dict) -> sympy.Expr | None:
    """λ with a = λ·b for two vectors, λ dividing by nothing that may vanish; else None."""
    if not a or not b or set(a) != set(b):
        return None
    key = min(b, key=sympy.default_sort_key)
    lam = sympy.cancel(sympy.together(a[key] / b[key]))
    _, den = sympy.fraction(lam)
    if not _nonzero(den) or lam == 0:
        return None
    if all(_zero(a[k] - lam * b[k]) for k in b if k != key):
        return sympy.factor_terms(lam)
    return None


def _holds_reductions(e: sympy.Expr) -> bool:
    """Does ``e`` hold a mean, a block mean or a window (whose integrands are left as they are:
    factoring would write the same reduction another way)?"""
    return e.has(Mean, BlockMean, Window)


def _integrand(
    terms: list[tuple[sympy.Expr, sympy.Expr]],
    constant: Callable[[sympy.Expr], bool],
    spell: Callable[[sympy.Expr], sympy.Expr],
) -> tuple[sympy.Expr, sympy.Expr]:
    """A merged mean's integrand Σ λ_k·u_k (``terms``: (λ_k, u_k)) as (c, u), c the factor
    constant over the domain taken out of the mean: over a common denominator of the λ's
    (exp(vw_in)·u_in + exp(vw_bn)·u_bn rather than exp(-vw_bn)·exp(vw_in)·u_in + u_bn), the
    sums it holds factored where they are small and spelled as the reader knows them."""
    fractions = [sympy.fraction(sympy.together(lam)) for lam, _ in terms]
    common = sympy.S.One
    for _, q in fractions:
        common = sympy.lcm(common, q) if q != 1 else common
    total = sympy.factor_terms(Add(*(sympy.cancel(p * common / q) * u for (p, q), (_, u) in zip(fractions, terms))))
    factors = []
    for f in Mul.make_args(total):
        if f.is_Add and not constant(f) and not _holds_reductions(f) and sympy.count_ops(f) <= 120:
            split = sympy.factor(f)  # (μ - x)·(...) out of a sum of six terms; x²/2 + x + 1 kept
            if sum(1 for a in Mul.make_args(split) if not a.is_Number) > 1:
                f = split
        for a in Mul.make_args(f):
            factors.extend(Mul.make_args(spell(a)) if a.is_Add else (a,))
    c, u = [1 / common], []
    for f in factors:
        (c if constant(f) else u).append(f)
    return Mul(*c), Mul(*u)


def _family(
    exprs: list[sympy.Expr], atoms: Sequence[sympy.Expr]
) -> tuple[list[sympy.Expr], dict[sympy.Expr, sympy.Dummy], list[sympy.Expr]] | None:
    """(the atoms that can be merged, a symbol for each, ``exprs`` with them as the symbols):
    those met only through sums and products, in expressions linear in them; None when
    fewer than two are, or the expressions are too large to try."""
    if len(atoms) < 2 or len(atoms) > _MAX_ATOMS or sum(sympy.count_ops(e) for e in exprs) > _MAX_OPS:
        return None
    pool = set(atoms)
    top: set[sympy.Expr] = set()
    nested: set[sympy.Expr] = set()
    for e in exprs:
        t, n = _top_level(e, pool)
        top |= t
        nested |= n
    family = sorted(top - nested, key=lambda a: (sympy.count_ops(a), sympy.default_sort_key(a)))
    if len(family) < 2:
        return None
    sym = {a: sympy.Dummy(f"M{k}", real=True) for k, a in enumerate(family)}
    hidden = [e.xreplace(sym) for e in exprs]
    rs = list(sym.values())
    for h in hidden:  # linear in the means: no coefficient reads a mean of the family
        for r in rs:
            if sympy.diff(h, r).has(*rs):
                return None
    return family, sym, hidden


def fewest_means(
    exprs: Sequence[sympy.Expr],
    atoms: Callable[[list[sympy.Expr]], list[sympy.Expr]],
    integrand: Callable[[sympy.Expr], sympy.Expr],
    make: Callable[[sympy.Expr], sympy.Expr],
    constant: Callable[[sympy.Expr], bool],
    written_out: Callable[[sympy.Expr], sympy.Expr] = lambda e: e,
    spell: Callable[[sympy.Expr], sympy.Expr] = lambda e: e,
    retidy: Callable[[sympy.Expr], sympy.Expr] | None = None,
) -> list[sympy.Expr]:
    """``exprs`` with their means (``atoms(exprs)`` finds them: one family, group means or
    block means of one kind) merged where their integrands or their coefficients are proportional, and -- where
    the outputs have fewer element directions than that leaves means (dx = a·⟨u₁⟩ + x·b·⟨u₂⟩
    + x·c·⟨u₃⟩) -- one mean per direction (see the module docstring). ``integrand(atom)`` is
    what an atom averages, ``make(u)`` the atom averaging u, ``constant(f)`` whether a factor
    is one value over the atoms' domain, ``written_out(u)`` an integrand in the symbols the
    comparison is made in (g written out), ``spell(f)`` a sum the merged integrand holds, as
    the reader knows it (a statistic's definition folded back into its name), ``retidy(e)``
    an output rebuilt by directions brought back to the closed forms' layout (without it,
    no merge by directions). Returns the expressions unchanged where nothing merges."""
    given = constant

    def constant(f: sympy.Expr) -> bool:  # a factor holding a reduction never moves into a mean
        return given(f) and not _holds_reductions(f)

    exprs = _merge_proportional(list(exprs), atoms(list(exprs)), integrand, make, constant, written_out, spell)
    if retidy is None:
        return exprs
    return _merge_directions(exprs, atoms(exprs), integrand, make, constant, spell, retidy)


def _merge_directions(
    exprs: list[sympy.Expr],
    atoms: Sequence[sympy.Expr],
    integrand: Callable[[sympy.Expr], sympy.Expr],
    make: Callable[[sympy.Expr], sympy.Expr],
    constant: Callable[[sympy.Expr], bool],
    spell: Callable[[sympy.Expr], sympy.Expr],
    retidy: Callable[[sympy.Expr], sympy.Expr],
) -> list[sympy.Expr]:
    """Σ_k ⟨u_k⟩·A_k with A_k = Σ_d c_kd·e_d over fewer element directions e_d (an output and
    an element monomial of it) than means: Σ_d e_d·⟨Σ_k c_kd·u_k⟩, one mean per direction
    (directions whose columns are proportional share theirs). No division by a value that
    may vanish: each new mean's integrand is the coefficients as derived."""
    found = _family(exprs, atoms)
    if found is None:
        return exprs
    family, sym, hidden = found
    columns: dict[tuple[int, sympy.Expr], dict[sympy.Expr, sympy.Expr]] = {}
    for i, h in enumerate(hidden):
        for a in family:
            for m, c in _vector(sympy.diff(h, sym[a]), constant).items():
                columns.setdefault((i, m), {})[a] = c
    reps: list[tuple[tuple[int, sympy.Expr], list[tuple[tuple[int, sympy.Expr], sympy.Expr]]]] = []
    for d in sorted(columns, key=lambda d: (d[0], sympy.count_ops(d[1]), sympy.default_sort_key(d[1]))):
        for rep, members in reps:
            mu = _ratio(columns[d], columns[rep])
            if mu is not None:
                members.append((d, mu))
                break
        else:
            reps.append((d, [(d, sympy.S.One)]))
    if len(reps) >= len(family):
        return exprs
    rest = [h.xreplace({r: 0 for r in sym.values()}) for h in hidden]
    holders, values = {}, {}
    for k, (rep, members) in enumerate(reps):
        holder = make(sympy.Dummy(f"P{k}", real=True))
        c, u = _integrand([(columns[rep][a], integrand(a)) for a in family if a in columns[rep]], constant, spell)
        values[holder] = c * make(u)
        for (i, m), mu in members:
            holders.setdefault(i, []).append(mu * m * holder)
    # the new integrands hold the coefficients as derived; where that makes them far larger
    # than the means they replace, the means stay as they are
    before = sum(sympy.count_ops(integrand(a)) for a in family)
    after = sum(sympy.count_ops(integrand(v.atoms(type(family[0])).pop())) for v in values.values())
    if after > _READABLE_GROWTH * before + _READABLE_SLACK:
        return exprs
    out = []
    for i, r in enumerate(rest):
        if i not in holders:
            out.append(exprs[i])
            continue
        out.append(retidy(r + Add(*holders[i])).xreplace(values))
    return out


def _merge_proportional(
    exprs: list[sympy.Expr],
    atoms: Sequence[sympy.Expr],
    integrand: Callable[[sympy.Expr], sympy.Expr],
    make: Callable[[sympy.Expr], sympy.Expr],
    constant: Callable[[sympy.Expr], bool],
    written_out: Callable[[sympy.Expr], sympy.Expr],
    spell: Callable[[sympy.Expr], sympy.Expr],
) -> list[sympy.Expr]:
    """Means with proportional integrands, then means with proportional coefficients in every
    output, as one (see :func:`fewest_means`)."""
    found = _family(exprs, atoms)
    if found is None:
        return exprs
    family, sym, hidden = found

    # 1. integrands proportional: M_k = c·M_j
    vectors = {a: _vector(written_out(integrand(a)), constant) for a in family}
    kept: list[sympy.Expr] = []
    same: dict[sympy.Dummy, sympy.Expr] = {}
    for a in family:
        for b in kept:
            c = _ratio(vectors[a], vectors[b])
            if c is not None:
                same[sym[a]] = c * sym[b]
                break
        else:
            kept.append(a)
    if same:
        hidden = [h.xreplace(same) for h in hidden]

    # 2. coefficients proportional in every output: M_j·A_j + M_k·A_k = <u_j + λ·u_k>·A_j
    def coefficients(a: sympy.Expr) -> dict:
        out = {}
        for i, h in enumerate(hidden):
            for k, v in _vector(sympy.diff(h, sym[a]), constant).items():
                out[(i, k)] = v
        return out

    coef = {a: coefficients(a) for a in kept}
    groups: list[tuple[sympy.Expr, list[tuple[sympy.Expr, sympy.Expr]]]] = []  # (representative, [(atom, λ)])
    for a in kept:
        if not coef[a]:
            groups.append((a, [(a, sympy.S.One)]))
            continue
        for i, (b, members) in enumerate(groups):
            lam = _ratio(coef[a], coef[b]) if coef[b] else None
            if lam is not None:
                members.append((a, lam))
                break
            back = _ratio(coef[b], coef[a]) if coef[b] else None
            if back is not None:  # a becomes the representative: b = back·a
                groups[i] = (a, [(a, sympy.S.One), *((m, back * lm) for m, lm in members)])
                break
        else:
            groups.append((a, [(a, sympy.S.One)]))
    if not same and all(len(m) == 1 for _, m in groups):
        return exprs
    put: dict[sympy.Dummy, sympy.Expr] = {}
    for rep, members in groups:
        if len(members) == 1:
            put[sym[rep]] = rep
            continue
        c, u = _integrand([(lam, integrand(m)) for m, lam in members], constant, spell)
        put[sym[rep]] = c * make(u)
        for m, _ in members:
            if m != rep:
                put[sym[m]] = sympy.S.Zero
    for a in family:
        put.setdefault(sym[a], a)
    return [h.xreplace(put) for h in hidden]
