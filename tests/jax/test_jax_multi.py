"""derivgen.jax for the zoo's layers with tensor inputs beside x and outputs beside y, against
the independent PyTorch references of tests/zoo/multi_reference.py (autograd the reference):
every output and the gradient of a loss over all of them with respect to x, each tensor
input (a broadcast one summed over its broadcast axes by JAX) and each parameter, float64.
Reverse mode through either rule: the derived JVP (the default, ``custom_jvp``, transposed
by JAX) and the derived VJP (``rule="vjp"``); forward mode and the second order (a
Hessian-vector product, forward over reverse) through the derived JVP, against double
backward and forward mode of the PyTorch reference (tests/zoo/test_zoo_multi_second.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import ROOT, require_module

jax = require_module("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

torch = require_module("torch")  # the references are PyTorch forwards

import derivgen
import derivgen.jax as dj

sys.path.insert(0, str(ROOT / "tests" / "zoo"))
from test_zoo_multi import CASES, _draw, _reference


@pytest.mark.parametrize("rule", ["jvp", "vjp"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_multi_tensor_layer_in_jax(name, rule):
    spec = derivgen.load_spec(name)
    args = _draw(name)
    rng = np.random.default_rng(3)
    cots = [rng.standard_normal(CASES[name].x) for _ in range(1 + len(spec.outputs))]
    want_out, want_grad = _reference(name, args, cots)
    f = dj.function(name, rule=rule)
    order = ["x", *(t.name for t in spec.tensors), *(p.name for p in spec.params)]
    differentiable = ["x", *(t.name for t in spec.grad_tensors), *(p.name for p in spec.params)]

    def loss(*diff):
        a = dict(args)
        a.update(zip(differentiable, diff))
        outs = f(*(a[k] for k in order), **CASES[name].options)
        outs = outs if spec.outputs else (outs,)
        return sum(jnp.sum(o * c) for o, c in zip(outs, cots)), outs

    grads, outs = jax.jit(jax.grad(loss, argnums=tuple(range(len(differentiable))), has_aux=True))(
        *(args[k] for k in differentiable)
    )
    for k, (o, w) in enumerate(zip(outs, want_out)):
        assert np.max(np.abs(np.asarray(o) - w)) <= 1e-10 * max(np.max(np.abs(w)), 1e-300), (name, "output", k)
    for k, g in zip(differentiable, grads):
        w = want_grad[k]
        assert np.asarray(g).shape == w.shape, (name, k)
        assert np.max(np.abs(np.asarray(g) - w)) <= 1e-10 * max(np.max(np.abs(w)), 1e-300), (name, "d" + k)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_mode_and_second_order_in_jax(name):
    """jax.jvp through the derived JVP against torch.func.jvp of the reference; the gradient
    of L₂ = Σ δ·(∂L/∂v) (jax.jvp of jax.grad: forward over reverse, both through the derived
    JVP) against double backward of the reference, with respect to x, the tensors with a
    gradient and the parameters (the cotangents' own gradients are test_zoo_multi_second's)."""
    from test_zoo_multi_second import _reference_second, _seeds

    spec, case = derivgen.load_spec(name), CASES[name]
    args, s = _draw(name), _seeds(name)
    want, want_t = _reference_second(name)
    f = dj.function(name)
    order = ["x", *(t.name for t in spec.tensors), *(p.name for p in spec.params)]
    differentiable = ["x", *(t.name for t in spec.grad_tensors), *(p.name for p in spec.params)]

    def outputs(*diff):
        a = dict(args)
        a.update(zip(differentiable, diff))
        o = f(*(a[k] for k in order), **case.options)
        return o if spec.outputs else (o,)

    primal = tuple(jnp.asarray(args[k]) for k in differentiable)
    _, touts = jax.jvp(outputs, primal, tuple(jnp.asarray(s["t"][k]) for k in differentiable))
    for k, (g, w) in enumerate(zip(touts, want_t)):
        assert np.max(np.abs(np.asarray(g) - w)) <= 1e-9 * max(np.max(np.abs(w)), 1e-300), (name, "tangent", k)

    def loss(*diff):
        return sum(jnp.sum(o * c) for o, c in zip(outputs(*diff), s["cots"]))

    grad = jax.grad(loss, argnums=tuple(range(len(differentiable))))
    # ⟨δ, ∂L/∂v⟩'s gradient is the Hessian of L times δ: forward mode of the gradient along δ
    _, hvp = jax.jvp(grad, primal, tuple(jnp.asarray(s["dd"][k]) for k in differentiable))
    for k, g in zip(differentiable, hvp):
        w = want[k]
        assert np.max(np.abs(np.asarray(g) - w)) <= 1e-9 * max(np.max(np.abs(w)), 1e-300), (name, "second", k)


def test_a_wrong_tensor_shape_is_named():
    a = _draw("adaln")
    with pytest.raises(ValueError, match=r"shift must have shape \(3, 8\)"):
        dj.function("adaln", rule="vjp")(a["x"], a["shift"][:2], a["scale"])
