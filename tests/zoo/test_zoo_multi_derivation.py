"""The multi-tensor zoo layers (tensor inputs beside x, values before the statistics, outputs
beside y): each derivation's closed forms, evaluated numerically by a small interpreter of
their own (no generated code), against torch.autograd of the independent references in
multi_reference.py, in float64; their run-time reductions, the shared ∂L/∂h of the residual
layers, and the symbolic proof at N = 2..4."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
from conftest import require_module

import derivgen
from derivgen.derive.first import G
from derivgen.prove.proof import prove_mode
from derivgen.spec.model import N, X
from derivgen.tools.evaluate import evaluate

torch = require_module("torch")
import multi_reference as ref

EPS = 1e-3  # not any spec's default: the option reaches the statistics
TRAILING = (3, 5, 8)  # (sample, token, feature): one group per row of 8
CHANNELS = (4, 3, 6)  # (N, C, T): one group per channel over (N, T)


def _reference(name):
    """The reference forward as f(x, tensors, params) -> tuple of outputs (y first, then the
    spec's outputs beside y, in order)."""
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
RESIDUAL = ["add_rmsnorm", "add_layernorm", "flash_layernorm_parallel"]
REDUCTIONS = {
    "add_rmsnorm": "1",
    "add_layernorm": "2",
    "rmsnorm_gated": "1",
    "rmsnorm_gated_before": "1",
    "adaln": "2",
    "ada_rmsnorm": "1",
    "conditional_batchnorm": "2",
    "spade": "2",
    "masked_batchnorm": "2",
    "masked_layernorm": "2",
    "flash_layernorm_parallel": "2",
}


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
        else:
            assert spec.layout == "channels" and spec.reduce == "batch", (spec.layout, spec.reduce)
            self.group_axes = (0, *range(2, nd))
            self.param_view = (1, shape[1]) + (1,) * (nd - 2)
            self.tensor_views = {
                "x": shape,
                "sample": shape[:2] + (1,) * (nd - 2),
                "position": (shape[0], 1, *shape[2:]),
            }
        self.tensor_shapes = {
            "x": shape,
            "sample": (shape[0], *shape[nd - spec.axes :]) if spec.layout == "trailing" else shape[:2],
            "position": (shape[0], 1, *shape[2:]),
        }
        self.param_shape = tuple(d for d in self.param_view if d != 1) or (1,)
        self.group_size = int(np.prod([shape[a] for a in self.group_axes]))

    def mean(self, a):
        """A Mean's value: the average over each group, kept broadcastable."""
        return np.mean(
            np.broadcast_to(np.asarray(a, dtype=np.float64), self.shape), axis=self.group_axes, keepdims=True
        )

    @staticmethod
    def sum_to(a, view, shape):
        """An element-level gradient (broadcast to x's shape) summed over the axes ``view`` is
        broadcast over, then in the tensor's own ``shape``."""
        full = np.asarray(a, dtype=np.float64)
        axes = tuple(i for i, (v, s) in enumerate(zip(view, full.shape, strict=True)) if v == 1 and s != 1)
        return np.sum(full, axis=axes, keepdims=True).reshape(shape)


def _data(spec, layout, rng):
    """x, the tensor inputs (each in its own shape) and the parameters, as float64 arrays."""
    x = rng.standard_normal(layout.shape)
    tensors = {}
    for t in spec.tensors:
        shape = layout.tensor_shapes[t.shape]
        if t.mask:
            view = layout.tensor_views[t.shape]
            m = (rng.random(view) < 0.5).astype(np.float64)
            # at least one 1 in every group: the first element of each group's slice of the mask
            first = tuple(0 if a in layout.group_axes else slice(None) for a in range(len(view)))
            m[first] = 1.0
            assert np.all(layout.mean(m) > 0)
            tensors[t.name] = m.reshape(shape)
        else:
            tensors[t.name] = rng.standard_normal(shape)
    params = {p.name: 1.0 + 0.5 * rng.standard_normal(layout.param_shape) for p in spec.params}
    return x, tensors, params


def _closed_forms(d, layout, x, tensors, params, cotangents):
    """The derivation's forward (y and the outputs beside it) and closed-form gradients,
    evaluated in float64 over the whole tensor with the group mean."""
    spec, m = d.spec, d.train

    def ev(e):
        return evaluate(e, env, mean=layout.mean)

    def full(v):
        return np.broadcast_to(np.asarray(v, dtype=np.float64), layout.shape)

    env = {X: x, N: float(layout.group_size)}
    for o in spec.options:
        env[o.symbol] = EPS if o.name == "eps" else float(o.default)
    for t in spec.tensors:
        env[t.symbol] = tensors[t.name].reshape(layout.tensor_views[t.shape])
    for p in spec.params:
        env[p.symbol] = params[p.name].reshape(layout.param_view)
    if spec.core is not None:
        env[spec.core.symbol] = ev(spec.core.expr)
    for st in m.statistics:  # the program, auxiliaries included, in order
        env[st.symbol] = ev(st.expr)
    if spec.normalized is not None:
        env[spec.normalized.symbol] = ev(m.normalized_expr)
    if m.coordinate is not None:
        env[m.coordinate.symbol] = ev(m.coordinate_expr)
    outs = [full(ev(spec.output)), *(full(ev(o.expr)) for o in spec.outputs)]

    for sym, c in zip(spec.cotangents, cotangents, strict=True):
        env[sym] = c
    if m.g is not None:
        env[G] = ev(m.g)
    grads = {"x": full(ev(m.dx))}
    for t in spec.grad_tensors:
        grads[t.name] = layout.sum_to(full(ev(m.dtensors[t.name])), layout.tensor_views[t.shape], tensors[t.name].shape)
    for p in spec.params:
        grads[p.name] = layout.sum_to(full(ev(m.grads[p.name].element)), layout.param_view, layout.param_shape)
    return outs, grads


def _autograd(name, spec, x, tensors, params, cotangents):
    """The reference's outputs and gradients (x, each tensor with a gradient, each parameter)."""
    tx = torch.tensor(x, requires_grad=True)
    grad_tensors = {t.name for t in spec.grad_tensors}
    tt = {k: torch.tensor(v, requires_grad=k in grad_tensors) for k, v in tensors.items()}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    outs = _reference(name)(tx, tt, tp)
    assert len(outs) == len(cotangents) == 1 + len(spec.outputs)
    wrt = {"x": tx, **{k: tt[k] for k in grad_tensors}, **tp}
    got = torch.autograd.grad(outs, list(wrt.values()), [torch.tensor(c) for c in cotangents])
    return [o.detach().numpy() for o in outs], {k: g.numpy() for k, g in zip(wrt, got, strict=True)}


def _rel(got, want):
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-300))


@pytest.mark.parametrize("name", NAMES)
def test_closed_forms_match_autograd_of_the_reference(name):
    d = derivgen.derive(name)
    spec = d.spec
    rng = np.random.default_rng(sum(map(ord, name)))
    layout = Layout(spec, TRAILING if spec.layout == "trailing" else CHANNELS)
    x, tensors, params = _data(spec, layout, rng)
    cotangents = [rng.standard_normal(layout.shape) for _ in spec.cotangents]

    outs, grads = _closed_forms(d, layout, x, tensors, params, cotangents)
    want_outs, want_grads = _autograd(name, spec, x, tensors, params, cotangents)

    for i, (got, want) in enumerate(zip(outs, want_outs, strict=True)):
        what = "y" if i == 0 else spec.outputs[i - 1].name
        assert got.shape == want.shape, (what, got.shape, want.shape)
        assert _rel(got, want) <= 1e-10, (what, _rel(got, want))
    assert set(grads) == set(want_grads)
    for k, want in want_grads.items():
        assert grads[k].shape == want.shape, (k, grads[k].shape, want.shape)
        assert _rel(grads[k], want) <= 1e-10, (k, _rel(grads[k], want))


@pytest.mark.parametrize("name", NAMES)
def test_run_time_reductions(name):
    assert derivgen.derive(name).train.reduction_summary == REDUCTIONS[name]


@pytest.mark.parametrize("name", RESIDUAL)
def test_residual_layers_share_one_gradient(name):
    """h = x + residual (+ x1): ∂L/∂x and ∂L/∂residual are the same ∂L/∂h, computed once."""
    d = derivgen.derive(name)
    m = d.train
    assert d.spec.core is not None
    assert sympy.simplify(m.dx - m.dtensors["residual"]) == 0
    assert m.dx == m.dtensors["residual"] == m.dcore
    if "x1" in m.dtensors:
        assert m.dtensors["x1"] == m.dx
    assert set(m.chain) == {"x", *(t.name for t in d.spec.grad_tensors)}
    assert all(v == 1 for v in m.chain.values()), m.chain
    assert "shared rather than recomputed" in d.render("text")


@pytest.mark.parametrize("name", NAMES)
def test_proven_at_sizes_2_to_4(name):
    proof = prove_mode(derivgen.derive(name).train, sizes=(2, 3, 4))
    assert [r.n for r in proof.results] == [2, 3, 4]
    assert all(r.status == "proven" for r in proof.results), [(r.n, r.status, r.detail) for r in proof.results]
    assert proof.status == "proven"


def test_the_second_order_derivation_names_every_seed_and_output():
    """derive --order 2 of add+RMSNorm: the residual's seed beside x's, the core's seeds
    (δh = δx + δr, ḣ = ẋ + ṙ) defined once, L₂'s gradient with respect to the gradient
    arriving at h (written ∂L/∂h, not δh: δ is the seeds' there) and to the residual; the
    parallel form's second output gets its tangent. In LaTeX too."""
    import unicodedata

    text = derivgen.derive("add_rmsnorm").render("text", order=2, second_sizes=False)
    second = unicodedata.normalize("NFC", text[text.index("Second order") :])  # ẋ: x and a combining dot
    assert "δx, δr, δw" in second and unicodedata.normalize("NFC", "ẋ, ṙ, ẇ") in second
    assert unicodedata.normalize("NFC", "δh = δx + δr and ḣ = ẋ + ṙ") in second and "∂L₂/∂h, computed once" in second
    assert "∂L₂/∂(∂L/∂h) = δh" in second and "∂L₂/∂r = " in second
    assert unicodedata.normalize("NFC", "ḣ = ḣ") not in second  # h is the core value: its tangent is the prose's ḣ
    flash = derivgen.derive("flash_layernorm_parallel").render("text", order=2, second_sizes=False)
    assert "∂L₂/∂(∂L/∂y1) = " in flash and "y1̇ = " in flash and "δy1·" not in flash[flash.index("Second order") :]
    tex = derivgen.derive("add_rmsnorm").render("latex", order=2, second_sizes=False)
    assert r"\frac{\partial L_2}{\partial (\partial L/\partial \mathrm{h})}" in tex
