"""The brute-force side of the proof, shared by both orders: a mode's layer written out at
N = n explicit scalar symbols per element-level quantity (:class:`_Explicit`: the
statistics as explicit sums, block means and windows over their elements), the loss
L = Σ_j ∂L/∂y_j·y_j (:func:`_explicit_loss`), its derivatives with each distinct
subexpression differentiated once (:func:`_diff`), and the window sizes a proof is made at
(:func:`window_sizes`).
"""

from __future__ import annotations

import functools
import itertools
import math

import sympy

from derivgen.derive.results import G, ModeDerivation
from derivgen.spec.model import DY, N, Spec, X
from derivgen.symbolic import functions
from derivgen.symbolic.block import GROUP_AXES, BlockMean
from derivgen.symbolic.reduce import SELECTIONS, GroupMax, Mean
from derivgen.symbolic.window import Window, offsets


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


def _explicit_outputs(ex: _Explicit) -> dict[str, list[sympy.Expr]]:
    """The explicit outputs beside y (x̂ written out), each at every element."""
    first = ex.first
    xhat = first.spec.normalized.symbol if first.spec.normalized else None
    out = {}
    for o in first.spec.outputs:
        full = o.expr.xreplace({xhat: first.normalized_expr}) if xhat is not None else o.expr
        out[o.name] = [ex.at(full, i) for i in range(ex.n)]
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
