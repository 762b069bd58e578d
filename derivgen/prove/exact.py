"""Exact rational arithmetic for the proof, under a budget counted in work, not seconds.

A difference between a closed form and brute-force differentiation is zero when its
numerator, over one common denominator and multiplied out as a polynomial over QQ, is
zero. :func:`fraction` builds that numerator node by node in SymPy's sparse polynomials
(``PolyRing``), with the denominator kept as a product of polynomial factors (the common
denominator of a sum is the least common multiple of the factors, as ``together`` takes
it). Every product and sum of polynomials is charged to a :class:`Work` budget as the
number of term pairs (or terms) it touches, *before* it is made; when the budget is spent,
:class:`OutOfWork` is raised. The count depends only on the expression, so whether a proof
is symbolic or falls back to numbers is a property of the spec and the proof size, the
same on every machine and under any load.

Exponentials are brought to one form first (:func:`canonical_exponentials`): exp(a + 2b)
and exp(a)·exp(b)² are both E_a·E_b², so the identities between them are polynomial
identities in the generators E_a, E_b.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import sympy
from sympy.polys.rings import PolyElement, PolyRing
from sympy.polys.rings import ring as _ring


class OutOfWork(Exception):
    """The work budget is spent."""


class NotRational(Exception):
    """Not a rational function over QQ of the ring's generators (a Float, a root, a function
    application left in it, a division by zero)."""


class Work:
    """A budget of exact-arithmetic work: ``limit`` units (None: unlimited), where a product
    of polynomials of a and b terms costs a·b units and a sum a + b. Charges are made before
    the arithmetic they pay for, so a spent budget never lets one more step run."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.used = 0

    def charge(self, units: int) -> None:
        """Pay ``units``, or raise :class:`OutOfWork` (the units are counted either way)."""
        self.used += units
        if self.limit is not None and self.used > self.limit:
            raise OutOfWork()

    @property
    def spent(self) -> bool:
        """Whether more than the limit has been asked for."""
        return self.limit is not None and self.used > self.limit


UNLIMITED = Work(None)

# the denominator of a fraction: monic polynomial factor -> its exponent
Den = dict


def _mul(a: PolyElement, b: PolyElement, work: Work) -> PolyElement:
    work.charge(len(a) * len(b) or 1)
    return a * b


def _add(a: PolyElement, b: PolyElement, work: Work) -> PolyElement:
    work.charge(len(a) + len(b) or 1)
    return a + b


def _pow(a: PolyElement, k: int, work: Work) -> PolyElement:
    """a**k by squaring, each product charged."""
    out, base = None, a
    while k:
        if k & 1:
            out = base if out is None else _mul(out, base, work)
        k >>= 1
        if k:
            base = _mul(base, base, work)
    return out if out is not None else a.ring.one


def _monic(p: PolyElement) -> tuple[PolyElement, object]:
    """p = c·m with m monic (its leading coefficient 1): (m, c). Factors equal up to a
    constant are one factor."""
    c = p.LC
    return (p if c == 1 else p.quo_ground(c)), c


class _Fractions:
    """Expressions as (numerator, denominator factors) over one ring, memoized per node."""

    def __init__(self, ring: PolyRing, index: Mapping[sympy.Basic, int], work: Work):
        self.ring = ring
        self.index = index
        self.work = work
        self.memo: dict[sympy.Basic, tuple[PolyElement, Den]] = {}

    def of(self, e: sympy.Basic) -> tuple[PolyElement, Den]:
        hit = self.memo.get(e)
        if hit is None:
            hit = self.memo[e] = self._of(e)
        return hit

    def _of(self, e: sympy.Basic) -> tuple[PolyElement, Den]:
        ring = self.ring
        if e in self.index:
            return ring.gens[self.index[e]], {}
        if e.is_Rational:
            return ring(sympy.QQ(int(e.p), int(e.q))), {}
        if e.is_Add:
            return self._sum([self.of(a) for a in e.args])
        if e.is_Mul:
            return self._product([self.of(a) for a in e.args])
        if e.is_Pow and e.exp.is_Integer:
            num, den = self.of(e.base)
            k = int(e.exp)
            if k >= 0:
                return _pow(num, k, self.work), {f: m * k for f, m in den.items()}
            return self._inverse(num, den, -k)
        raise NotRational(type(e).__name__)

    def _inverse(self, num: PolyElement, den: Den, k: int) -> tuple[PolyElement, Den]:
        """(num/den)**-k."""
        if not num:
            raise NotRational("division by zero")
        top = self.ring.one
        for f, m in den.items():
            top = _mul(top, _pow(f, m * k, self.work), self.work)
        if num.is_ground:
            return top.quo_ground(num.LC**k), {}
        m, c = _monic(num)
        return top.quo_ground(c**k), {m: k}

    def _product(self, parts: list[tuple[PolyElement, Den]]) -> tuple[PolyElement, Den]:
        den: Den = {}
        for _, d in parts:
            for f, m in d.items():
                den[f] = den.get(f, 0) + m
        num = self.ring.one
        for n, _ in sorted(parts, key=lambda p: len(p[0])):  # small factors first
            if not n.is_ground and den:
                m, c = _monic(n)
                if den.get(m):  # a factor that is also a denominator's cancels
                    den[m] -= 1
                    num = num.mul_ground(c)
                    continue
            num = _mul(num, n, self.work)
        return num, {f: k for f, k in den.items() if k}

    def _sum(self, parts: list[tuple[PolyElement, Den]]) -> tuple[PolyElement, Den]:
        groups: dict[frozenset, PolyElement] = {}  # terms over one denominator are added first
        dens: dict[frozenset, Den] = {}
        for n, d in parts:
            key = frozenset(d.items())
            groups[key] = _add(groups[key], n, self.work) if key in groups else n
            dens[key] = d
        if len(groups) == 1:
            ((key, num),) = groups.items()
            return num, dens[key]
        lcm: Den = {}
        for d in dens.values():
            for f, m in d.items():
                lcm[f] = max(lcm.get(f, 0), m)
        total = self.ring.zero
        for key, num in groups.items():
            d = dens[key]
            for f, m in lcm.items():
                if m > d.get(f, 0):
                    num = _mul(num, _pow(f, m - d.get(f, 0), self.work), self.work)
            total = _add(total, num, self.work)
        return total, lcm


def ring_of(gens: list[sympy.Basic]) -> PolyRing:
    """The polynomials over QQ in ``gens`` (symbols, or other atoms standing for themselves)."""
    return _ring(gens or [sympy.Dummy("one")], sympy.QQ)[0]


def fraction(e: sympy.Expr, ring: PolyRing, work: Work = UNLIMITED) -> tuple[PolyElement, PolyElement]:
    """``e`` as numerator and denominator polynomials in ``ring``'s generators, over the least
    common denominator of its parts, built under ``work``. Raises :class:`NotRational` where
    ``e`` is not a rational function of them and :class:`OutOfWork` when the budget is spent."""
    num, den = _Fractions(ring, {g.as_expr(): k for k, g in enumerate(ring.gens)}, work).of(e)
    d = ring.one
    for f, m in sorted(den.items(), key=lambda fm: len(fm[0])):
        d = _mul(d, _pow(f, m, work), work)
    return num, d


def numerator(e: sympy.Expr, ring: PolyRing, work: Work = UNLIMITED) -> PolyElement:
    """The numerator of :func:`fraction`, without multiplying the denominator out."""
    return _Fractions(ring, {g.as_expr(): k for k, g in enumerate(ring.gens)}, work).of(e)[0]


def pseudo_remainder(num: PolyElement, rel: PolyElement, gen: PolyElement, work: Work) -> PolyElement:
    """prem(num, rel) in ``gen``, charged as the products it makes: one per degree of num in
    gen above rel's, each of about len(num)·len(rel) term pairs."""
    steps = num.degree(gen) - rel.degree(gen) + 1
    if steps > 0:
        work.charge(steps * len(num) * len(rel))
    return num.prem(rel, gen)


def canonical_exponentials(e: sympy.Expr) -> tuple[sympy.Expr, dict[sympy.Symbol, sympy.Expr]]:
    """``e`` with every exp(Σ cₖ·uₖ) (cₖ rational) written as Π Eₖ^(cₖ·Lₖ), Eₖ = exp(uₖ/Lₖ) a
    new positive symbol, Lₖ the least common denominator of uₖ's coefficients anywhere in
    ``e``: exponentials equal by the laws of exponents become equal monomials. Returns the
    rewritten expression and the symbols' definitions. An exponent with a Float coefficient
    is left as it is."""
    exps = sorted(e.atoms(sympy.exp), key=sympy.default_sort_key)
    if not exps:
        return e, {}
    terms: dict[sympy.Basic, list[sympy.Rational]] = {}
    split: dict[sympy.Basic, list[tuple[sympy.Rational, sympy.Basic]]] = {}
    for f in exps:
        parts = []
        for t in sympy.Add.make_args(sympy.expand(f.args[0])):
            c, u = t.as_coeff_Mul()
            if not c.is_Rational:
                parts = None
                break
            parts.append((c, u))
        if parts is None:
            continue
        split[f] = parts
        for c, u in parts:
            terms.setdefault(u, []).append(c)
    gens = {}
    for k, u in enumerate(sorted(terms, key=sympy.default_sort_key)):
        lcd = math.lcm(*(int(c.q) for c in terms[u]))
        gens[u] = (sympy.Dummy(f"E{k}", positive=True), lcd)
    table = {f: sympy.Mul(*(gens[u][0] ** int(c * gens[u][1]) for c, u in parts)) for f, parts in split.items()}
    defs = {s: sympy.exp(u / lcd) for u, (s, lcd) in gens.items()}
    return e.xreplace(table), defs
