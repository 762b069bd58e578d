"""Run values: the parts of a sweep's element arithmetic that every element of a run of
positions shares, computed once per run.

A sweep that reads block values (:mod:`derivgen.codegen.c.blocks`) computes in double, and
much of its element arithmetic reads only values that are the same along a run of the
channel kernels' positions: the group values, the options, the per-channel parameters and
the block values (every block spans the positions). SwitchNorm's dx divides by
vz·(σ² + ε)^(3/2) and calls exp of the mixing weights in every element; GCC keeps each such
division in the loop (hoisting it would change the rounding). :func:`hoist` names those
parts instead, as the spec's expression holds them: a product's factors that read only such
values become one run value, a sum's terms likewise, and a whole subexpression that reads
only them is one. The element arithmetic multiplies and adds the run values; nothing is
expanded, so x − μ is still computed as written before it is scaled.

The rewrite is of the expression, not of where it is printed: the kernels print the run
values with the per-channel parameters, once per run where a run has one channel, in every
element where the channel varies along the run. Either place computes the same operations
in the same order, so the bits do not depend on the memory format or the thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy

from derivgen.symbolic.window import Window


class RunValues:
    """One planner's run values: an expression's name (``Run0``, ``Run1``, ... -- an
    upper-case tag, derivgen's namespace), the same for the same expression in every sweep of
    the kernel, so that passes walked together declare a shared one once."""

    def __init__(self) -> None:
        self.names: dict[sympy.Expr, sympy.Symbol] = {}

    def name(self, e: sympy.Expr) -> sympy.Symbol:
        """The name of run value ``e``, made on first use."""
        if e not in self.names:
            self.names[e] = sympy.Symbol(f"Run{len(self.names)}")
        return self.names[e]


def hoist(
    temps: list[tuple[str, sympy.Expr]],
    exprs: list[sympy.Expr],
    varying: Iterable[str],
    registry: RunValues,
) -> tuple[list[tuple[str, sympy.Expr]], list[tuple[str, sympy.Expr]], list[sympy.Expr]]:
    """``temps`` (element temporaries, in definition order) and ``exprs`` rewritten with run
    values, given the names ``varying`` along a run (the element values; a temporary
    reading one varies too). Returns (the run values and the temporaries that read no varying
    name, in definition order; the other temporaries; the expressions)."""
    moves = set(varying)
    inv: set[str] = set()  # the run values named so far
    runs: list[tuple[str, sympy.Expr]] = []

    def shared(e: sympy.Expr) -> bool:
        return not e.has(Window) and not ({str(s) for s in e.free_symbols} & moves)

    def name(e: sympy.Expr) -> sympy.Expr:
        if e.is_Atom:
            return e
        sym = registry.name(e)
        if str(sym) not in inv:
            runs.append((str(sym), e))
            inv.add(str(sym))
        return sym

    def rewrite(e: sympy.Expr) -> sympy.Expr:
        if e.is_Atom or isinstance(e, Window):
            return e
        if shared(e) and isinstance(e, sympy.Expr):  # not a comparison: a condition stays one
            return name(e)
        if e.is_Add or e.is_Mul:
            kept = [shared(a) for a in e.args]
            fixed = [a for a, k in zip(e.args, kept) if k]
            was = [a for a, k in zip(e.args, kept) if not k]
            moving = [rewrite(a) for a in was]
            if fixed and not _cheap(e.func(*fixed)):
                fixed = [name(e.func(*fixed))]
            elif all(a is b for a, b in zip(moving, was)):
                return e
            # unevaluated: a number times a sum is not distributed, the factors stay as written
            return e.func(*fixed, *moving, evaluate=False)
        if e.has(Window):  # a window's neighbours are read by its function: left whole
            return e
        return _rebuild(e, rewrite)

    others: list[tuple[str, sympy.Expr]] = []
    for nm, te in temps:
        if shared(te):
            runs.append((nm, te))
        else:
            others.append((nm, rewrite(te)))
            moves.add(nm)
    return runs, others, [rewrite(e) for e in exprs]


def _cheap(e: sympy.Expr) -> bool:
    """A value no cheaper named: a name or number, or one negated (x - m_ln stays a subtraction,
    -v*x a product)."""
    return e.is_Atom or (e.is_Mul and len(e.args) == 2 and e.args[0] == -1 and e.args[1].is_Atom)


def _rebuild(e: sympy.Expr, rewrite: Callable[[sympy.Expr], sympy.Expr]) -> sympy.Expr:
    """``e`` with its arguments rewritten (a function call, a power, a comparison, a selection)."""
    args = [rewrite(a) for a in e.args]
    return e if all(a is b for a, b in zip(args, e.args)) else e.func(*args)


def reciprocals(
    temps: list[tuple[str, sympy.Expr]], exprs: list[sympy.Expr], varying: Iterable[str]
) -> tuple[list[tuple[str, sympy.Expr]], list[sympy.Expr]]:
    """An element value that two terms or more divide by, as one reciprocal per element
    (``Rcp0 = 1/d``, a temporary after those it reads), and each d^-k as Rcp0^k: EvoNorm-B0's
    dx and three of its sums divide by max(v x + ..., sqrt(...)) or its square, four double
    divisions an element where one does (a double division costs about ten multiplications,
    and GCC keeps each, since a reciprocal rounds differently). ``varying``: the element
    values (a temporary varies too). Returns the temporaries and the expressions."""
    moves = set(varying) | {nm for nm, _ in temps}
    count: dict[sympy.Expr, int] = {}
    for e in [*(te for _, te in temps), *exprs]:
        for node in sympy.preorder_traversal(e):
            inverse = node.is_Pow and node.exp.is_Integer and node.exp < 0 and not node.base.has(Window)
            if inverse and {str(s) for s in node.base.free_symbols} & moves:
                count[node.base] = count.get(node.base, 0) + 1
    for k, base in enumerate(b for b, uses in count.items() if uses >= 2):
        r = sympy.Symbol(f"Rcp{k}")

        def sub(e: sympy.Expr, base=base, r=r) -> sympy.Expr:
            return e.replace(
                lambda p: p.is_Pow and p.base == base and p.exp.is_Integer and p.exp < 0, lambda p: r ** (-p.exp)
            )

        deps = {str(s) for s in base.free_symbols}
        at = max((i for i, (nm, _) in enumerate(temps) if nm in deps), default=-1) + 1
        temps = [*temps[:at], (str(r), 1 / base), *((nm, sub(te)) for nm, te in temps[at:])]
        exprs = [sub(e) for e in exprs]
    return temps, exprs
