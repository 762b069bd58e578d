"""Proof of the closed forms against brute-force differentiation at small N.

For N = 2..6 the layer is written out with N explicit scalar symbols per
element-level quantity (x_j, ∂L/∂y_j and every per-channel parameter), the
statistics as explicit sums, ``L = Σ_j ∂L/∂y_j · y_j`` differentiated with
``sympy.diff``, and the difference from the closed form reduced to zero with
``together``/``cancel`` -- one coefficient of each ∂L/∂y_j at a time (both
sides are linear in ∂L/∂y), at element 0 (the layer is symmetric in its
elements), with square roots as generators t, t² = E, and absolute values
split by sign.  The reduction is exact rational arithmetic in sparse polynomials
(:mod:`derivgen.prove.exact`) under a budget counted in work -- term pairs multiplied,
:data:`SYMBOLIC_WORK` per size -- not in seconds, so the verdict depends on the spec and
the size alone. Where that does not reach zero within the budget, the difference is
evaluated at random rational points in 80-digit arithmetic, and the result is reported as
"checked numerically" -- never as "proven".
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import sympy

from derivgen.derive.first import G, ModeDerivation, ParamGrad
from derivgen.derive.second import SecondOrder, almost_everywhere
from derivgen.prove import exact
from derivgen.prove.exact import UNLIMITED, OutOfWork, Work
from derivgen.spec.model import DY, Input, N, Param, Spec, X
from derivgen.symbolic import domain, functions
from derivgen.symbolic.block import GROUP_AXES, BlockMean
from derivgen.symbolic.reduce import SELECTIONS, GroupMax, Mean
from derivgen.symbolic.window import Window, offsets


@dataclass
class ProofResult:
    """One size's verdict: at N = ``n`` the closed forms were proven, checked numerically,
    FAILED (``detail`` says which check) or "timed out" (past the last-resort guard of
    :data:`GUARD_SECONDS`, which no budget of work decides), by ``method``, in ``seconds``."""

    n: int
    status: str  # "proven", "checked numerically", "FAILED", "timed out"
    method: str
    seconds: float
    detail: str = ""
    work: int = 0  # units of exact arithmetic the symbolic reduction used (the same on every machine)

    @property
    def ok(self) -> bool:
        """Proven or checked numerically: not failed."""
        return self.status in ("proven", "checked numerically")


@dataclass
class ModeProof:
    """One mode's proof: a :class:`ProofResult` per size."""

    mode: str
    results: list[ProofResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No size failed."""
        return all(r.ok for r in self.results)

    @property
    def status(self) -> str:
        """The weakest result over the sizes: "FAILED", "timed out", "checked numerically",
        "proven", or "not checked" when there are none."""
        if not self.results:
            return "not checked"
        if any(r.status == "FAILED" for r in self.results):
            return "FAILED"
        if not self.ok:
            return "timed out"
        if all(r.status == "proven" for r in self.results):
            return "proven"
        return "checked numerically"


def _elements(name: str, n: int) -> list[sympy.Symbol]:
    """x[0], ..., x[n-1]: no spec name has brackets (and sympy.symbols("stat_20:2") is a range)."""
    return [sympy.Symbol(f"{name}[{j}]", real=True) for j in range(n)]


class _Explicit:
    """Writes a mode's element-level expressions out at N = n explicit elements: ``elem``
    maps each per-element symbol to its n elements, ``group`` each statistic to its
    explicit sum, ``derived`` x̂, the coordinate and g to their definitions."""

    def __init__(self, first: ModeDerivation, n: int, window: int | None = None):
        spec = first.spec
        self.first = first
        self.window = window  # the size every window option takes (windows: one size per check)
        self.windows = {w.symbol: w.expr for w in spec.windows}
        self.blocks = {b.symbol: b.expr for b in first.blocks}
        self.block_memo: dict[tuple, sympy.Expr] = {}
        # with block statistics the group is a grid over the axes it spans (of the (O, G, Cg, S)
        # view): S has n elements, every other spanned axis 2; a per-channel value is one
        # symbol per channel. Without, n elements in a row, each with its own parameters.
        self.coords: list[tuple[int, ...]] | None = None
        if self.blocks:
            spans = GROUP_AXES[(spec.layout, spec.reduce)]
            sizes = [(n if a == 3 else 2) if a in spans and a != 1 else 1 for a in range(4)]
            self.coords = list(itertools.product(*(range(k) for k in sizes)))
            n = len(self.coords)
        self.n = n
        self.elem: dict[sympy.Symbol, list[sympy.Symbol]] = {X: _elements("x", n), DY: _elements("dy", n)}
        for p in spec.params:
            if not p.scalar:  # a scalar parameter is one symbol for the whole group
                self.elem[p.symbol] = self.per_channel(p.name)
        for m in spec.mask_symbols:  # any constant per element: the 0/1 pattern is one case
            self.elem[m] = [sympy.Symbol(f"{m.name}[{j}]", nonnegative=True) for j in range(n)]
        for t in spec.tensors:  # one symbol per element (a broadcast tensor's are some of them equal)
            self.elem[t.symbol] = [sympy.Symbol(f"{t.name}[{j}]", **t.symbol.assumptions0) for j in range(n)]
        for o in spec.outputs:
            self.elem[o.cotangent] = _elements(o.cotangent.name, n)
        self.cotangents = [self.elem[c] for c in spec.cotangents]
        self.derived: dict[sympy.Symbol, sympy.Expr] = {}
        if spec.core is not None:  # h = f(x, t) at each element
            self.derived[spec.core.symbol] = spec.core.expr
        self.group: dict[sympy.Symbol, sympy.Expr] = {N: sympy.Integer(n)}
        for w in spec.windows:
            if w.size.is_Symbol:
                self.group[w.size] = sympy.Integer(window)
        for st in first.statistics:
            self.group[st.symbol] = self.at(st.expr, None)
        if spec.normalized is not None:
            self.derived[spec.normalized.symbol] = first.normalized_expr
        if first.coordinate is not None:
            self.derived[first.coordinate.symbol] = first.coordinate_expr
        if first.g is not None:
            self.derived[G] = first.g

    def per_channel(self, name: str) -> list[sympy.Symbol]:
        """A per-channel value's symbol at each element: one per element in a row, one per
        channel on a grid."""
        if self.coords is None:
            return _elements(name, self.n)
        return [sympy.Symbol(f"{name}[{c[1] * 2 + c[2]}]", real=True) for c in self.coords]

    def members(self, sym: sympy.Symbol, values: list[sympy.Symbol]) -> list[int]:
        """The elements whose entry of ``values`` is ``sym``."""
        return [j for j, v in enumerate(values) if v == sym]

    def _block(self, b: BlockMean, i: int) -> sympy.Expr:
        """A block mean at element i: the mean of its argument over the elements of i's block."""
        keep = [a for a in range(4) if a not in b.axes]
        mine = [self.coords[i][a] for a in keep]
        key = (b, tuple(mine))  # one value per block: written out once for all its elements
        if key not in self.block_memo:
            js = [j for j, c in enumerate(self.coords) if [c[a] for a in keep] == mine]
            self.block_memo[key] = sympy.Add(*[self.at(b.body, j) for j in js]) / len(js)
        return self.block_memo[key]

    def _blocks(self, e: sympy.Expr, i: int) -> sympy.Expr:
        """``e`` with every block mean and block statistic at element i written out."""
        if isinstance(e, BlockMean):
            return self._block(e, i)
        if e in self.blocks:
            return self._blocks(self.blocks[e], i)
        if e.is_Atom or not (e.has(BlockMean) or e.free_symbols & set(self.blocks)):
            return e
        return e.func(*[self._blocks(a, i) for a in e.args])

    def _size(self, k: sympy.Expr) -> int:
        """A window's size: its integer, or the size this check gives its option."""
        return int(k) if k.is_Integer else self.window

    def _windows(self, e: sympy.Expr, i: int) -> sympy.Expr:
        """``e`` with every window at element i written out as the sum over its neighbours
        inside the group (outermost first: a window inside a window is summed at each
        neighbour of the outer one)."""
        if isinstance(e, Window) or e in self.windows:
            w = e if isinstance(e, Window) else self.windows[e]
            near = [i + d for d in offsets(self._size(w.size), w.transposed)]
            return sympy.Add(*[self.at(w.body, j) for j in near if 0 <= j < self.n])
        if e.is_Atom or not (e.has(Window) or e.free_symbols & set(self.windows)):
            return e
        return e.func(*[self._windows(a, i) for a in e.args])

    def at(self, expr: sympy.Expr, i: int | None) -> sympy.Expr:
        """expr evaluated at element i (None: a group-level expression)."""

        def mean(m):
            return sympy.Add(*[self.at(m.args[0], j) for j in range(self.n)]) / self.n

        def select(m):
            """max(r) / min(r) over the n explicit elements, as nested maximum / minimum (equal
            to PyTorch's amax, and to its gradient, wherever no two elements tie)."""
            pick = functions.Maximum if type(m) is GroupMax else functions.Minimum
            return functools.reduce(pick, [self.at(m.args[0], j) for j in range(self.n)])

        e = expr.replace(lambda a: isinstance(a, Mean), mean)
        e = e.replace(lambda a: isinstance(a, SELECTIONS), select)
        sub = dict(getattr(self, "derived", {}))
        while sub and e.free_symbols & set(sub):  # g may be written in x̂
            e = e.xreplace(sub)
        if i is not None:  # after the means (a window inside a mean is at the mean's elements) and g
            e = self._windows(e, i)
            if self.blocks:
                e = self._blocks(e, i)
        table = dict(self.group)
        if i is not None:
            table.update({s: v[i] for s, v in self.elem.items()})
        return e.xreplace(table)


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


NUMERIC_DIGITS = 80


class _Sampler:
    """Random rational points for the numeric check: an option strictly inside its
    declared [min, max] (1/100 steps of the interval), or up to 0.1 above its min
    (below its max) where only one bound is declared; any other symbol up to 0.1
    above zero where it is declared non-negative, else in about [-3, 3]."""

    def __init__(self, rng: random.Random, bounds: dict[str, tuple] | None = None):
        self.rng = rng
        self.bounds = bounds or {}  # symbol name -> (min, max), either None

    @classmethod
    def for_spec(cls, spec: Spec, seed: int) -> _Sampler:
        """Points within the declared bounds of ``spec``'s options, seeded with ``seed``."""
        return cls(random.Random(seed), {o.name: (_exact(o.min), _exact(o.max)) for o in spec.options})

    def value(self, s: sympy.Symbol) -> sympy.Rational:
        """One random value for ``s`` (one draw from the generator)."""
        lo, hi = self.bounds.get(s.name, (None, None))
        if lo is not None and hi is not None:
            return lo + (hi - lo) * sympy.Rational(self.rng.randint(1, 99), 100)
        if lo is not None:
            return lo + sympy.Rational(self.rng.randint(1, 100), 1000)
        if hi is not None:
            return hi - sympy.Rational(self.rng.randint(1, 100), 1000)
        if s.is_nonnegative:
            return sympy.Rational(self.rng.randint(1, 100), 1000)
        return sympy.Rational(self.rng.randint(-300, 300), 97)


def _exact(v: float | None) -> sympy.Rational | None:
    """A declared bound as the rational its shortest decimal form names (1e-05 -> 1/100000)."""
    return None if v is None else sympy.Rational(repr(float(v)))


def _zero_numeric(diff: sympy.Expr, points: _Sampler, trials: int = 3) -> bool:
    """Evaluation in 80-digit arithmetic at random rational points (|difference| < 1e-40
    is zero: cancellation of terms up to ~1e35 stays below that; exact rational
    arithmetic would be exact but grows without bound inside tanh and exp -- a minute
    where this takes seconds), drawn within each option's declared bounds (see
    :class:`_Sampler`). A point where either side is undefined (NaN: two equal values
    at N = 2 make a deviation zero, and a root of it has no derivative there) is drawn
    again, up to 3 times per trial; a difference that is undefined everywhere is not zero."""
    done = tries = 0
    while done < trials:
        tries += 1
        if tries > 4 * trials:
            return False
        vals = {
            s: sympy.Float(points.value(s), NUMERIC_DIGITS) for s in sorted(diff.free_symbols, key=lambda s: s.name)
        }
        v = diff.xreplace(vals).evalf(NUMERIC_DIGITS)
        if v.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo):
            continue
        if not v.is_number or abs(v) > sympy.Float("1e-40", 60):
            return False
        done += 1
    return True


# per size: the exact arithmetic the symbolic reduction may do (units of exact.Work: term pairs
# multiplied) before the rest of that size's checks fall back to 80-digit numbers. A count of
# work, not seconds, so the verdict is the same on every machine and under any load.
SYMBOLIC_WORK = 20_000_000
# per size: a last guard in seconds against a SymPy step that no budget counts (differentiation
# of the unrolled forward); a size that reaches it is reported "timed out", never downgraded
GUARD_SECONDS = 3600.0


class _OutOfTime(Exception):
    pass


@contextmanager
def _budget(seconds: float):
    """Raise _OutOfTime in the block after ``seconds`` (main thread only: SIGALRM); an
    outer alarm (the spec fuzzer's) is kept and restored."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    if outer_left and outer_left <= seconds:
        yield  # the outer alarm comes first anyway
        return
    t0 = time.monotonic()

    def fire(signum, frame):
        # again in 50 ms: an exception raised while a gc callback runs (hypothesis installs
        # one) is printed and dropped there, and the block would run on unbounded
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        raise _OutOfTime()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer_left - (time.monotonic() - t0)))


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


# ---- the brute-force side, shared by both orders


def _diff(e: sympy.Expr, x: sympy.Symbol) -> sympy.Expr:
    """∂e/∂x by the chain rule over e's tree, each distinct subexpression differentiated once
    (the explicit layer repeats its statistics in every element's output, which ``sympy.diff``
    differentiates again at each). Sums, products, powers with exponents free of x, and
    functions through their ``fdiff`` are done here; anything else, and a function class with
    a derivative rule of its own, is left to ``sympy.diff``."""
    memo: dict[sympy.Basic, sympy.Expr] = {}
    zero = sympy.S.Zero

    def d(u: sympy.Basic) -> sympy.Expr:
        hit = memo.get(u)
        if hit is not None:
            return hit
        memo[u] = out = rule(u)
        return out

    def rule(u: sympy.Basic) -> sympy.Expr:
        if u.is_Atom:
            return sympy.S.One if u == x else zero
        if u.is_Add:
            return sympy.Add(*[d(a) for a in u.args])
        if u.is_Mul:
            terms = []
            for i, a in enumerate(u.args):
                da = d(a)
                if da != 0:
                    terms.append(sympy.Mul(*u.args[:i], da, *u.args[i + 1 :]))
            return sympy.Add(*terms)
        if u.is_Pow and d(u.exp) == 0:
            db = d(u.base)
            return zero if db == 0 else u.exp * u.base ** (u.exp - 1) * db
        if isinstance(u, sympy.Function) and type(u)._eval_derivative is sympy.Function._eval_derivative:
            terms = []
            for i, a in enumerate(u.args):
                da = d(a)
                if da != 0:
                    try:
                        f = u.fdiff(i + 1)
                    except (sympy.ArgumentIndexError, NotImplementedError):
                        return sympy.diff(u, x)
                    if f.has(sympy.Derivative, sympy.Subs):
                        return sympy.diff(u, x)
                    terms.append(f * da)
            return sympy.Add(*terms)
        return sympy.diff(u, x)

    return d(e)


_Check = tuple[str, sympy.Expr, list[sympy.Symbol]]  # (what, difference, symbols it is linear in)


def _explicit_loss(ex: _Explicit) -> tuple[list[sympy.Expr], sympy.Expr]:
    """The explicit outputs y_0 .. y_{n-1} (x̂ written out) and L = Σ_j ∂L/∂y_j · y_j."""
    first = ex.first
    spec = first.spec
    xhat = spec.normalized.symbol if spec.normalized else None
    y_full = spec.output.xreplace({xhat: first.normalized_expr}) if xhat is not None else spec.output
    ys = [ex.at(y_full, i) for i in range(ex.n)]
    loss = sympy.Add(*[ex.elem[DY][i] * ys[i] for i in range(ex.n)])
    for o in spec.outputs:  # the outputs beside y, each against its own cotangent
        full = o.expr.xreplace({xhat: first.normalized_expr}) if xhat is not None else o.expr
        loss += sympy.Add(*[ex.elem[o.cotangent][i] * ex.at(full, i) for i in range(ex.n)])
    return ys, loss


def _positions(ex: _Explicit) -> range:
    """The elements a per-element closed form is checked at: element 0 stands for every one
    where the layer treats its elements alike; a window sees the group's ends, so each."""
    return range(ex.n) if ex.windows else range(1)


def _param_check(
    prefix: str, loss: sympy.Expr, p: Param, grad: ParamGrad, ex: _Explicit, i: int = 0
) -> tuple[str, sympy.Expr]:
    """(``prefix`` d<name>, difference) for parameter ``p``'s closed-form gradient ``grad`` of ``loss``: at
    element i for a per-element parameter, summed over the group (element part over every
    element plus the group part) for a scalar one."""
    if p.scalar:
        total = sympy.Add(*[ex.at(grad.element, j) for j in range(ex.n)]) + ex.at(grad.group, None)
        return f"{prefix}d{p.name}", _diff(loss, p.symbol) - total
    sym = ex.elem[p.symbol][i]  # on a grid, its channel's symbol: the sum over the channel's elements
    closed = sympy.Add(*[ex.at(grad.element, j) for j in ex.members(sym, ex.elem[p.symbol])])
    return f"{prefix}d{p.name}_{i}", _diff(loss, sym) - closed


def _input_check(
    prefix: str, loss: sympy.Expr, inp: Input, closed: sympy.Expr, ex: _Explicit
) -> tuple[str, sympy.Expr]:
    """(``prefix`` d<name>, difference) for a per-group input's closed-form gradient ``closed`` of ``loss``."""
    return f"{prefix}d{inp.name}", _diff(loss, inp.symbol) - ex.at(closed, None)


# ---- first order


def _first_checks(first: ModeDerivation, ex: _Explicit) -> list[tuple[str, sympy.Expr]]:
    """(what, difference) for dx, the parameter and the input gradients at one size.

    Element 0 stands for every element: the explicit layer is symmetric under any joint
    permutation of (x_j, dy_j, p_j), and the closed form is the same formula at every j."""
    spec = first.spec
    _, loss = _explicit_loss(ex)
    checks = [(f"dx_{i}", _diff(loss, ex.elem[X][i]) - ex.at(first.dx, i)) for i in _positions(ex)]
    checks += [
        _param_check("", loss, p, first.grads[p.name], ex, i)
        for p in spec.params
        if not p.scalar
        for i in _positions(ex)
    ]
    checks += [_param_check("", loss, p, first.grads[p.name], ex) for p in spec.params if p.scalar]
    checks += [_input_check("", loss, inp, first.dinputs[inp.name], ex) for inp in spec.inputs]
    checks += [
        (f"d{t.name}_{i}", _diff(loss, ex.elem[t.symbol][i]) - ex.at(first.dtensors[t.name], i))
        for t in spec.grad_tensors
        for i in _positions(ex)
    ]
    return checks


def prove_mode(first: ModeDerivation, sizes: Iterable[int] = (2, 3, 4, 5, 6), work: int | None = None) -> ModeProof:
    """One mode's first-order closed forms against brute-force differentiation at each size
    (symbolic within ``work`` units of exact arithmetic per size, :data:`SYMBOLIC_WORK` by
    default, then 80-digit numbers)."""
    out = ModeProof(first.mode)
    points = _Sampler.for_spec(first.spec, 1234)
    limit = SYMBOLIC_WORK if work is None else work

    def settle(n, t0):
        checks = []
        for k in window_sizes(first.spec):
            ex = _Explicit(first, n, k)
            lin = [c for cs in ex.cotangents for c in cs]
            checks += [(_sized(what, k), d, lin) for what, d in _first_checks(first, ex)]
        return _settle(n, checks, t0, points, limit)

    for n in sizes:
        out.results.append(_guarded(n, functools.partial(settle, n)))
    return out


def window_sizes(spec: Spec) -> tuple[int | None, ...]:
    """The sizes a window option takes in the proof: 1, 2 (even: the window and its transpose
    differ) and 3, and the option's default; (None,) for a spec without window options."""
    opts = {o.symbol: o for o in spec.options}
    defaults = {int(opts[w.size].default) for w in spec.windows if w.size in opts and opts[w.size].default}
    sized = [opts[w.size] for w in spec.windows if w.size in opts]
    if not sized:
        return (None,)
    lo = max(o.min if o.min is not None else 1 for o in sized)
    hi = min(o.max if o.max is not None else math.inf for o in sized)
    return tuple(k for k in sorted({1, 2, 3} | defaults) if lo <= k <= hi) or (int(lo),)


def _sized(what: str, k: int | None) -> str:
    """A check's name, with the window size it was made at."""
    return what if k is None else f"{what} (window {k})"


def _settle(n: int, checks: list[_Check], t0: float, points: _Sampler, work_limit: int | None) -> ProofResult:
    """One size's result: each (what, difference, symbols it is linear in) reduced to zero
    symbolically (one coefficient of those symbols at a time) while the size's budget of
    ``work_limit`` units of exact arithmetic lasts, then in 80-digit arithmetic at random
    rational points; the first that is not zero fails."""
    method, status, detail = METHOD, "proven", ""
    work = Work(work_limit)
    for what, d, lin in checks:
        if not work.spent:
            try:
                if _proven(d, lin, work):
                    continue
            except OutOfWork:
                pass  # spent: 80-digit numbers for this check and the rest
        if _zero_numeric(d, points):
            method, status = "80-digit arithmetic at random rational points", "checked numerically"
            continue
        status, detail = "FAILED", f"{what} differs from brute force"
        break
    return ProofResult(n, status, method, time.perf_counter() - t0, detail, work.used)


METHOD = "exact rational arithmetic"


def _guarded(n: int, settle) -> ProofResult:
    """``settle()`` for size n, or "timed out" after :data:`GUARD_SECONDS`."""
    t0 = time.perf_counter()
    try:
        with _budget(GUARD_SECONDS):
            return settle(t0)
    except _OutOfTime:
        return ProofResult(n, "timed out", METHOD, time.perf_counter() - t0, f"past the {GUARD_SECONDS:g} s guard")


class _Derived(Protocol):
    """What :func:`prove_derivation` reads of a derivation: its modes."""

    modes: Mapping[str, ModeDerivation]


def prove_derivation(derivation: _Derived, sizes: Iterable[int] = (2, 3, 4, 5, 6)) -> dict[str, ModeProof]:
    """Every mode of a derivation (anything with ``modes``) proven: mode name -> proof."""
    return {name: prove_mode(first, sizes) for name, first in derivation.modes.items()}


# ---- second order


def _explicit_seeds(second: SecondOrder, ex: _Explicit) -> None:
    """Give the per-element cotangents and tangents (δx, ẋ, δp, ṗ of per-element parameters,
    δt, ṫ of tensor inputs) explicit elements in ``ex``, and a core value's δh and ḣ their
    definitions."""
    spec = second.spec
    for named in [
        second.cot_x,
        second.tan_x,
        *second.cot_tensors.values(),
        *second.tan_tensors.values(),
    ]:
        ex.elem[named.symbol] = _elements(named.name, ex.n)
    for p in spec.params:
        if not p.scalar:
            for named in (second.cot_params[p.name], second.tan_params[p.name]):
                ex.elem[named.symbol] = ex.per_channel(named.name)
    if second.cot_core is not None:
        ex.derived[second.cot_core.symbol] = second.cot_core_expr
    if second.tan_core is not None:
        ex.derived[second.tan_core.symbol] = second.tan_core_expr


def _double_backward_loss(second: SecondOrder, ex: _Explicit, loss: sympy.Expr) -> sympy.Expr:
    """L₂ = Σ δx·∂L/∂x + Σ δp·∂L/∂p + δi·∂L/∂i + Σ δt·∂L/∂t: the VJP of the brute-force backward."""
    spec = second.spec
    n = ex.n
    l2 = sympy.Add(*[ex.elem[second.cot_x.symbol][i] * _diff(loss, ex.elem[X][i]) for i in range(n)])
    for p in spec.params:
        c = second.cot_params[p.name].symbol
        if p.scalar:
            l2 += c * _diff(loss, p.symbol)
        else:
            pairs = dict(zip(ex.elem[p.symbol], ex.elem[c]))  # one per channel
            l2 += sympy.Add(*[cs * _diff(loss, ps) for ps, cs in pairs.items()])
    for inp in spec.inputs:
        l2 += second.cot_inputs[inp.name].symbol * _diff(loss, inp.symbol)
    for t in spec.grad_tensors:  # one symbol per element, each with its own cotangent
        c = second.cot_tensors[t.name].symbol
        l2 += sympy.Add(*[ex.elem[c][i] * _diff(loss, ex.elem[t.symbol][i]) for i in range(n)])
    return l2


def _cotangent_seeds(second: SecondOrder, ex: _Explicit) -> list[sympy.Symbol]:
    """The cotangent symbols L₂ is linear in, explicit elements for per-element ones."""
    seeds = [*ex.elem[second.cot_x.symbol]]
    for p in second.spec.params:
        c = second.cot_params[p.name].symbol
        seeds += [c] if p.scalar else list(dict.fromkeys(ex.elem[c]))
    seeds += [second.cot_inputs[i.name].symbol for i in second.spec.inputs]
    return seeds + [s for t in second.spec.grad_tensors for s in ex.elem[second.cot_tensors[t.name].symbol]]


def _double_backward_checks(second: SecondOrder, ex: _Explicit, loss: sympy.Expr) -> list[_Check]:
    """(what, difference, cotangents) for the double backward's dx, d(∂L/∂y), parameter and
    input gradients, and for layers with them, d(∂L/∂out) of each output beside y and the
    tensor inputs' gradients: brute-force derivatives of L₂ against the closed forms at element 0."""
    spec = second.spec
    l2 = _double_backward_loss(second, ex, loss)
    seeds = _cotangent_seeds(second, ex)
    checks = []
    for i in _positions(ex):
        checks += [
            (f"double backward dx_{i}", _diff(l2, ex.elem[X][i]) - ex.at(second.dx, i)),
            (f"double backward ddy_{i}", _diff(l2, ex.elem[DY][i]) - ex.at(second.ddy, i)),
        ]
        checks += [
            (f"double backward dd{o.name}_{i}", _diff(l2, ex.elem[o.cotangent][i]) - ex.at(second.ddouts[o.name], i))
            for o in spec.outputs
        ]
        checks += [
            (f"double backward d{t.name}_{i}", _diff(l2, ex.elem[t.symbol][i]) - ex.at(second.dtensors[t.name], i))
            for t in spec.grad_tensors
        ]
        checks += [
            _param_check("double backward ", l2, p, second.grads[p.name], ex, i)
            for p in spec.params
            if not p.scalar or i == 0
        ]
    checks += [_input_check("double backward ", l2, inp, second.dinputs[inp.name], ex) for inp in spec.inputs]
    return [(what, d, seeds) for what, d in checks]


def _jvp_check(second: SecondOrder, ex: _Explicit, y0: sympy.Expr, i: int = 0, out: str = "y") -> _Check:
    """("JVP y_i", difference, tangents): the directional derivative of the explicit y_i (``y0``)
    along (ẋ, ṗ, i̇, ṫ) against the closed-form ẏ at element i (of the output ``out`` beside y:
    its tangent)."""
    spec = second.spec
    tx = ex.elem[second.tan_x.symbol]
    ty0 = sympy.Add(*[_diff(y0, ex.elem[X][j]) * tx[j] for j in range(ex.n)])
    tseeds = list(tx)
    for p in spec.params:
        t = second.tan_params[p.name].symbol
        if p.scalar:
            ty0 += _diff(y0, p.symbol) * t
            tseeds.append(t)
        else:
            pairs = dict(zip(ex.elem[p.symbol], ex.elem[t]))  # one per channel
            ty0 += sympy.Add(*[_diff(y0, ps) * ts for ps, ts in pairs.items()])
            tseeds += list(pairs.values())
    for inp in spec.inputs:
        t = second.tan_inputs[inp.name].symbol
        ty0 += _diff(y0, inp.symbol) * t
        tseeds.append(t)
    for tn in spec.grad_tensors:
        tt = ex.elem[second.tan_tensors[tn.name].symbol]
        ty0 += sympy.Add(*[_diff(y0, ex.elem[tn.symbol][j]) * tt[j] for j in range(ex.n)])
        tseeds += list(tt)
    closed = second.ty if out == "y" else second.touts[out]
    return (f"JVP {out}_{i}", ty0 - ex.at(closed, i), tseeds)


def _explicit_outputs(ex: _Explicit) -> dict[str, list[sympy.Expr]]:
    """The explicit outputs beside y (x̂ written out), each at every element."""
    first = ex.first
    xhat = first.spec.normalized.symbol if first.spec.normalized else None
    out = {}
    for o in first.spec.outputs:
        full = o.expr.xreplace({xhat: first.normalized_expr}) if xhat is not None else o.expr
        out[o.name] = [ex.at(full, i) for i in range(ex.n)]
    return out


def _second_checks(second: SecondOrder, n: int) -> list[_Check]:
    """(what, difference, symbols it is linear in) for the double backward and the JVP at
    size n, where |u| is differentiable (:func:`~derivgen.derive.second.almost_everywhere`)."""
    checks = []
    for k in window_sizes(second.spec):
        ex = _Explicit(second.first, n, k)
        _explicit_seeds(second, ex)
        ys, loss = _explicit_loss(ex)
        found = [
            *_double_backward_checks(second, ex, loss),
            *(_jvp_check(second, ex, ys[i], i) for i in _positions(ex)),
        ]
        for name, values in _explicit_outputs(ex).items():
            found += [_jvp_check(second, ex, values[i], i, name) for i in _positions(ex)]
        shift = _core_coordinates(second.spec, ex)
        checks += [(_sized(what, k), _shifted(almost_everywhere(d), shift), lin) for what, d, lin in found]
    return checks


def _shifted(d: sympy.Expr, shift: dict[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    """``d`` in the coordinates ``shift`` gives (:func:`_core_coordinates`); as it is where it
    holds a derivative SymPy left unevaluated (its variable must stay a symbol)."""
    if not shift or d.has(sympy.Derivative, sympy.Subs):
        return d
    return d.xreplace(shift)


def _core_coordinates(spec: Spec, ex: _Explicit) -> dict[sympy.Symbol, sympy.Expr]:
    """For a core value h = x + c(t) (a residual sum): x_j = h_j - c(t)_j, a change of variables
    with polynomial inverse, so a difference is zero in (x, t) exactly where it is zero in
    (h, t). The layer reads x only through h: each difference, brute force and closed form
    alike, then holds one data symbol per element where it held one per summand (the residual
    layers' exact reduction is several times smaller). Empty for other layers."""
    core = spec.core
    if core is None or sympy.diff(core.expr, X) != 1 or sympy.diff(core.expr, X, 2) != 0:
        return {}
    rest = core.expr - X
    hs = [sympy.Symbol(f"{core.name}[{j}]", real=True) for j in range(ex.n)]
    return {ex.elem[X][j]: hs[j] - ex.at(rest, j) for j in range(ex.n)}


def prove_second_mode(second: SecondOrder, sizes: Iterable[int] = (2, 3, 4, 5), work: int | None = None) -> ModeProof:
    """The second-order closed forms (:mod:`derivgen.derive.second`) against brute force at small N:
    the first-order gradients of the explicit layer by ``sympy.diff``, their VJP with the
    cotangents (δx, δp, δi) differentiated again, and the directional derivative of the
    explicit y along (ẋ, ṗ, i̇); for a layer with tensor inputs and outputs beside y, δt and ṫ
    of each tensor with a gradient, the gradients of L₂ w.r.t. each tensor and each output's
    cotangent, and the tangent of each output; compared at element 0 like the first order, one
    coefficient of each cotangent or tangent at a time (both sides are linear in them).
    Falls back to 80-digit evaluation at random rational points when the symbolic budget
    (``work`` units of exact arithmetic per size, :data:`SYMBOLIC_WORK` by default) is spent
    (reported as "checked numerically")."""
    out = ModeProof(second.first.mode)
    points = _Sampler.for_spec(second.spec, 4321)
    limit = SYMBOLIC_WORK if work is None else work
    for n in sizes:
        out.results.append(_guarded(n, lambda t0, n=n: _settle(n, _second_checks(second, n), t0, points, limit)))
    return out
