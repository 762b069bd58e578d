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
value h = f(x, t, p) (its core) is derived in h (:func:`derivgen.derive.core.core_spec`)
with the seeds δh = Σ_v δv·∂f/∂v and ḣ = Σ_v ∂f/∂v·v̇, then chained through h, with f's
second derivatives where f is not linear (:func:`_through_core`).

This module is the entry (:func:`derive_second`) and the core layers' chain rule; the double
backward is :mod:`~derivgen.derive.double_backward`'s, the JVP :mod:`~derivgen.derive.jvp`'s,
both from :mod:`~derivgen.derive.seeds`; the result type, :class:`SecondOrder`, is
:mod:`~derivgen.derive.results`'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy

from derivgen.derive.core import core_spec
from derivgen.derive.double_backward import _Backward, _double_backward
from derivgen.derive.first import derive_mode
from derivgen.derive.jvp import _jvp
from derivgen.derive.results import (
    DerivationError,
    ModeDerivation,
    ParamGrad,
    SecondOrder,
    check_derivatives,
    name_reductions,
)
from derivgen.derive.rewrite import block_facts, fewest_closed_forms, merge_linear
from derivgen.derive.seeds import _Closer, _diff, _named, _Seeds, almost_everywhere
from derivgen.spec.model import X
from derivgen.symbolic.naming import derived

__all__ = ["SecondOrder", "almost_everywhere", "derive_second"]


def _merge(first: ModeDerivation, close: _Closer, exprs: list[sympy.Expr]) -> list[sympy.Expr]:
    """Closed forms of the second order in the fewest run-time means, as the first order's
    (:func:`~derivgen.derive.rewrite.fewest_closed_forms`)."""
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
    y, then means met only linearly with one coefficient merged: :func:`~derivgen.derive.rewrite.merge_linear`)."""
    close = _Closer(first, seeds.element(first.spec))
    bb = _fewest(first, close, _double_backward(first, seeds, close))
    ty, touts = _jvp(first, seeds, close)
    ty, *rest = _merge(first, close, [ty, *touts.values()])
    if first.spec.multi:
        bb = bb.with_exprs(merge_linear(bb.exprs(), close.element))
        ty, *rest = merge_linear([ty, *rest], close.element)
    return _Plain(bb, ty, dict(zip(touts, rest)), close)


def derive_second(first: ModeDerivation) -> SecondOrder:
    """The double backward and the JVP of one mode, as closed forms, from its first order
    (which is read, never changed)."""
    if first.spec.core is not None:
        return _through_core(first)
    if first.mean_facts is None:
        raise ValueError("derive_second needs a ModeDerivation made by derivgen.derive.first.derive_mode")
    seeds = _Seeds.of(first.spec)
    plain = _plain(first, seeds)
    names = seeds.reduction_names(first.spec)
    return _second_order(first, seeds, plain.bb, plain.ty, plain.touts, names, plain.close.element)


def _second_order(
    first: ModeDerivation,
    seeds: _Seeds,
    bb: _Backward,
    ty: sympy.Expr,
    touts: dict[str, sympy.Expr],
    names: dict[sympy.Symbol, str],
    element: frozenset[sympy.Symbol],
    **core,
) -> SecondOrder:
    """The second order of ``first`` from its seeds and closed forms (the double backward's
    ``bb``, the JVP's ``ty`` and ``touts``), their reductions named with ``names``; ``core``:
    a core layer's fields (δh, ḣ and the chain rule through h)."""
    spec = first.spec
    return SecondOrder(
        first=first,
        cot_x=seeds.cot_x,
        cot_params=seeds.cot_params,
        cot_inputs=seeds.cot_inputs,
        dx=bb.dx,
        ddy=bb.ddy,
        grads=bb.grads,
        dinputs=bb.dinputs,
        reductions=name_reductions(spec, first.coordinate, bb.exprs(), names),
        tan_x=seeds.tan_x,
        tan_params=seeds.tan_params,
        tan_inputs=seeds.tan_inputs,
        ty=ty,
        jvp_reductions=name_reductions(spec, first.coordinate, [ty, *touts.values()], names),
        element=element,
        cot_tensors=seeds.cot_tensors,
        dtensors=bb.dtensors,
        ddouts=bb.ddouts,
        tan_tensors=seeds.tan_tensors,
        touts=touts,
        **core,
    )


def _through_core(first: ModeDerivation) -> SecondOrder:
    """The second order of a layer whose statistics read a value h = f(x, t, p): the second
    order of the layer in h (:func:`derivgen.derive.core.core_spec`), seeded with
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
    return _second_order(
        first,
        seeds,
        outs,
        ty,
        touts,
        names,
        element,
        cot_core=cot_core,
        cot_core_expr=cot_core_expr,
        tan_core=tan_core,
        tan_core_expr=tan_core_expr,
        dcore=dcore,
        chain=chain,
        direct=direct,
    )
