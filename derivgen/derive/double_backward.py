"""The double backward (see :mod:`derivgen.derive.second`): reverse mode through the first
order's backward program -- its outputs, its reductions latest first, g and the coordinate,
the output's windows, the block statistics, the statistics -- seeded with the cotangents of
its outputs (:class:`_ThroughBackward`), and the adjoints it leaves brought to closed form
(:func:`_double_backward`, a :class:`_Backward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from derivgen.derive.program import selection_count, selection_tie, statistic_partial
from derivgen.derive.results import G, ModeDerivation, ParamGrad, check_derivatives
from derivgen.derive.rewrite import block_facts
from derivgen.derive.seeds import _Closer, _diff, _Seeds, _sorted, almost_everywhere
from derivgen.spec.model import DY, N, Statistic, X
from derivgen.symbolic.block import BlockMean, block_mean, hide_blocks, outermost
from derivgen.symbolic.reduce import SELECTIONS, Mean, hide_means
from derivgen.symbolic.window import Window


class _ThroughBackward:
    """Reverse mode through the backward program: the adjoints of its element values
    (``element_adj``) and of its group values (``group_adj``), seeded with the cotangents."""

    def __init__(self, first: ModeDerivation, seeds: frozenset[sympy.Symbol]) -> None:
        spec = self.spec = first.spec
        self.rules = first.self_rules
        channel = {p.symbol for p in spec.params if not p.scalar} | spec.mask_symbols | spec.window_symbols
        channel |= spec.tensor_symbols  # tensor inputs: with a gradient, read below; masks: constants
        coord = first.coordinate.symbol if first.coordinate is not None else None
        self.blocks = first.blocks
        channel |= {b.symbol for b in first.blocks}
        self.element = {X, G, *spec.cotangents, *channel, *seeds} | ({coord} if coord is not None else set())
        self.bfacts = block_facts(first.blocks, self.element, {p.symbol for p in spec.params if not p.scalar})
        self.group_diff = (
            {st.symbol for st in first.statistics}
            | {r.symbol for r in first.reductions}
            | {i.symbol for i in spec.inputs}
            | {p.symbol for p in spec.params if p.scalar}
        )
        self.element_adj: dict[sympy.Symbol, sympy.Expr] = {}
        self.group_adj: dict[sympy.Symbol, sympy.Expr] = {}
        self.statistics = first.statistics

    def through(self, expr: sympy.Expr, w: sympy.Expr, where: str) -> None:
        """An element value ``expr`` whose adjoint is ``w`` (element-level): to its inputs --
        element values directly, group values as N·mean(w·∂expr/∂v)."""
        if w == 0:
            return
        back: dict[sympy.Symbol, sympy.Expr] = {}
        if expr.has(BlockMean):  # Σ_i w_i·F(B(u))_i: u's adjoint is the block mean of w·∂F/∂B (its own transpose)
            expr, back = hide_blocks(expr)
            for z, b in back.items():
                inner = self.bfacts.rewrite(block_mean(w * _diff(expr, z).xreplace(back), b.kind))
                self.through(b.body, inner, where)
        if expr.has(Window):  # Σ_i w_i·F(Window(u))_i: u's adjoint is the transposed window of w·∂F/∂Window
            hidden = {win: sympy.Dummy(f"W{k}", real=True) for k, win in enumerate(_outermost_windows(expr))}
            back = {z: win for win, z in hidden.items()}
            expr = expr.xreplace(hidden)
            for win, z in hidden.items():
                self.through(win.body, win.transpose(w * _diff(expr, z).xreplace(back)), where)
        for u in _sorted(expr.free_symbols & self.element):
            d = _diff(expr, u).xreplace(back)
            check_derivatives(self.spec, where, d)
            if d != 0:
                self.element_adj[u] = self.element_adj.get(u, 0) + w * d
        for a in _sorted(expr.free_symbols & self.group_diff):
            d = _diff(expr, a).xreplace(back)
            check_derivatives(self.spec, where, d)
            if d != 0:
                self.group_adj[a] = self.group_adj.get(a, 0) + N * Mean(w * d)

    def group_through(self, expr: sympy.Expr, w: sympy.Expr) -> None:
        """A group value ``expr`` whose adjoint is ``w``: to the group values it is made of."""
        for a in _sorted(expr.free_symbols & self.group_diff):
            d = _diff(expr, a)
            if d != 0:
                self.group_adj[a] = self.group_adj.get(a, 0) + w * d

    def element_definition(self, sym: sympy.Symbol, definition: sympy.Expr) -> None:
        """An element value of the backward (g, the coordinate) to what defines it; from
        then on it is no longer an input of the program."""
        w = self.element_adj.pop(sym, 0)
        self.element.discard(sym)
        self.through(definition, w, "the backward's element values")

    def window_values(self) -> None:
        """The output's windows W = Window(e(x)) to x: ∂L₂/∂x gets e'(x)·Windowᵀ(∂L₂/∂W)."""
        for wv in self.spec.windows:
            w = self.element_adj.pop(wv.symbol, 0)
            self.element.discard(wv.symbol)
            if w != 0:
                self.through(wv.body, wv.expr.transpose(w), "the output's windows")

    def block_values(self) -> None:
        """The block statistics, latest first, to what defines them (x through block means)."""
        for b in reversed(self.blocks):
            w = self.element_adj.pop(b.symbol, 0)
            self.element.discard(b.symbol)
            if w != 0:
                self.through(b.expr, self.bfacts.rewrite(w), f"statistics.{b.name}")

    def statistic(self, st: Statistic) -> None:
        """A statistic to the group values and the means its definition is made of; a group
        maximum (minimum) to the elements that attain it, evenly."""
        w = self.group_adj.pop(st.symbol, 0)
        if w == 0:
            return
        if isinstance(st.expr, SELECTIONS):
            count = selection_count(self.statistics, st)
            if count is not None:  # else y does not depend on it: nothing flows through it
                self.through(st.expr.args[0], w * selection_tie(st) / (N * count), f"statistics.{st.name}")
            return
        hidden, table = hide_means(st.expr, prefix=f"{st.name}_Q")
        for v in _sorted(hidden.free_symbols & self.group_diff):
            d = almost_everywhere(statistic_partial(self.rules, st, v, hidden).xreplace(table))
            check_derivatives(self.spec, f"statistics.{st.name}", d)
            if d != 0:
                self.group_adj[v] = self.group_adj.get(v, 0) + w * d
        for r, atom in table.items():
            coef = almost_everywhere(statistic_partial(self.rules, st, r, hidden).xreplace(table))
            if coef != 0:
                self.through(atom.args[0], w * coef / N, f"statistics.{st.name}")


def _double_backward_adjoints(first: ModeDerivation, seeds: _Seeds) -> _ThroughBackward:
    """Reverse mode through the backward program, outputs first, then its reductions
    (latest first), its element values g and the coordinate, and the statistics."""
    spec = first.spec
    rev = _ThroughBackward(first, seeds.element(spec))
    rev.through(first.dx_lowered, seeds.cot_x.symbol, "the backward's dx")
    for p in spec.params:
        gr = first.grads[p.name]
        rev.through(first.lowered(gr.element), seeds.cot_params[p.name].symbol, f"the backward's d{p.name}")
        rev.group_through(first.lowered(gr.group), seeds.cot_params[p.name].symbol)
    for i in spec.inputs:
        rev.group_through(first.lowered(first.dinputs[i.name]), seeds.cot_inputs[i.name].symbol)
    for t in spec.grad_tensors:
        rev.through(
            first.lowered(first.dtensors[t.name]), seeds.cot_tensors[t.name].symbol, f"the backward's d{t.name}"
        )
    for r in reversed(first.reductions):  # r = mean(arg)
        w = rev.group_adj.pop(r.symbol, 0)
        rev.through(r.arg, w / N, f"the backward's {r.name}")
    if first.g is not None:
        rev.element_definition(G, first.g)
    if first.coordinate is not None:
        rev.element_definition(first.coordinate.symbol, first.coordinate_expr)
    rev.window_values()
    rev.block_values()
    for st in reversed(first.statistics):
        rev.statistic(st)
    return rev


def _outermost_windows(e: sympy.Expr) -> list[Window]:
    """The windows of ``e`` not inside another window, in a fixed order."""
    return outermost(e, Window)


@dataclass(frozen=True)
class _Backward:
    """The double backward's closed forms: ∂L₂/∂x, ∂L₂/∂(∂L/∂y), ∂L₂/∂p, ∂L₂/∂i, and for
    layers with them ∂L₂/∂(d<output>) per output beside y and ∂L₂/∂t per tensor input."""

    dx: sympy.Expr
    ddy: sympy.Expr
    grads: dict[str, ParamGrad]
    dinputs: dict[str, sympy.Expr]
    ddouts: dict[str, sympy.Expr] = field(default_factory=dict)
    dtensors: dict[str, sympy.Expr] = field(default_factory=dict)

    def exprs(self) -> list[sympy.Expr]:
        """Every closed form, in a fixed order (:meth:`with_exprs` reads them back)."""
        names = list(self.grads)
        return [
            self.dx,
            self.ddy,
            *(self.grads[n].element for n in names),
            *(self.grads[n].group for n in names),
            *self.dinputs.values(),
            *self.ddouts.values(),
            *self.dtensors.values(),
        ]

    def with_exprs(self, exprs: list[sympy.Expr]) -> _Backward:
        """The same outputs with the closed forms ``exprs`` (in :meth:`exprs`' order)."""
        names = list(self.grads)
        k, rest = len(names), list(exprs[2:])
        grads = {n: ParamGrad(e, g) for n, e, g in zip(names, rest[:k], rest[k : 2 * k])}
        rest = rest[2 * k :]
        dinputs = dict(zip(self.dinputs, rest[: len(self.dinputs)]))
        rest = rest[len(self.dinputs) :]
        ddouts = dict(zip(self.ddouts, rest[: len(self.ddouts)]))
        dtensors = dict(zip(self.dtensors, rest[len(self.ddouts) :]))
        return _Backward(exprs[0], exprs[1], grads, dinputs, ddouts, dtensors)

    def mapped(self, fn) -> _Backward:
        """Every closed form through ``fn``."""
        return self.with_exprs([fn(e) for e in self.exprs()])


def _double_backward(first: ModeDerivation, seeds: _Seeds, close: _Closer) -> _Backward:
    """(∂L₂/∂x, ∂L₂/∂(∂L/∂y), ∂L₂/∂p, ∂L₂/∂i, ∂L₂/∂(d<output>), ∂L₂/∂t) as closed forms."""
    spec = first.spec
    rev = _double_backward_adjoints(first, seeds)
    element_adj, group_adj = rev.element_adj, rev.group_adj
    dx = close(element_adj.get(X, 0))
    ddy = close(element_adj.get(DY, 0))
    grads = {}
    for p in spec.params:
        if p.scalar:
            grads[p.name] = ParamGrad(sympy.S.Zero, close(group_adj.get(p.symbol, 0)))
        else:
            grads[p.name] = ParamGrad(close(element_adj.get(p.symbol, 0)))
    dinputs = {i.name: close(group_adj.get(i.symbol, 0)) for i in spec.inputs}
    ddouts = {o.name: close(element_adj.get(o.cotangent, 0)) for o in spec.outputs}
    dtensors = {t.name: close(element_adj.get(t.symbol, 0)) for t in spec.grad_tensors}
    for where, e in [
        ("double backward dx", dx),
        ("double backward ddy", ddy),
        *((f"double backward d{k}", v.element + v.group) for k, v in grads.items()),
        *((f"double backward d{k}", v) for k, v in dinputs.items()),
        *((f"double backward dd{k}", v) for k, v in ddouts.items()),
        *((f"double backward d{k}", v) for k, v in dtensors.items()),
    ]:
        check_derivatives(spec, where, e)
    return _Backward(dx, ddy, grads, dinputs, ddouts, dtensors)
