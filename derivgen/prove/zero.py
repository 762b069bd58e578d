"""Is a difference of closed form and brute force zero? Symbolically (:func:`_proven`): one
coefficient of the symbols it is linear in at a time, square roots as generators, absolute
values and signs split by region (:func:`_zero_symbolic`), each region's numerator reduced
in exact rational arithmetic (:func:`_reduces_to_zero`, :func:`_polynomial_zero`, under a
budget of :class:`~derivgen.prove.exact.Work`); selections and stop-gradients first taken
as they are, then unfolded.
"""

from __future__ import annotations

import itertools
import math

import sympy

from derivgen.prove import exact
from derivgen.prove.exact import UNLIMITED, Work
from derivgen.symbolic import domain, functions


def _strip_positive(e: sympy.Expr) -> sympy.Expr:
    """|a·p| = |a|·p and sign(a·p) = sign(a) for a factor p positive on the layer's domain
    (a root of a non-negative value, a negative power, eps): the case split then sees one
    argument, x₀, where SymPy wrote sign(x₀/(ε + √(x₀⁴/2 + x₁⁴/2))^(1/3)) and |x₀|."""

    def split(u, nonzero=False):
        """u = keep·pos with pos positive (a denominator is not zero: non-negative is positive)."""
        keep, pos = [], []
        least = domain.NONNEG if nonzero else domain.POSITIVE
        for f in sympy.Mul.make_args(u):
            (pos if domain.sign_level(f) >= least or f.is_positive else keep).append(f)
        return sympy.Mul(*keep), sympy.Mul(*pos)

    def prim(p):
        """p = c·k: a number c and a primitive k of one sign convention (of k and -k, the
        one that sorts first), so equal arguments written differently compare equal."""
        c, k = sympy.factor_terms(sympy.expand(p)).as_coeff_Mul()
        k = sympy.expand(k)
        if k.could_extract_minus_sign():  # SymPy's own convention for |k| and sign(k)
            c, k = -c, sympy.expand(-k)
        return c, k

    def canonical(u):
        """u = c·s·k₁/k₂: a number c, a positive s, and the primitive numerator and denominator."""
        num, den = sympy.fraction(sympy.together(u))
        num, s1 = split(num)
        den, s2 = split(den, nonzero=True)
        c1, k1 = prim(num)
        c2, k2 = prim(den)
        return c1 / c2, s1 / s2, k1, k2

    def abs_(a):
        c, s, k1, k2 = canonical(a.args[0])
        return abs(c) * s * sympy.Abs(k1) / sympy.Abs(k2)

    def sign_(a):
        c, _, k1, k2 = canonical(a.args[0])
        return sympy.sign(c) * sympy.sign(k1) * sympy.sign(k2)

    if not e.has(sympy.Abs, sympy.sign):
        return e
    e = e.replace(lambda a: isinstance(a, sympy.Abs), abs_)
    return e.replace(lambda a: isinstance(a, sympy.sign), sign_)


def _zero_symbolic(diff: sympy.Expr, work: Work = UNLIMITED) -> bool:
    """Zero by exact rational reduction under ``work`` (see :func:`_reduces_to_zero`). Absolute values
    (SymPy writes √(t²) as |t| for real t, as at N = 2) are split by cases: |t| = ±t and
    sign(t) = ±1, one argument at a time (at most 32 cases), each case reduced the same
    way; a case whose signs no point has (x₀ - 2x₁ + x₂, x₀ + x₁ - 2x₂ and -2x₀ + x₁ + x₂
    all positive: they sum to zero) is skipped."""
    budget = [32]

    def split(e, decided):
        e = _strip_positive(e)
        args = sorted({a.args[0] for a in e.atoms(sympy.Abs, sympy.sign)}, key=sympy.default_sort_key)
        if not args:
            return _reduces_to_zero(e, work)
        t = args[0]
        for sgn in (1, -1):
            case = decided + [(t, sgn)]
            if _infeasible(case):
                continue
            budget[0] -= 1
            if budget[0] < 0:
                return False
            if not split(_with_sign(e, t, sgn), case):
                return False
        return True

    return split(diff, [])


def _with_sign(e: sympy.Expr, t: sympy.Expr, sgn: int) -> sympy.Expr:
    """``e`` in the case ``sgn``·t > 0: |t| = sgn·t and sign(t) = sgn."""
    e = e.replace(lambda a: isinstance(a, sympy.Abs) and a.args[0] == t, lambda a: sgn * t)
    return e.replace(lambda a: isinstance(a, sympy.sign) and a.args[0] == t, lambda a: sympy.Integer(sgn))


def _infeasible(case: list[tuple[sympy.Expr, int]]) -> bool:
    """No point gives every linear form its sign: some non-negative combination of the
    signed forms (not all zero) is identically zero (Gordan's alternative). Forms that are
    not linear and homogeneous are assumed feasible."""
    syms = sorted(set().union(*(t.free_symbols for t, _ in case)), key=sympy.default_sort_key)
    if len(case) < 2 or not syms:
        return False
    vecs = []
    for t, sgn in case:
        try:
            poly = sympy.Poly(t, *syms)
        except sympy.PolynomialError:
            return False
        if poly.total_degree() != 1 or poly.coeff_monomial(1) != 0:
            return False
        vecs.append([sgn * poly.coeff_monomial(s) for s in syms])
    for r in range(2, len(vecs) + 1):
        for subset in itertools.combinations(range(len(vecs)), r):
            null = sympy.Matrix([vecs[k] for k in subset]).T.nullspace()
            if len(null) == 1 and (all(v > 0 for v in null[0]) or all(v < 0 for v in null[0])):
                return True
    return False


def _roots(e: sympy.Expr) -> list[sympy.Pow]:
    return [q for q in e.atoms(sympy.Pow) if q.exp.is_Rational and not q.exp.is_Integer]


def _primitive_root(q: sympy.Pow) -> sympy.Expr:
    """b^(p/q) -> c^(p/q)·k^(p/q) for b = c·k, c > 0 its numeric content, when b holds no other
    root: one root written two ways (√(x₀²/4 + ...) and √(13x₀² + ...)/4) becomes one generator."""
    c, k = sympy.expand(q.base).as_content_primitive()
    if c <= 0 or c == 1:
        return q
    return sympy.Pow(c, q.exp) * sympy.Pow(k, q.exp)


def _primitive_roots(e: sympy.Expr, roots: list[sympy.Pow]) -> sympy.Expr:
    """``e`` with each of ``roots`` whose base is not a number written by :func:`_primitive_root`."""
    return e.xreplace({q: _primitive_root(q) for q in roots if not q.base.is_Number})


def _reduces_to_zero(diff: sympy.Expr, work: Work = UNLIMITED) -> bool:
    """Zero as a rational function once every root b^(1/q) is a generator t with t^q = b.

    ``cancel`` alone treats √E as independent of E (at N = 2 a standard deviation is
    √((x₀ - x₁)²/2), and the two sides meet only through t² = E), and is slow with roots
    inside. Roots are replaced innermost first (a root may sit inside another's base),
    b^(p/q) by t^p; the difference is brought over one denominator, and its numerator --
    a polynomial in the generators -- is pseudo-reduced modulo den(b)·t^q - num(b),
    outermost first (:func:`_polynomial_zero`), all of it charged to ``work``. What that
    leaves undecided (an identity between functions other than exp) goes to ``cancel``
    where the difference is small (:data:`CANCEL_NODES`), and is not proven otherwise."""
    if not _roots(diff):
        fast = _polynomial_zero(diff, [], work)
        return fast if fast is not None else _small_cancel(diff, work)
    e, rels = diff, []
    for k in range(8):
        inner = [q for q in _roots(e) if not _roots(q.base)]
        if not inner:
            break
        if k == 0:
            e = _primitive_roots(e, inner)
            continue
        base = min((q.base for q in inner), key=sympy.default_sort_key)
        den = math.lcm(*[int(q.exp.q) for q in inner if q.base == base])
        t = sympy.Dummy(f"t{k}", positive=True)
        e = e.xreplace({q: t ** int(den * q.exp) for q in inner if q.base == base})
        rels.append((t, den, base))
    if _roots(e):
        return False
    return bool(_polynomial_zero(e, rels, work))


CANCEL_NODES = 400  # the largest difference (in expression nodes) left to ``cancel`` when exact arithmetic is undecided


def _small_cancel(diff: sympy.Expr, work: Work) -> bool:
    """``cancel`` for a difference of at most :data:`CANCEL_NODES` nodes (charged as its
    square), which applies identities between functions that generators do not know; larger
    ones are not proven here (the decision depends on the expression alone)."""
    nodes = sum(1 for _ in sympy.preorder_traversal(diff))
    if nodes > CANCEL_NODES:
        return False
    work.charge(nodes * nodes)
    return sympy.cancel(sympy.together(diff)) == 0


def _exact_floats(e: sympy.Expr) -> sympy.Expr:
    """Every Float as the rational it is exactly (a binary fraction): both sides carry a
    constant such as 0.044715 as the same Float, so the identity is one between rationals."""
    floats = e.atoms(sympy.Float)
    return e.xreplace({f: sympy.Rational(f) for f in floats}) if floats else e


def _polynomial_zero(
    e: sympy.Expr, rels: list[tuple[sympy.Symbol, int, sympy.Expr]], work: Work = UNLIMITED
) -> bool | None:
    """Whether the numerator of ``e`` over one denominator is zero once pseudo-reduced modulo
    each relation den(b)·t^q - num(b) of ``rels`` (outermost first): the reduction
    :func:`_reduces_to_zero` makes, in SymPy's sparse polynomials over QQ, built node by node
    under ``work`` (:mod:`derivgen.prove.exact`; :class:`~derivgen.prove.exact.OutOfWork`
    propagates). Floats are the rationals they are; exponentials are written in canonical
    generators (exp(a + b) and exp(a)·exp(b) are one monomial).

    Other function applications are generators of their own: zero for every value of the
    generators is zero for theirs, so True is final; False is final only where there were
    none, exponentials included (tanh² + sech² = 1 is not a polynomial identity). None: not decided here (such
    functions, or what is not a rational function over QQ)."""
    if e.is_Number:
        return bool(e == 0)
    every = _exact_floats(sympy.Tuple(e, *(b for _, _, b in rels)))
    every, exponentials = exact.canonical_exponentials(every)
    funcs = every.atoms(sympy.Function)
    opaque = {f: sympy.Dummy(f"f{k}") for k, f in enumerate(sorted(funcs, key=sympy.default_sort_key))}
    every = every.xreplace(opaque)
    e, bases = every.args[0], every.args[1:]
    gens = sorted(
        set().union(every.free_symbols, (t for t, _, _ in rels)),
        key=sympy.default_sort_key,
    )
    ring = exact.ring_of(gens)
    try:
        num = exact.numerator(e, ring, work)
        for (t, den, _), base in reversed(list(zip(rels, bases))):
            g = ring.gens[gens.index(t)]
            if num and num.degree(g) > 0:
                bn, bd = exact.fraction(base, ring, work)
                num = exact.pseudo_remainder(num, bd * g**den - bn, g, work)
    except exact.NotRational:
        return None
    if not num:
        return True
    return None if opaque or exponentials else False


def _proven(d: sympy.Expr, lin: list[sympy.Symbol], work: Work = UNLIMITED) -> bool:
    """Symbolically zero: both sides are linear in the symbols ``lin`` (∂L/∂y; the second
    order's cotangents or tangents), so each coefficient vanishes on its own.

    Selections (maximum, clip, their masks step and indicator) and stop-gradients are first
    taken as they are -- opaque values, equal where both sides select alike; where that does
    not reach zero, they are written through |.| and sign (:func:`functions.unfold`, valid off
    the kinks) and each region is reduced on its own by the case split."""

    def zero(e: sympy.Expr) -> bool:
        # e is linear in lin: zero where every symbol of lin is 0, and where each one alone is 1,
        # is zero everywhere (the coefficients without differentiating e, as sympy.diff would)
        off = {s: 0 for s in lin}
        rest = e.xreplace(off)
        if not _zero_symbolic(rest, work):
            return False
        present = e.free_symbols
        return all(_zero_symbolic(e.xreplace({**off, s: 1}), work) for s in lin if s in present)

    if zero(d):
        return True
    unfolded = functions.unfold(d)
    return unfolded != d and zero(unfolded)
