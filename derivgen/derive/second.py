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

Tensor inputs beside x with a gradient are element variables like per-channel parameters
(seeds δt and ṫ, outputs ∂L₂/∂t); those without (masks) are element constants; the
cotangent of each output beside y is an element input of the backward like ∂L/∂y (output
∂L₂/∂(d<out>)), and the JVP gives each output's tangent. A layer whose statistics read a
value h = f(x, t, p) (its core) is derived in h (:func:`derivgen.derive.first.core_spec`)
with the seeds δh = Σ_v δv·∂f/∂v and ḣ = Σ_v ∂f/∂v·v̇, then chained through h, with f's
second derivatives where f is not linear (:func:`_through_core`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import sympy

from derivgen.derive.first import (
    DerivationError,
    G,
    ModeDerivation,
    ParamGrad,
    Reduction,
    block_facts,
    check_derivatives,
    closed_form,
    core_spec,
    derive_mode,
    fewest_closed_forms,
    name_reductions,
    selection_count,
    selection_tie,
    statistic_partial,
    tidy,
)
from derivgen.spec.model import DY, N, Named, Spec, Statistic, X
from derivgen.symbolic.block import BlockMean, block_mean, hide_blocks, outermost
from derivgen.symbolic.naming import derived
from derivgen.symbolic.reduce import SELECTIONS, Mean, ReductionAlgebra, expand, hide_means
from derivgen.symbolic.window import Window


@dataclass(frozen=True)
class SecondOrder:
    """The second-order closed forms of one mode (expressions over Mean atoms, like
    :class:`derivgen.derive.first.ModeDerivation`'s; ``lowered`` gives them over the reductions).

    With tensor inputs, outputs beside y or a core value, the double backward's cotangents
    are δx, δp, δi and δt (``cot_tensors``) and its gradients dx, ddy, ``ddouts``, grads,
    dinputs and ``dtensors``; the JVP's tangents ẋ, ṗ, i̇ and ṫ (``tan_tensors``) and its
    results ty and ``touts``. A core layer's closed forms read h and the element
    temporaries δh, ḣ (``cot_core``/``tan_core``, defined by ``cot_core_expr``/``tan_core_expr``
    in the seeds); ∂L₂/∂v = ``dcore``·``chain[v]`` + ``direct[v]`` for x and every tensor and
    parameter h is computed from (``dx`` and ``dtensors``/``grads`` hold the sums written out)."""

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
    # tensor inputs with a gradient and outputs beside y (empty for a layer without them)
    cot_tensors: dict[str, Named] = field(default_factory=dict)  # δt: of dt (element), per tensor with a gradient
    dtensors: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂L₂/∂t (element; summed over t's broadcast like dt)
    ddouts: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂L₂/∂(d<out>) (element), per output beside y
    tan_tensors: dict[str, Named] = field(default_factory=dict)  # ṫ (element), per tensor with a gradient
    touts: dict[str, sympy.Expr] = field(default_factory=dict)  # the tangent of each output beside y (element)
    # a layer with a core value h = f(x, t, p) (None / empty otherwise): the closed forms read the
    # element temporaries δh and ḣ, computed from the seeds before anything else
    cot_core: Named | None = None  # δh: the cotangent the backward in h sees
    cot_core_expr: sympy.Expr | None = None  # δh = δx·∂f/∂x + Σ_t δt·∂f/∂t + Σ_p δp·∂f/∂p
    tan_core: Named | None = None  # ḣ
    tan_core_expr: sympy.Expr | None = None  # ḣ = ∂f/∂x·ẋ + Σ_t ∂f/∂t·ṫ + Σ_p ∂f/∂p·ṗ
    dcore: sympy.Expr | None = None  # ∂L₂/∂h at fixed δh (element)
    chain: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂f/∂v for x, each tensor and parameter in h
    direct: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂L₂/∂v - dcore·chain[v], same keys

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
        for d in (
            self.cot_params,
            self.cot_inputs,
            self.tan_params,
            self.tan_inputs,
            self.cot_tensors,
            self.tan_tensors,
        ):
            out.update({n.name: n for n in d.values()})
        for n in (self.cot_core, self.tan_core):
            if n is not None:
                out[n.name] = n
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
    """The second order's new symbols: cotangents of the backward's outputs (δx, δp, δi, δt)
    and tangents of the forward's inputs (ẋ, ṗ, i̇, ṫ)."""

    cot_x: Named
    tan_x: Named
    cot_params: dict[str, Named]
    cot_inputs: dict[str, Named]
    tan_params: dict[str, Named]
    tan_inputs: dict[str, Named]
    cot_tensors: dict[str, Named] = field(default_factory=dict)  # per tensor input with a gradient
    tan_tensors: dict[str, Named] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: Spec) -> _Seeds:
        """The seeds of one layer, named after its parameters, inputs and tensor inputs."""
        return cls(
            cot_x=_named("X_Dd", r"\delta x", "δx"),
            tan_x=_named("X_T", r"\dot{x}", "ẋ"),
            cot_params={p.name: _cotangent(p) for p in spec.params},
            cot_inputs={i.name: _cotangent(i) for i in spec.inputs},
            tan_params={p.name: _tangent(p) for p in spec.params},
            tan_inputs={i.name: _tangent(i) for i in spec.inputs},
            cot_tensors={t.name: _cotangent(t) for t in spec.grad_tensors},
            tan_tensors={t.name: _tangent(t) for t in spec.grad_tensors},
        )

    def element(self, spec: Spec) -> frozenset[sympy.Symbol]:
        """The seeds that are element values: δx, ẋ and those of per-channel parameters and
        of tensor inputs."""
        channel = [p.name for p in spec.params if not p.scalar]
        tensors = [t.name for t in spec.grad_tensors]
        return frozenset(
            {self.cot_x.symbol, self.tan_x.symbol}
            | {self.cot_params[p].symbol for p in channel}
            | {self.tan_params[p].symbol for p in channel}
            | {self.cot_tensors[t].symbol for t in tensors}
            | {self.tan_tensors[t].symbol for t in tensors}
        )

    def reduction_names(self, spec: Spec) -> dict[sympy.Symbol, str]:
        """How the reductions' names spell the element seeds (Mean_dx_xhat ...)."""
        return {
            self.cot_x.symbol: "dx",
            self.tan_x.symbol: "tx",
            **{self.cot_params[p.name].symbol: "d" + p.name for p in spec.params},
            **{self.tan_params[p.name].symbol: "t" + p.name for p in spec.params},
            **{self.cot_tensors[t.name].symbol: "d" + t.name for t in spec.grad_tensors},
            **{self.tan_tensors[t.name].symbol: "t" + t.name for t in spec.grad_tensors},
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
        for t in spec.grad_tensors:
            self.tan[t.symbol] = seeds.tan_tensors[t.name].symbol
        for w in spec.windows:  # Ẇ = Window(e'(x)·ẋ)
            self.tan[w.symbol] = Window(_diff(w.body, X) * seeds.tan_x.symbol, w.size, 1)
        self.elem_in = {X} | {p.symbol for p in spec.params if not p.scalar} | spec.window_symbols
        self.elem_in |= {b.symbol for b in first.blocks} | {t.symbol for t in spec.grad_tensors}
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


def _jvp(first: ModeDerivation, seeds: _Seeds, close: _Closer) -> tuple[sympy.Expr, dict[str, sympy.Expr]]:
    """ẏ and the tangent of each output beside y as closed forms: forward mode through the
    statistics, x̂ and the outputs."""
    fwd = _ForwardPass(first, seeds)
    for st in first.statistics:
        fwd.statistic(st)
    for b in first.blocks:  # ḃ = F'·(what F reads), a block mean's through the block mean
        fwd.tan[b.symbol] = fwd.tangent(b.expr, f"statistics.{b.name}")
    xhat = first.normalized_symbol
    txhat = fwd.tangent(first.normalized_expr, "normalized") if xhat is not None else None

    def tangent(y: sympy.Expr, where: str) -> sympy.Expr:
        if xhat is not None:
            return _diff(y, xhat) * txhat + fwd.tangent(y, where)
        return fwd.tangent(y, where)

    ty = close(tangent(first.output_in_normalized if xhat is not None else first.output, "output"))
    check_derivatives(first.spec, "JVP", ty)
    touts = {}
    for o in first.spec.outputs:  # x̂ is the spec's own symbol there (no implicit coordinate)
        touts[o.name] = close(tangent(o.expr, f"output.{o.name}"))
        check_derivatives(first.spec, f"JVP {o.name}", touts[o.name])
    return ty, touts


def _merge(first: ModeDerivation, close: _Closer, exprs: list[sympy.Expr]) -> list[sympy.Expr]:
    """Closed forms of the second order in the fewest run-time means, as the first order's
    (:func:`derivgen.derive.first.fewest_closed_forms`)."""
    bfacts = block_facts(first.blocks, close.element, {p.symbol for p in first.spec.params if not p.scalar})
    return fewest_closed_forms(exprs, close.alg, bfacts, first.g, close.element)


def _fewest(first: ModeDerivation, close: _Closer, bb: _Backward) -> _Backward:
    """The double backward's outputs in the fewest run-time means (:func:`_merge`)."""
    return bb.with_exprs(_merge(first, close, bb.exprs()))


@dataclass(frozen=True)
class _Plain:
    """The second order of a layer read without a core value: the double backward's closed
    forms, the JVP's, and the algebra that closed them."""

    bb: _Backward
    ty: sympy.Expr
    touts: dict[str, sympy.Expr]
    close: _Closer


def _plain(first: ModeDerivation, seeds: _Seeds) -> _Plain:
    """Reverse mode through the backward program and forward mode through the forward one,
    each brought to the fewest run-time means (for a layer with tensor inputs or outputs beside
    y, then means met only linearly with one coefficient merged: :func:`_merge_linear`)."""
    close = _Closer(first, seeds.element(first.spec))
    bb = _fewest(first, close, _double_backward(first, seeds, close))
    ty, touts = _jvp(first, seeds, close)
    ty, *rest = _merge(first, close, [ty, *touts.values()])
    if first.spec.multi:
        bb = bb.with_exprs(_merge_linear(bb.exprs(), close.element))
        ty, *rest = _merge_linear([ty, *rest], close.element)
    return _Plain(bb, ty, dict(zip(touts, rest)), close)


_MERGE_MAX_ATOMS = 24  # beyond these sizes the linear merge is not attempted (as fewest_closed_forms)
_MERGE_MAX_OPS = 4000


def _merge_linear(exprs: list[sympy.Expr], element: Iterable[sympy.Symbol]) -> list[sympy.Expr]:
    """Group means that every output reads linearly (never times another mean) with the same
    coefficients up to a number, as one mean: Σ_k c_k·⟨u_k⟩·A = ⟨Σ_k c_k·u_k⟩·A. A gate's
    derivative expanded into monomials (⟨x̂·∂L/∂y·w·δz·σ(z)⟩, ⟨x̂·∂L/∂y·w·z·δz·σ(z)⟩, ...)
    becomes the one mean of their sum, which :func:`derivgen.derive.first.fewest_closed_forms`
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


def derive_second(first: ModeDerivation) -> SecondOrder:
    """The double backward and the JVP of one mode, as closed forms, from its first order
    (which is read, never changed)."""
    if first.spec.core is not None:
        return _through_core(first)
    if first.mean_facts is None:
        raise ValueError("derive_second needs a ModeDerivation made by derivgen.derive.first.derive_mode")
    spec = first.spec
    seeds = _Seeds.of(spec)
    names = seeds.reduction_names(spec)
    plain = _plain(first, seeds)
    bb = plain.bb
    reductions = name_reductions(spec, first.coordinate, bb.exprs(), names)
    jvp_reductions = name_reductions(spec, first.coordinate, [plain.ty, *plain.touts.values()], names)
    return SecondOrder(
        first=first,
        cot_x=seeds.cot_x,
        cot_params=seeds.cot_params,
        cot_inputs=seeds.cot_inputs,
        dx=bb.dx,
        ddy=bb.ddy,
        grads=bb.grads,
        dinputs=bb.dinputs,
        reductions=reductions,
        tan_x=seeds.tan_x,
        tan_params=seeds.tan_params,
        tan_inputs=seeds.tan_inputs,
        ty=plain.ty,
        jvp_reductions=jvp_reductions,
        element=plain.close.element,
        cot_tensors=seeds.cot_tensors,
        dtensors=bb.dtensors,
        ddouts=bb.ddouts,
        tan_tensors=seeds.tan_tensors,
        touts=plain.touts,
    )


def _through_core(first: ModeDerivation) -> SecondOrder:
    """The second order of a layer whose statistics read a value h = f(x, t, p): the second
    order of the layer in h (:func:`derivgen.derive.first.core_spec`), seeded with
    δh = Σ_v δv·∂f/∂v and ḣ = Σ_v ∂f/∂v·v̇ (element temporaries), written back in h, then the
    chain rule through h. With D = ∂L₂/∂h at fixed δh and ∂L/∂h the first order's:

        ∂L₂/∂v = D·∂f/∂v + ∂L/∂h·∂δh/∂v (+ v's own paths in the layer in h)

    where ∂δh/∂v = Σ_u δu·∂²f/∂u∂v holds f's second derivatives (silu'' for a gate before
    the norm; none for a residual sum). The cotangents of the outputs, the parameters' and
    the inputs' gradients and the JVP are those of the layer in h as they stand."""
    spec = first.spec
    core = spec.core
    h, f = core.symbol, core.expr
    inner_spec = core_spec(spec)
    inner = derive_mode(inner_spec, first.mode)
    seeds = _Seeds.of(spec)
    cot_core = _named(derived(core.name, "Dd"), rf"\delta {core.latex}", f"δ{core.text}")
    tan_core = _named(derived(core.name, "T"), rf"\dot{{{core.latex}}}", f"{core.text}\u0307")
    inner_seeds = dataclasses.replace(
        seeds,
        cot_x=cot_core,
        tan_x=tan_core,
        cot_tensors={t.name: seeds.cot_tensors[t.name] for t in inner_spec.grad_tensors},
        tan_tensors={t.name: seeds.tan_tensors[t.name] for t in inner_spec.grad_tensors},
    )
    plain = _plain(inner, inner_seeds)
    back = {X: h}

    def w(e: sympy.Expr) -> sympy.Expr:
        return sympy.sympify(e).xreplace(back)

    bb = plain.bb.mapped(w)
    # the variables h is computed from, with their seeds: x, tensors with a gradient, parameters
    where = f"values.{core.name}.expr"
    chain_vars: list[tuple[str, sympy.Symbol, sympy.Symbol, sympy.Symbol]] = [
        ("x", X, seeds.cot_x.symbol, seeds.tan_x.symbol)
    ]
    for t in spec.grad_tensors:
        if f.has(t.symbol):
            chain_vars.append((t.name, t.symbol, seeds.cot_tensors[t.name].symbol, seeds.tan_tensors[t.name].symbol))
    for p in spec.params:
        if f.has(p.symbol):
            if p.scalar:
                raise DerivationError(
                    f"{spec.source}: {where}: a scalar parameter in the core value is not supported yet"
                )
            chain_vars.append((p.name, p.symbol, seeds.cot_params[p.name].symbol, seeds.tan_params[p.name].symbol))
    if any(f.has(i.symbol) for i in spec.inputs):
        raise DerivationError(f"{spec.source}: {where}: a per-group input in the core value is not supported yet")
    chain = {name: _diff(f, sym) for name, sym, _, _ in chain_vars}
    for d in chain.values():
        check_derivatives(spec, where, d)
    cot_core_expr = sympy.Add(*(cot * chain[name] for name, _, cot, _ in chain_vars))
    tan_core_expr = sympy.Add(*(chain[name] * tan for name, _, _, tan in chain_vars))
    dcore = bb.dx  # ∂L₂/∂h with δh held
    own = {**bb.dtensors, **{k: v.element for k, v in bb.grads.items()}}  # the paths in the layer in h
    direct, total = {}, {}
    for name, sym, _, _ in chain_vars:
        dseed = sympy.Add(*(cot * _diff(chain[u], sym) for u, _, cot, _ in chain_vars))  # ∂δh/∂v
        check_derivatives(spec, where, dseed)
        d = (first.dcore * sympy.factor_terms(dseed) if dseed != 0 else sympy.S.Zero) + own.get(name, sympy.S.Zero)
        direct[name] = d
        if dcore == 0 or chain[name] == 0:
            through = sympy.S.Zero
        else:
            through = dcore if chain[name] == 1 else sympy.Mul(dcore, chain[name], evaluate=False)
        total[name] = through + d
    dtensors = {t.name: total.get(t.name, bb.dtensors.get(t.name, sympy.S.Zero)) for t in spec.grad_tensors}
    grads = {k: ParamGrad(total[k], v.group) if k in total else v for k, v in bb.grads.items()}
    outs = _Backward(total["x"], bb.ddy, grads, bb.dinputs, bb.ddouts, dtensors)
    ty, touts = w(plain.ty), {k: w(v) for k, v in plain.touts.items()}
    for what, e in [("double backward dx", outs.dx), *((f"double backward d{k}", v) for k, v in dtensors.items())]:
        check_derivatives(spec, what, e)
    names = {
        **seeds.reduction_names(spec),
        cot_core.symbol: cot_core.name,
        tan_core.symbol: tan_core.name,
    }
    element = frozenset(
        {w(s) for s in plain.close.element} | first.element | seeds.element(spec) | {cot_core.symbol, tan_core.symbol}
    )
    return SecondOrder(
        first=first,
        cot_x=seeds.cot_x,
        cot_params=seeds.cot_params,
        cot_inputs=seeds.cot_inputs,
        dx=outs.dx,
        ddy=outs.ddy,
        grads=outs.grads,
        dinputs=outs.dinputs,
        reductions=name_reductions(spec, first.coordinate, outs.exprs(), names),
        tan_x=seeds.tan_x,
        tan_params=seeds.tan_params,
        tan_inputs=seeds.tan_inputs,
        ty=ty,
        jvp_reductions=name_reductions(spec, first.coordinate, [ty, *touts.values()], names),
        element=element,
        cot_tensors=seeds.cot_tensors,
        dtensors=outs.dtensors,
        ddouts=outs.ddouts,
        tan_tensors=seeds.tan_tensors,
        touts=touts,
        cot_core=cot_core,
        cot_core_expr=cot_core_expr,
        tan_core=tan_core,
        tan_core_expr=tan_core_expr,
        dcore=dcore,
        chain=chain,
        direct=direct,
    )
