"""What the proof compares at one size: the (what, difference, symbols it is linear in) of
each closed form against the brute-force derivative of the explicit layer
(:mod:`derivgen.prove.explicit`) -- dx, the parameters', inputs' and tensor inputs'
gradients (:func:`_first_checks`); the double backward's outputs against the VJP of the
brute-force backward, and the JVP against the directional derivative of the explicit y
(:func:`_second_checks`).
"""

from __future__ import annotations

import sympy

from derivgen.derive.results import ModeDerivation, ParamGrad, SecondOrder
from derivgen.derive.seeds import almost_everywhere
from derivgen.prove.explicit import (
    _Check,
    _diff,
    _elements,
    _Explicit,
    _explicit_loss,
    _explicit_outputs,
    _positions,
    window_sizes,
)
from derivgen.spec.model import DY, Input, Param, Spec, X


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


def _sized(what: str, k: int | None) -> str:
    """A check's name, with the window size it was made at."""
    return what if k is None else f"{what} (window {k})"


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


def _second_checks(second: SecondOrder, n: int) -> list[_Check]:
    """(what, difference, symbols it is linear in) for the double backward and the JVP at
    size n, where |u| is differentiable (:func:`~derivgen.derive.seeds.almost_everywhere`)."""
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
