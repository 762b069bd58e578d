"""The second order of the multi-tensor zoo layers (tensor inputs beside x, values before the
statistics, outputs beside y): the double backward (cotangents of dx, of each d<tensor> and of
each parameter gradient; gradients w.r.t. x, every output's cotangent, each tensor with a
gradient and each parameter) and the JVP (tangents of x, the tensors and the parameters; the
tangent of y and of each output beside y), derived in closed form (derivgen.derive.second),
proven against brute force at N = 2, 3, and evaluated numerically (derivgen.tools.evaluate,
no generated code) against torch.autograd's double backward and forward-mode JVP of the
independent references in tests/zoo/multi_reference.py, in float64."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys

import numpy as np
import pytest
import sympy
from conftest import ROOT, require_module

import derivgen
from derivgen.derive.first import G
from derivgen.derive.second import derive_second
from derivgen.prove.proof import _second_checks, prove_second_mode
from derivgen.spec import N, X, parse_spec
from derivgen.symbolic.reduce import Mean
from derivgen.tools.evaluate import evaluate

NAMES = [
    "add_rmsnorm",
    "add_layernorm",
    "rmsnorm_gated",
    "rmsnorm_gated_before",
    "adaln",
    "ada_rmsnorm",
    "conditional_batchnorm",
    "spade",
    "masked_batchnorm",
    "masked_layernorm",
    "flash_layernorm_parallel",
]
CORE = ["add_rmsnorm", "add_layernorm", "rmsnorm_gated_before", "flash_layernorm_parallel"]
EPS = 1e-3  # not any spec's default: the option reaches the statistics
TRAILING = (2, 3, 8)  # (sample, token, feature): one group per row of 8
CHANNELS = (3, 2, 5)  # (N, C, T): one group per channel over (N, T)


@functools.cache
def _second(name: str):
    return derive_second(derivgen.derive(name).train)


# ---- derived and proven


@pytest.mark.parametrize("name", NAMES)
def test_derived_for_every_input_and_output(name):
    so = _second(name)
    spec = so.spec
    grad_tensors = [t.name for t in spec.grad_tensors]
    assert list(so.cot_tensors) == list(so.tan_tensors) == list(so.dtensors) == grad_tensors
    assert list(so.ddouts) == list(so.touts) == [o.name for o in spec.outputs]
    assert set(so.grads) == set(so.cot_params) == set(so.tan_params) == {p.name for p in spec.params}
    # every seed is named, none twice
    names = so.names
    assert len(names) == len({n.symbol for n in names.values()})
    assert (spec.core is not None) == (name in CORE)
    if spec.core is None:
        assert so.cot_core is so.tan_core is so.dcore is None and not so.chain and not so.direct
    else:
        h = spec.core.symbol
        assert so.cot_core.symbol in so.element and so.tan_core.symbol in so.element
        assert (
            set(so.chain)
            == set(so.direct)
            == {"x", *(t.name for t in spec.grad_tensors if spec.core.expr.has(t.symbol))}
        )
        assert so.chain == so.first.chain
        # δh and ḣ are the seeds carried through h = f(x, t)
        for k, d in so.chain.items():
            seed = so.cot_x if k == "x" else so.cot_tensors[k]
            tan = so.tan_x if k == "x" else so.tan_tensors[k]
            assert sympy.expand(sympy.diff(so.cot_core_expr, seed.symbol) - d) == 0
            assert sympy.expand(sympy.diff(so.tan_core_expr, tan.symbol) - d) == 0
        # dx = dcore·∂h/∂x + direct
        assert sympy.expand(so.dx - so.dcore * so.chain["x"] - so.direct["x"]) == 0
        assert h in so.element
    for r in so.reductions + so.jvp_reductions:  # one sweep: no mean inside a mean
        assert not r.arg.has(Mean)


@pytest.mark.parametrize("name", ["add_rmsnorm", "add_layernorm", "flash_layernorm_parallel"])
def test_residual_layers_share_one_double_backward(name):
    """h = x + residual (+ x1): ∂L₂/∂x and ∂L₂/∂residual are one closed form, in δh = δx + δr."""
    so = _second(name)
    assert so.dx == so.dcore
    assert all(so.dtensors[t] == so.dx for t in so.chain if t != "x")
    assert all(v == 0 for v in so.direct.values())
    assert so.cot_core_expr == sympy.Add(so.cot_x.symbol, *(so.cot_tensors[t].symbol for t in so.chain if t != "x"))
    assert so.ddouts["h"] == so.cot_core.symbol  # ∂L₂/∂(∂L/∂h) is δh itself
    assert so.touts["h"] == so.tan_core.symbol


def test_gate_before_the_norm_reads_silu_second_derivative():
    so = _second("rmsnorm_gated_before")
    z = sympy.Symbol("z", real=True)
    assert so.direct["x"].has(so.cot_tensors["z"].symbol) and so.direct["z"].has(so.cot_x.symbol)
    assert len(so.reductions) == 4 and len(so.jvp_reductions) == 1
    assert so.chain["x"].has(z)


def test_gate_after_the_norm_in_four_means():
    """The gate's derivative, expanded into monomials of z and σ(z), is one mean again."""
    so = _second("rmsnorm_gated")
    assert len(so.reductions) == 4 and len(so.jvp_reductions) == 1


@pytest.mark.parametrize("name", NAMES)
def test_proof_checks_every_new_output(name):
    so = _second(name)
    whats = {what.rsplit("_", 1)[0] for what, _, _ in _second_checks(so, 2)}
    want = {"double backward dx", "double backward ddy", "JVP y"}
    want |= {f"double backward dd{o.name}" for o in so.spec.outputs}
    want |= {f"JVP {o.name}" for o in so.spec.outputs}
    want |= {f"double backward d{t.name}" for t in so.spec.grad_tensors}
    want |= {f"double backward d{p.name}" for p in so.spec.params}
    assert want <= whats, want - whats


@pytest.mark.parametrize("name", NAMES)
def test_proven_at_sizes_2_and_3(name):
    proof = prove_second_mode(_second(name), (2, 3))
    assert [r.n for r in proof.results] == [2, 3]
    assert all(r.status == "proven" for r in proof.results), [(r.n, r.status, r.detail) for r in proof.results]


# beyond the zoo: a parameter inside the core value (h = x·w + r, w also in y), and an output
# beside y that reads x̂ and x with a broadcast tensor, in a batch layout
OUTSIDE = {
    "parameter_in_core": """
name = "parameter_in_core"
[layout]
kind = "trailing"
[params]
weight = { init = 1.0 }
bias = { role = "shift", init = 0.0 }
[options]
eps = { default = 1e-6, min = 0 }
[tensors]
residual = {}
[values]
h = "x*weight + residual"
[statistics]
mu = "mean(h)"
var = "mean((h - mu)**2)"
rstd = "1/sqrt(var + eps)"
[normalized]
name = "hhat"
expr = "(h - mu)*rstd"
[output]
y = "weight*hhat + bias"
h = "h"
""",
    "output_reads_xhat_and_x": """
name = "output_reads_xhat_and_x"
[layout]
kind = "channels"
reduce = "batch"
[params]
weight = { init = 1.0 }
bias = { role = "shift", init = 0.0 }
[options]
eps = { default = 1e-5, min = 0 }
[tensors]
t = { shape = "sample" }
[statistics]
mu = "mean(x)"
var = "mean((x - mu)**2)"
rstd = "1/sqrt(var + eps)"
[normalized]
name = "xhat"
expr = "(x - mu)*rstd"
[output]
y = "weight*xhat + bias"
y2 = "exp(xhat)*t + x*t"
""",
    # |h/(1 + prev)|: SymPy cannot tell the quotient is real and leaves d sign/dx unevaluated in
    # the brute force; the residual core's change of variables must leave such a check as it is
    # (fuzzer seed 300093: "Can't calculate derivative wrt h[0] - residual[0]")
    "residual_core_unevaluated_diff": """
name = "residual_core_unevaluated_diff"
[layout]
kind = "trailing"
[params]
weight = { init = 1.0 }
[options]
eps = { default = 1e-2, min = 0 }
[inputs]
prev = {}
[tensors]
residual = {}
[values]
h = "x + residual"
[statistics]
ms = "mean(h**2)"
s = "ms + eps"
[normalized]
name = "hhat"
expr = "h/s"
[output]
y = "weight*hhat + abs(h/(1 + prev))"
""",
}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_layers_outside_the_zoo_are_proven(name):
    spec = parse_spec(OUTSIDE[name], source=f"{name}.toml")
    so = derive_second(derivgen.derive(spec).train)
    if name == "parameter_in_core":  # the parameter is chained through h: δh holds δw·x
        assert so.chain["weight"] == X and so.cot_core_expr.has(so.cot_params["weight"].symbol)
        assert so.tan_core_expr.has(so.tan_params["weight"].symbol)
    proof = prove_second_mode(so, (2,))
    assert proof.status == "proven", [(r.n, r.status, r.detail) for r in proof.results]


@pytest.mark.parametrize(
    "field,key,what",
    [
        ("dtensors", "residual", "double backward dresidual"),
        ("ddouts", "h", "double backward ddh"),
        ("touts", "h", "JVP h"),
    ],
)
def test_proof_catches_a_wrong_new_output(field, key, what):
    so = _second("add_rmsnorm")
    bad = dict(getattr(so, field))
    bad[key] = bad[key] + sympy.Symbol("rstd", positive=True) * so.cot_core.symbol
    proof = prove_second_mode(dataclasses.replace(so, **{field: bad}), (2,))
    assert not proof.ok and what in proof.results[0].detail, proof.results


# ---- numerically against torch.autograd of the independent references


@functools.cache
def _references():
    """tests/zoo/multi_reference.py (the module the zoo tests import by plain name from their
    own folder), loaded once by its path."""
    if "multi_reference" in sys.modules:
        return sys.modules["multi_reference"]
    spec = importlib.util.spec_from_file_location("multi_reference", ROOT / "tests" / "zoo" / "multi_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(name):
    """The reference forward as f(x, tensors, params) -> tuple of outputs (y first, then the
    spec's outputs beside y, in order)."""
    ref = _references()
    t = {
        "add_rmsnorm": lambda x, T, P: ref.add_rmsnorm(x, T["residual"], P["weight"], EPS),
        "add_layernorm": lambda x, T, P: ref.add_layernorm(x, T["residual"], P["weight"], P["bias"], EPS),
        "rmsnorm_gated": lambda x, T, P: ref.rmsnorm_gated(x, T["z"], P["weight"], EPS),
        "rmsnorm_gated_before": lambda x, T, P: ref.rmsnorm_gated(x, T["z"], P["weight"], EPS, norm_before_gate=False),
        "adaln": lambda x, T, P: ref.adaln(x, T["shift"], T["scale"], EPS),
        "ada_rmsnorm": lambda x, T, P: ref.ada_rmsnorm(x, T["shift"], T["scale"], EPS),
        "conditional_batchnorm": lambda x, T, P: ref.conditional_batchnorm(x, T["gamma"], T["beta"], EPS),
        "spade": lambda x, T, P: ref.spade(x, T["gamma"], T["beta"], EPS),
        "masked_batchnorm": lambda x, T, P: ref.masked_batchnorm(x, T["mask"], P["weight"], P["bias"], EPS),
        "masked_layernorm": lambda x, T, P: ref.masked_layernorm(x, T["mask"], P["weight"], P["bias"], EPS),
        "flash_layernorm_parallel": lambda x, T, P: ref.flash_layernorm_parallel(
            x, T["residual"], T["x1"], P["weight"], P["bias"], P["weight1"], P["bias1"], None, EPS
        ),
    }[name]

    def run(x, tensors, params):
        out = t(x, tensors, params)
        return out if isinstance(out, tuple) else (out,)

    return run


class Layout:
    """Where x's groups, parameters and broadcast tensors lie, for one spec and x shape."""

    def __init__(self, spec, shape):
        self.shape = shape
        nd = len(shape)
        if spec.layout == "trailing":
            self.group_axes = tuple(range(nd - spec.axes, nd))
            normalized = shape[nd - spec.axes :]
            self.param_view = (1,) * (nd - spec.axes) + normalized
            self.tensor_views = {"x": shape, "sample": (shape[0],) + (1,) * (nd - 1 - spec.axes) + normalized}
            self.tensor_shapes = {"x": shape, "sample": (shape[0], *normalized)}
        else:
            assert spec.layout == "channels" and spec.reduce == "batch", (spec.layout, spec.reduce)
            self.group_axes = (0, *range(2, nd))
            self.param_view = (1, shape[1]) + (1,) * (nd - 2)
            self.tensor_views = {
                "x": shape,
                "sample": shape[:2] + (1,) * (nd - 2),
                "position": (shape[0], 1, *shape[2:]),
            }
            self.tensor_shapes = {"x": shape, "sample": shape[:2], "position": (shape[0], 1, *shape[2:])}
        self.param_shape = tuple(d for d in self.param_view if d != 1) or (1,)
        self.group_size = int(np.prod([shape[a] for a in self.group_axes]))

    def mean(self, a):
        """A Mean's value: the average over each group, kept broadcastable."""
        full = np.broadcast_to(np.asarray(a, dtype=np.float64), self.shape)
        return np.mean(full, axis=self.group_axes, keepdims=True)

    def full(self, a):
        return np.broadcast_to(np.asarray(a, dtype=np.float64), self.shape)

    def sum_to(self, a, view, shape):
        """An element-level gradient summed over the axes ``view`` is broadcast over, in ``shape``."""
        full = self.full(a)
        axes = tuple(i for i, (v, s) in enumerate(zip(view, full.shape, strict=True)) if v == 1 and s != 1)
        return np.sum(full, axis=axes, keepdims=True).reshape(shape)


def _data(spec, layout, rng):
    """x, the tensor inputs (each in its own shape), the parameters, the cotangents of the
    outputs, and the seeds of both orders: δ and tangent of x, of each tensor with a gradient
    and of each parameter, as float64 arrays."""
    x = rng.standard_normal(layout.shape)
    tensors = {}
    for t in spec.tensors:
        shape = layout.tensor_shapes[t.shape]
        if t.mask:
            m = (rng.random(shape) < 0.5).astype(np.float64)
            view = layout.tensor_views[t.shape]
            m = m.reshape(view)
            m[tuple(0 if a in layout.group_axes else slice(None) for a in range(len(view)))] = 1.0
            assert np.all(layout.mean(m) > 0)
            tensors[t.name] = m.reshape(shape)
        else:
            tensors[t.name] = rng.standard_normal(shape)
    params = {p.name: 1.0 + 0.5 * rng.standard_normal(layout.param_shape) for p in spec.params}
    cot = [rng.standard_normal(layout.shape) for _ in spec.cotangents]

    def seeds():
        return {
            "x": rng.standard_normal(layout.shape),
            **{t.name: rng.standard_normal(tensors[t.name].shape) for t in spec.grad_tensors},
            **{p.name: rng.standard_normal(layout.param_shape) for p in spec.params},
        }

    return x, tensors, params, cot, seeds(), seeds()


def _environment(so, layout, x, tensors, params, cot, delta, tangent):
    """Every symbol the second order's closed forms read, evaluated over the whole tensor."""
    spec, first = so.spec, so.first

    def ev(e):
        return evaluate(e, env, mean=layout.mean)

    env = {X: x, N: float(layout.group_size)}
    for o in spec.options:
        env[o.symbol] = EPS if o.name == "eps" else float(o.default)
    for t in spec.tensors:
        env[t.symbol] = tensors[t.name].reshape(layout.tensor_views[t.shape])
    for p in spec.params:
        env[p.symbol] = params[p.name].reshape(layout.param_view)
    if spec.core is not None:
        env[spec.core.symbol] = ev(spec.core.expr)
    for st in first.statistics:
        env[st.symbol] = ev(st.expr)
    if spec.normalized is not None:
        env[spec.normalized.symbol] = ev(first.normalized_expr)
    if first.coordinate is not None:
        env[first.coordinate.symbol] = ev(first.coordinate_expr)
    for sym, c in zip(spec.cotangents, cot, strict=True):
        env[sym] = c
    if first.g is not None:
        env[G] = ev(first.g)
    env[so.cot_x.symbol], env[so.tan_x.symbol] = delta["x"], tangent["x"]
    for t in spec.grad_tensors:
        view = layout.tensor_views[t.shape]
        env[so.cot_tensors[t.name].symbol] = delta[t.name].reshape(view)
        env[so.tan_tensors[t.name].symbol] = tangent[t.name].reshape(view)
    for p in spec.params:
        env[so.cot_params[p.name].symbol] = delta[p.name].reshape(layout.param_view)
        env[so.tan_params[p.name].symbol] = tangent[p.name].reshape(layout.param_view)
    if so.cot_core is not None:
        env[so.cot_core.symbol] = ev(so.cot_core_expr)
        env[so.tan_core.symbol] = ev(so.tan_core_expr)
    return ev


def _closed_forms(so, layout, x, tensors, params, cot, delta, tangent):
    """The double backward's gradients (w.r.t. x, each cotangent, each tensor with a gradient,
    each parameter) and the JVP's tangents (y, then the outputs beside y), from the closed forms."""
    spec = so.spec
    ev = _environment(so, layout, x, tensors, params, cot, delta, tangent)
    grads = {"x": layout.full(ev(so.dx)), "dy": layout.full(ev(so.ddy))}
    grads.update({"d" + o.name: layout.full(ev(so.ddouts[o.name])) for o in spec.outputs})
    for t in spec.grad_tensors:
        grads[t.name] = layout.sum_to(ev(so.dtensors[t.name]), layout.tensor_views[t.shape], tensors[t.name].shape)
    for p in spec.params:
        grads[p.name] = layout.sum_to(ev(so.grads[p.name].element), layout.param_view, layout.param_shape)
    tangents = [layout.full(ev(so.ty)), *(layout.full(ev(so.touts[o.name])) for o in spec.outputs)]
    return grads, tangents


def _autograd(name, spec, x, tensors, params, cot, delta, tangent):
    """The reference's double backward (torch.autograd.grad with create_graph=True, then the
    gradient of L₂ = Σ δ·first-order gradient) and its JVP (torch.func.jvp)."""
    torch = require_module("torch")
    fwd = _reference(name)
    grad_names = [t.name for t in spec.grad_tensors]
    tx = torch.tensor(x, requires_grad=True)
    tt = {k: torch.tensor(v, requires_grad=k in grad_names) for k, v in tensors.items()}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tc = [torch.tensor(c, requires_grad=True) for c in cot]
    outs = fwd(tx, tt, tp)
    assert len(outs) == len(cot)
    wrt = {"x": tx, **{k: tt[k] for k in grad_names}, **tp}
    first = torch.autograd.grad(outs, list(wrt.values()), tc, create_graph=True)
    l2 = sum((g * torch.tensor(delta[k])).sum() for k, g in zip(wrt, first, strict=True))
    cot_names = ["dy", *("d" + o.name for o in spec.outputs)]
    every = {**wrt, **dict(zip(cot_names, tc, strict=True))}
    second = torch.autograd.grad(l2, list(every.values()), allow_unused=True)
    grads = {
        k: (np.zeros_like(v.detach().numpy()) if g is None else g.detach().numpy())
        for (k, v), g in zip(every.items(), second, strict=True)
    }

    def f(x_, *rest):
        ts = dict(tt)
        ts.update(zip(grad_names, rest[: len(grad_names)]))
        ps = dict(zip(tp, rest[len(grad_names) :]))
        return fwd(x_, {k: v.detach() if k not in grad_names else v for k, v in ts.items()}, ps)

    primals = (tx.detach(), *(tt[k].detach() for k in grad_names), *(tp[k].detach() for k in tp))
    tans = tuple(torch.tensor(tangent[k]) for k in ["x", *grad_names, *tp])
    _, jvp = torch.func.jvp(f, primals, tans)
    return grads, [t.numpy() for t in jvp]


def _rel(got, want):
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-300))


@pytest.mark.parametrize("name", NAMES)
def test_double_backward_and_jvp_match_autograd_of_the_reference(name):
    require_module("torch")
    so = _second(name)
    spec = so.spec
    rng = np.random.default_rng(sum(map(ord, name)) + 2)
    layout = Layout(spec, TRAILING if spec.layout == "trailing" else CHANNELS)
    x, tensors, params, cot, delta, tangent = _data(spec, layout, rng)

    grads, tangents = _closed_forms(so, layout, x, tensors, params, cot, delta, tangent)
    want_grads, want_tangents = _autograd(name, spec, x, tensors, params, cot, delta, tangent)

    assert set(grads) == set(want_grads)
    for k, want in want_grads.items():
        assert grads[k].shape == want.shape, (k, grads[k].shape, want.shape)
        if not np.any(want):
            assert not np.any(grads[k]), k
            continue
        assert _rel(grads[k], want) <= 1e-9, (k, _rel(grads[k], want))
    for i, (got, want) in enumerate(zip(tangents, want_tangents, strict=True)):
        what = "y" if i == 0 else spec.outputs[i - 1].name
        assert got.shape == want.shape, (what, got.shape, want.shape)
        assert _rel(got, want) <= 1e-9, (what, _rel(got, want))
