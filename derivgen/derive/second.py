"""Second order, derived: the double backward and the forward-mode JVP of a layer.

The first-order backward is itself a program with group reductions: from x, ∂L/∂y,
the parameters and the per-group inputs it computes the statistics (means of x),
the coordinate x̂ and g (element values), the run-time reductions (means of
element values) and the outputs dx, the parameter-gradient contributions and the
per-group input gradients. Its vector-Jacobian product -- the *double backward*,
what autograd runs when a loss differentiates through a gradient (gradient
penalties, Hessian-vector products) -- is reverse mode through that program with
the cotangents δx (of dx), δp (of each parameter gradient) and δi (of each input
gradient) as seeds:

    L₂ = Σ_i δx_i·dx_i + Σ_p Σ_i δp_i·(dp)_i + Σ_inputs δi·di

and ∂L₂/∂x, ∂L₂/∂(∂L/∂y), ∂L₂/∂p, ∂L₂/∂inputs are the double backward's outputs.
The *JVP* is forward mode through the forward program with the tangents ẋ, ṗ, i̇.

Both run through reductions the same way the first-order engine does
(:mod:`derivgen.derive.first`): an element value's adjoint reaches a group value v as
N·mean(adjoint·∂e/∂v); a group value's adjoint reaches the elements of a mean's
argument divided by N. The results are brought to closed forms by the first-order
engine's own rewrites -- linearity of means, the known statistics, x in terms of
x̂ -- so nested means (a mean of an expression holding other means) collapse to
products of means of element monomials: one reduction sweep and one output sweep
per group. No ``sympy.simplify``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sympy

from derivgen.derive.first import (
    G,
    ModeDerivation,
    ParamGrad,
    Reduction,
    block_facts,
    check_derivatives,
    closed_form,
    fewest_closed_forms,
    name_reductions,
    selection_count,
    selection_tie,
    statistic_partial,
)
from derivgen.spec.model import DY, N, Named, Spec, Statistic, X
from derivgen.symbolic.block import BlockMean, block_mean, hide_blocks, outermost
from derivgen.symbolic.naming import derived
from derivgen.symbolic.reduce import SELECTIONS, Mean, ReductionAlgebra, hide_means
from derivgen.symbolic.window import Window


@dataclass(frozen=True)
class SecondOrder:
    """The second-order closed forms of one mode (expressions over Mean atoms, like
    :class:`derivgen.derive.first.ModeDerivation`'s; ``lowered`` gives them over the reductions)."""

    first: ModeDerivation  # the first order it is derived from
    # the double backward: cotangents of the backward's outputs ...
    cot_x: Named  # δx: of dx (element)
    cot_params: dict[str, Named]  # δp: of dp (per channel, or one value for a scalar p)
    cot_inputs: dict[str, Named]  # δi: of di (per group)
    # ... and the gradients of L₂ = Σ δx·dx + Σ δp·dp + Σ δi·di
    dx: sympy.Expr  # ∂L₂/∂x (element)
    ddy: sympy.Expr  # ∂L₂/∂(∂L/∂y) (element)
    grads: dict[str, ParamGrad]  # ∂L₂/∂p: element part summed like dp, group part per group
    dinputs: dict[str, sympy.Expr]  # ∂L₂/∂i per group
    reductions: tuple[Reduction, ...]
    # the JVP: tangents of the forward's inputs, and ẏ
    tan_x: Named
    tan_params: dict[str, Named]
    tan_inputs: dict[str, Named]
    ty: sympy.Expr
    jvp_reductions: tuple[Reduction, ...]
    element: frozenset[sympy.Symbol] = frozenset()  # the element symbols of these closed forms

    @property
    def spec(self) -> Spec:
        """The layer's spec."""
        return self.first.spec

    def lowered(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace the double backward's Mean atoms by its reduction symbols."""
        return expr.xreplace({r.atom: r.symbol for r in self.reductions})

    def jvp_lowered(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace the JVP's Mean atoms by its reduction symbols."""
        return expr.xreplace({r.atom: r.symbol for r in self.jvp_reductions})

    @property
    def names(self) -> dict[str, Named]:
        """Every symbol this adds, by name (for printers and documents)."""
        out = {self.cot_x.name: self.cot_x, self.tan_x.name: self.tan_x}
        for d in (self.cot_params, self.cot_inputs, self.tan_params, self.tan_inputs):
            out.update({n.name: n for n in d.values()})
        return out


def _named(name: str, latex: str, text: str) -> Named:
    """A new real element or group symbol with its display forms."""
    return Named(name, sympy.Symbol(name, real=True), latex, text)


def _cotangent(item: Named) -> Named:
    """δp: the cotangent of ``item``'s gradient (named ``p_Dd``)."""
    return _named(derived(item.name, "Dd"), rf"\delta {item.latex}", f"δ{item.text}")


def _tangent(item: Named) -> Named:
    """ṗ: the tangent of ``item`` (named ``p_T``)."""
    return _named(derived(item.name, "T"), rf"\dot{{{item.latex}}}", f"{item.text}\u0307")


def almost_everywhere(e: sympy.Expr) -> sympy.Expr:
    """The derivative of sign(u) (from |u| in a layer) is zero wherever it is defined (u ≠ 0),
    as the first order's sign(u) is |u|'s derivative wherever that is defined: DiracDelta
    terms, and derivatives of sign that SymPy leaves unevaluated, are dropped."""
    if e.has(sympy.Derivative):
        e = e.replace(
            lambda a: isinstance(a, sympy.Derivative) and isinstance(a.expr, sympy.sign), lambda a: sympy.S.Zero
        )
    if e.has(sympy.DiracDelta):
        e = e.replace(lambda a: isinstance(a, sympy.DiracDelta), lambda a: sympy.S.Zero)
    return e


def _diff(expr: sympy.Expr, u: sympy.Symbol) -> sympy.Expr:
    """∂expr/∂u almost everywhere (see :func:`almost_everywhere`)."""
    return almost_everywhere(sympy.diff(expr, u))


def _sorted(symbols: Iterable[sympy.Symbol]) -> list[sympy.Symbol]:
    """``symbols`` in SymPy's canonical order (a deterministic derivation)."""
    return sorted(symbols, key=sympy.default_sort_key)


@dataclass(frozen=True)
class _Seeds:
    """The second order's new symbols: cotangents of the backward's outputs (δx, δp, δi)
    and tangents of the forward's inputs (ẋ, ṗ, i̇)."""

    cot_x: Named
    tan_x: Named
    cot_params: dict[str, Named]
    cot_inputs: dict[str, Named]
    tan_params: dict[str, Named]
    tan_inputs: dict[str, Named]

    @classmethod
    def of(cls, spec: Spec) -> _Seeds:
        """The seeds of one layer, named after its parameters and inputs."""
        return cls(
            cot_x=_named("X_Dd", r"\delta x", "δx"),
            tan_x=_named("X_T", r"\dot{x}", "ẋ"),
            cot_params={p.name: _cotangent(p) for p in spec.params},
            cot_inputs={i.name: _cotangent(i) for i in spec.inputs},
            tan_params={p.name: _tangent(p) for p in spec.params},
            tan_inputs={i.name: _tangent(i) for i in spec.inputs},
        )

    def element(self, spec: Spec) -> frozenset[sympy.Symbol]:
        """The seeds that are element values: δx, ẋ and those of per-channel parameters."""
        channel = [p.name for p in spec.params if not p.scalar]
        return frozenset(
            {self.cot_x.symbol, self.tan_x.symbol}
            | {self.cot_params[p].symbol for p in channel}
            | {self.tan_params[p].symbol for p in channel}
        )

    def reduction_names(self, spec: Spec) -> dict[sympy.Symbol, str]:
        """How the reductions' names spell the element seeds (Mean_dx_xhat ...)."""
        return {
            self.cot_x.symbol: "dx",
            self.tan_x.symbol: "tx",
            **{self.cot_params[p.name].symbol: "d" + p.name for p in spec.params},
            **{self.tan_params[p.name].symbol: "t" + p.name for p in spec.params},
        }


class _Closer:
    """Brings second-order expressions to closed form in the first order's coordinate, with a
    working algebra of its own built from the first order's facts."""

    def __init__(self, first: ModeDerivation, seeds: frozenset[sympy.Symbol]) -> None:
        self.alg: ReductionAlgebra = first.mean_facts.algebra(seeds)
        self.x_in_coordinate = first.x_in_coordinate
        self.element = first.element | seeds
        self.unlower = {r.symbol: Mean(r.arg) for r in first.reductions}

    def __call__(self, e: sympy.Expr | int) -> sympy.Expr:
        """A closed form: the first order's reductions as means again, |u|'s second
        derivative dropped where it is defined, reduced and tidied like the first order."""
        return closed_form(
            almost_everywhere(sympy.sympify(e).xreplace(self.unlower)), self.alg, self.x_in_coordinate, self.element
        )


class _ReversePass:
    """Reverse mode through the backward program: the adjoints of its element values
    (``element_adj``) and of its group values (``group_adj``), seeded with the cotangents."""

    def __init__(self, first: ModeDerivation, seeds: frozenset[sympy.Symbol]) -> None:
        spec = self.spec = first.spec
        self.rules = first.self_rules
        channel = {p.symbol for p in spec.params if not p.scalar} | spec.mask_symbols | spec.window_symbols
        coord = first.coordinate.symbol if first.coordinate is not None else None
        self.blocks = first.blocks
        channel |= {b.symbol for b in first.blocks}
        self.element = {X, DY, G, *channel, *seeds} | ({coord} if coord is not None else set())
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


def _double_backward_adjoints(first: ModeDerivation, seeds: _Seeds) -> _ReversePass:
    """Reverse mode through the backward program, outputs first, then its reductions
    (latest first), its element values g and the coordinate, and the statistics."""
    spec = first.spec
    rev = _ReversePass(first, seeds.element(spec))
    rev.through(first.dx_lowered, seeds.cot_x.symbol, "the backward's dx")
    for p in spec.params:
        gr = first.grads[p.name]
        rev.through(first.lowered(gr.element), seeds.cot_params[p.name].symbol, f"the backward's d{p.name}")
        rev.group_through(first.lowered(gr.group), seeds.cot_params[p.name].symbol)
    for i in spec.inputs:
        rev.group_through(first.lowered(first.dinputs[i.name]), seeds.cot_inputs[i.name].symbol)
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


def _double_backward(
    first: ModeDerivation, seeds: _Seeds, close: _Closer
) -> tuple[sympy.Expr, sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr]]:
    """(∂L₂/∂x, ∂L₂/∂(∂L/∂y), ∂L₂/∂p, ∂L₂/∂i) as closed forms."""
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
    for where, e in [
        ("double backward dx", dx),
        ("double backward ddy", ddy),
        *((f"double backward d{k}", v.element + v.group) for k, v in grads.items()),
        *((f"double backward d{k}", v) for k, v in dinputs.items()),
    ]:
        check_derivatives(spec, where, e)
    return dx, ddy, grads, dinputs


class _ForwardPass:
    """Forward mode through the forward program: the tangent of every value from the
    tangents of x, the parameters and the inputs."""

    def __init__(self, first: ModeDerivation, seeds: _Seeds) -> None:
        spec = self.spec = first.spec
        self.rules = first.self_rules
        self.tan: dict[sympy.Symbol, sympy.Expr] = {X: seeds.tan_x.symbol}
        for p in spec.params:
            self.tan[p.symbol] = seeds.tan_params[p.name].symbol
        for i in spec.inputs:
            self.tan[i.symbol] = seeds.tan_inputs[i.name].symbol
        for w in spec.windows:  # Ẇ = Window(e'(x)·ẋ)
            self.tan[w.symbol] = Window(_diff(w.body, X) * seeds.tan_x.symbol, w.size, 1)
        self.elem_in = {X} | {p.symbol for p in spec.params if not p.scalar} | spec.window_symbols
        self.elem_in |= {b.symbol for b in first.blocks}
        self.statistics = first.statistics

    def tangent(self, expr: sympy.Expr, where: str) -> sympy.Expr:
        """Σ ∂expr/∂u·u̇ over the values u with a tangent; a block mean's tangent is the block
        mean of its argument's."""
        out = sympy.S.Zero
        if expr.has(BlockMean):
            expr, back = hide_blocks(expr)
            for z, b in back.items():
                out += _diff(expr, z).xreplace(back) * block_mean(self.tangent(b.body, where), b.kind)
            return out + self.tangent(expr, where).xreplace(back)
        for u in _sorted(expr.free_symbols & set(self.tan)):
            d = _diff(expr, u)
            check_derivatives(self.spec, where, d)
            out += d * self.tan[u]
        return out

    def statistic(self, st: Statistic) -> None:
        """The tangent of one statistic, through its group values and its means; of a group
        maximum (minimum), the mean tangent of the elements that attain it."""
        if isinstance(st.expr, SELECTIONS):
            count = selection_count(self.statistics, st)
            tie = selection_tie(st)
            r = st.expr.args[0]
            self.tan[st.symbol] = (
                sympy.S.Zero if count is None else Mean(tie * self.tangent(r, f"statistics.{st.name}")) / count
            )
            return
        hidden, table = hide_means(st.expr, prefix=f"{st.name}_Q")
        ts = sympy.S.Zero
        for v in _sorted(hidden.free_symbols & set(self.tan)):
            if v in self.elem_in:
                continue
            d = almost_everywhere(statistic_partial(self.rules, st, v, hidden).xreplace(table))
            check_derivatives(self.spec, f"statistics.{st.name}", d)
            ts += d * self.tan[v]
        for r, atom in table.items():
            coef = almost_everywhere(statistic_partial(self.rules, st, r, hidden).xreplace(table))
            if coef != 0:
                ts += coef * Mean(self.tangent(atom.args[0], f"statistics.{st.name}"))
        self.tan[st.symbol] = ts


def _jvp(first: ModeDerivation, seeds: _Seeds, close: _Closer) -> sympy.Expr:
    """ẏ as a closed form: forward mode through the statistics, x̂ and y."""
    fwd = _ForwardPass(first, seeds)
    for st in first.statistics:
        fwd.statistic(st)
    for b in first.blocks:  # ḃ = F'·(what F reads), a block mean's through the block mean
        fwd.tan[b.symbol] = fwd.tangent(b.expr, f"statistics.{b.name}")
    xhat = first.normalized_symbol
    if xhat is not None:
        y = first.output_in_normalized
        txhat = fwd.tangent(first.normalized_expr, "normalized")
        ty = _diff(y, xhat) * txhat + fwd.tangent(y, "output")
    else:
        ty = fwd.tangent(first.output, "output")
    ty = close(ty)
    check_derivatives(first.spec, "JVP", ty)
    return ty


def _merge(first: ModeDerivation, close: _Closer, exprs: list[sympy.Expr]) -> list[sympy.Expr]:
    """Closed forms of the second order in the fewest run-time means, as the first order's
    (:func:`derivgen.derive.first.fewest_closed_forms`)."""
    bfacts = block_facts(first.blocks, close.element, {p.symbol for p in first.spec.params if not p.scalar})
    return fewest_closed_forms(exprs, close.alg, bfacts, first.g, close.element)


def _fewest(
    first: ModeDerivation,
    close: _Closer,
    dx: sympy.Expr,
    ddy: sympy.Expr,
    grads: dict[str, ParamGrad],
    dinputs: dict[str, sympy.Expr],
) -> tuple[sympy.Expr, sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr]]:
    """The double backward's outputs in the fewest run-time means (:func:`_merge`)."""
    names = list(grads)
    k = len(names)
    exprs = _merge(
        first,
        close,
        [dx, ddy, *(grads[n].element for n in names), *(grads[n].group for n in names), *dinputs.values()],
    )
    grads = {n: ParamGrad(e, g) for n, e, g in zip(names, exprs[2 : 2 + k], exprs[2 + k : 2 + 2 * k])}
    return exprs[0], exprs[1], grads, dict(zip(dinputs, exprs[2 + 2 * k :]))


def derive_second(first: ModeDerivation) -> SecondOrder:
    """The double backward and the JVP of one mode, as closed forms, from its first order
    (which is read, never changed)."""
    if first.spec.multi:
        raise NotImplementedError(
            f"{first.spec.source}: the second order of a layer with tensors, values or outputs beside y "
            "is not derived yet (the first order is)"
        )
    if first.mean_facts is None:
        raise ValueError("derive_second needs a ModeDerivation made by derivgen.derive.first.derive_mode")
    spec = first.spec
    seeds = _Seeds.of(spec)
    close = _Closer(first, seeds.element(spec))
    names = seeds.reduction_names(spec)
    dx, ddy, grads, dinputs = _double_backward(first, seeds, close)
    dx, ddy, grads, dinputs = _fewest(first, close, dx, ddy, grads, dinputs)
    reductions = name_reductions(
        spec,
        first.coordinate,
        [dx, ddy, *dinputs.values(), *(g.element for g in grads.values()), *(g.group for g in grads.values())],
        names,
    )
    ty = _jvp(first, seeds, close)
    (ty,) = _merge(first, close, [ty])
    jvp_reductions = name_reductions(spec, first.coordinate, [ty], names)
    return SecondOrder(
        first=first,
        cot_x=seeds.cot_x,
        cot_params=seeds.cot_params,
        cot_inputs=seeds.cot_inputs,
        dx=dx,
        ddy=ddy,
        grads=grads,
        dinputs=dinputs,
        reductions=reductions,
        tan_x=seeds.tan_x,
        tan_params=seeds.tan_params,
        tan_inputs=seeds.tan_inputs,
        ty=ty,
        jvp_reductions=jvp_reductions,
        element=close.element,
    )
