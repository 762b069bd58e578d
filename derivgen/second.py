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
(:mod:`derivgen.engine`): an element value's adjoint reaches a group value v as
N·mean(adjoint·∂e/∂v); a group value's adjoint reaches the elements of a mean's
argument divided by N. The results are brought to closed forms by the first-order
engine's own rewrites -- linearity of means, the known statistics, x in terms of
x̂ -- so nested means (a mean of an expression holding other means) collapse to
products of means of element monomials: one reduction sweep and one output sweep
per group. No ``sympy.simplify``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
from .engine import G, ModeDerivation, ParamGrad, Reduction, _check_derivatives
from .naming import derived
from .reduce import Mean, hide_means
from .spec import DY, N, X, Named


@dataclass
class SecondOrder:
    """The second-order closed forms of one mode (expressions over Mean atoms, like
    :class:`derivgen.engine.ModeDerivation`'s; ``lowered`` gives them over the reductions)."""
    md: ModeDerivation
    # the double backward: cotangents of the backward's outputs ...
    cot_x: Named                                  # δx: of dx (element)
    cot_params: dict[str, Named]                  # δp: of dp (per channel, or one value for a scalar p)
    cot_inputs: dict[str, Named]                  # δi: of di (per group)
    # ... and the gradients of L₂ = Σ δx·dx + Σ δp·dp + Σ δi·di
    dx: sympy.Expr                                # ∂L₂/∂x (element)
    ddy: sympy.Expr                               # ∂L₂/∂(∂L/∂y) (element)
    grads: dict[str, ParamGrad]                   # ∂L₂/∂p: element part summed like dp, group part per group
    dinputs: dict[str, sympy.Expr]                # ∂L₂/∂i per group
    reductions: list[Reduction]
    # the JVP: tangents of the forward's inputs, and ẏ
    tan_x: Named
    tan_params: dict[str, Named]
    tan_inputs: dict[str, Named]
    ty: sympy.Expr
    jvp_reductions: list[Reduction]
    element: set = field(default_factory=set)     # the element symbols of these closed forms

    @property
    def spec(self):
        return self.md.spec

    def lowered(self, expr: sympy.Expr) -> sympy.Expr:
        return expr.xreplace({r.atom: r.symbol for r in self.reductions})

    def jvp_lowered(self, expr: sympy.Expr) -> sympy.Expr:
        return expr.xreplace({r.atom: r.symbol for r in self.jvp_reductions})

    @property
    def names(self) -> dict[str, Named]:
        """Every symbol this adds, by name (for printers and documents)."""
        out = {self.cot_x.name: self.cot_x, self.tan_x.name: self.tan_x}
        for d in (self.cot_params, self.cot_inputs, self.tan_params, self.tan_inputs):
            out.update({n.name: n for n in d.values()})
        return out


def _named(name: str, latex: str, text: str) -> Named:
    return Named(name, sympy.Symbol(name, real=True), latex, text)


def _cotangent(item) -> Named:
    return _named(derived(item.name, "Dd"), rf"\delta {item.latex}", f"δ{item.text}")


def _tangent(item) -> Named:
    return _named(derived(item.name, "T"), rf"\dot{{{item.latex}}}", f"{item.text}\u0307")


def almost_everywhere(e: sympy.Expr) -> sympy.Expr:
    """The derivative of sign(u) (from |u| in a layer) is zero wherever it is defined (u ≠ 0),
    as the first order's sign(u) is |u|'s derivative wherever that is defined: DiracDelta
    terms, and derivatives of sign that SymPy leaves unevaluated, are dropped."""
    if e.has(sympy.Derivative):
        e = e.replace(lambda a: isinstance(a, sympy.Derivative) and isinstance(a.expr, sympy.sign),
                      lambda a: sympy.S.Zero)
    if e.has(sympy.DiracDelta):
        e = e.replace(lambda a: isinstance(a, sympy.DiracDelta), lambda a: sympy.S.Zero)
    return e


def _d(expr: sympy.Expr, u: sympy.Symbol) -> sympy.Expr:
    return almost_everywhere(sympy.diff(expr, u))


def derive_second(md: ModeDerivation) -> SecondOrder:
    """The double backward and the JVP of one mode, as closed forms."""
    eng = md.engine
    if eng is None:
        raise ValueError("derive_second needs a ModeDerivation made by derivgen.engine.derive_mode")
    spec = md.spec
    cot_x = _named("X_Dd", r"\delta x", "δx")
    tan_x = _named("X_T", r"\dot{x}", "ẋ")
    cot_p = {p.name: _cotangent(p) for p in spec.params}
    cot_i = {i.name: _cotangent(i) for i in spec.inputs}
    tan_p = {p.name: _tangent(p) for p in spec.params}
    tan_i = {i.name: _tangent(i) for i in spec.inputs}
    channel = {p.symbol for p in spec.params if not p.scalar}
    new_elem = {cot_x.symbol, tan_x.symbol} | {cot_p[p.name].symbol for p in spec.params if not p.scalar} \
        | {tan_p[p.name].symbol for p in spec.params if not p.scalar}
    eng.alg.varying |= new_elem
    eng.alg.active |= new_elem
    eng.element |= new_elem
    coord = md.coordinate.symbol if md.coordinate is not None else None
    element = {X, DY, G, *channel, *new_elem} | ({coord} if coord is not None else set())

    extra = {cot_x.symbol: "dx", tan_x.symbol: "tx", **{cot_p[p.name].symbol: "d" + p.name for p in spec.params},
             **{tan_p[p.name].symbol: "t" + p.name for p in spec.params}}

    # ---- the double backward: reverse mode through the backward program -------------
    stats = [st.symbol for st in md.statistics]
    reds = {r.symbol: r for r in md.reductions}
    group_diff = set(stats) | set(reds) | {i.symbol for i in spec.inputs} | {p.symbol for p in spec.params if p.scalar}
    ebar: dict[sympy.Symbol, sympy.Expr] = {}
    gbar: dict[sympy.Symbol, sympy.Expr] = {}

    def through(expr: sympy.Expr, w: sympy.Expr, where: str):
        """An element value ``expr`` whose adjoint is ``w`` (element-level): to its inputs."""
        if w == 0:
            return
        for u in sorted(expr.free_symbols & element, key=sympy.default_sort_key):
            d = _d(expr, u)
            _check_derivatives(spec, where, d)
            if d != 0:
                ebar[u] = ebar.get(u, 0) + w * d
        for a in sorted(expr.free_symbols & group_diff, key=sympy.default_sort_key):
            d = _d(expr, a)
            _check_derivatives(spec, where, d)
            if d != 0:
                gbar[a] = gbar.get(a, 0) + N * Mean(w * d)

    def group_through(expr: sympy.Expr, w: sympy.Expr):
        for a in sorted(expr.free_symbols & group_diff, key=sympy.default_sort_key):
            d = _d(expr, a)
            if d != 0:
                gbar[a] = gbar.get(a, 0) + w * d

    through(md.dx_lowered, cot_x.symbol, "the backward's dx")
    for p in spec.params:
        gr = md.grads[p.name]
        through(md.lowered(gr.element), cot_p[p.name].symbol, f"the backward's d{p.name}")
        group_through(md.lowered(gr.group), cot_p[p.name].symbol)
    for i in spec.inputs:
        group_through(md.lowered(md.dinputs[i.name]), cot_i[i.name].symbol)
    for r in reversed(md.reductions):             # r = mean(arg)
        w = gbar.pop(r.symbol, 0)
        through(r.arg, w / N, f"the backward's {r.name}")
    for sym, definition in (((G, md.g),) if md.g is not None else ()) + \
            (((coord, md.coordinate_expr),) if coord is not None else ()):
        w = ebar.pop(sym, 0)
        element.discard(sym)
        through(definition, w, "the backward's element values")
    prog = eng.program
    for st in reversed(md.statistics):
        w = gbar.pop(st.symbol, 0)
        if w == 0:
            continue
        hidden, table = hide_means(st.expr, prefix=f"{st.name}_Q")
        for v in sorted(hidden.free_symbols & group_diff, key=sympy.default_sort_key):
            d = almost_everywhere(prog.partial(st, v, hidden).xreplace(table))
            _check_derivatives(spec, f"statistics.{st.name}", d)
            if d != 0:
                gbar[v] = gbar.get(v, 0) + w * d
        for r, atom in table.items():
            coef = almost_everywhere(prog.partial(st, r, hidden).xreplace(table))
            if coef != 0:
                through(atom.args[0], w * coef / N, f"statistics.{st.name}")
    element |= {G} | ({coord} if coord is not None else set())

    unlower = {r.symbol: Mean(r.arg) for r in md.reductions}

    def fin(e) -> sympy.Expr:
        return eng.finish(almost_everywhere(sympy.sympify(e).xreplace(unlower)))

    dx2 = fin(ebar.get(X, 0))
    ddy = fin(ebar.get(DY, 0))
    grads = {}
    for p in spec.params:
        if p.scalar:
            grads[p.name] = ParamGrad(sympy.S.Zero, fin(gbar.get(p.symbol, 0)))
        else:
            grads[p.name] = ParamGrad(fin(ebar.get(p.symbol, 0)))
    dinputs = {i.name: fin(gbar.get(i.symbol, 0)) for i in spec.inputs}
    for where, e in [("double backward dx", dx2), ("double backward ddy", ddy),
                     *((f"double backward d{k}", v.element + v.group) for k, v in grads.items()),
                     *((f"double backward d{k}", v) for k, v in dinputs.items())]:
        _check_derivatives(spec, where, e)
    reductions = eng.name_reductions([dx2, ddy, *dinputs.values(), *(g.element for g in grads.values()),
                                      *(g.group for g in grads.values())], extra)

    # ---- the JVP: forward mode through the forward program ---------------------------
    tan: dict[sympy.Symbol, sympy.Expr] = {X: tan_x.symbol}
    for p in spec.params:
        tan[p.symbol] = tan_p[p.name].symbol
    for i in spec.inputs:
        tan[i.symbol] = tan_i[i.name].symbol
    elem_in = {X} | channel

    def tangent(expr: sympy.Expr, where: str) -> sympy.Expr:
        out = sympy.S.Zero
        for u in sorted(expr.free_symbols & set(tan), key=sympy.default_sort_key):
            d = _d(expr, u)
            _check_derivatives(spec, where, d)
            out += d * tan[u]
        return out

    for st in md.statistics:
        hidden, table = hide_means(st.expr, prefix=f"{st.name}_Q")
        ts = sympy.S.Zero
        for v in sorted(hidden.free_symbols & set(tan), key=sympy.default_sort_key):
            if v in elem_in:
                continue
            d = almost_everywhere(prog.partial(st, v, hidden).xreplace(table))
            _check_derivatives(spec, f"statistics.{st.name}", d)
            ts += d * tan[v]
        for r, atom in table.items():
            coef = almost_everywhere(prog.partial(st, r, hidden).xreplace(table))
            if coef != 0:
                ts += coef * Mean(tangent(atom.args[0], f"statistics.{st.name}"))
        tan[st.symbol] = ts
    xh = eng.xhat
    if xh is not None:
        txh = tangent(eng.xhat_def, "normalized")
        ty = _d(eng.y_hat, xh) * txh + tangent(eng.y_hat, "output")
    else:
        ty = tangent(eng.y_full, "output")
    ty = fin(ty)
    _check_derivatives(spec, "JVP", ty)
    jvp_reductions = eng.name_reductions([ty], extra)
    return SecondOrder(md=md, cot_x=cot_x, cot_params=cot_p, cot_inputs=cot_i, dx=dx2, ddy=ddy, grads=grads,
                       dinputs=dinputs, reductions=reductions, tan_x=tan_x, tan_params=tan_p, tan_inputs=tan_i,
                       ty=ty, jvp_reductions=jvp_reductions, element=element)
