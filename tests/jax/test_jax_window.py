"""``window(e, k)`` in derivgen.jax: the zoo's lrn (channels first and last) and a window over a
trailing layout's features against PyTorch's local_response_norm with autograd: the forward,
reverse mode (JAX's transposition of the derived JVP, and ``rule="vjp"``'s derived backward),
and the second order JAX derives from the custom_jvp rule (grad of a grad in x and in the
cotangent, forward over reverse, the JVP), in float64 and float32."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import LRN_FEATURES, grid, require_module

jax = require_module("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

import derivgen.jax as dj
from derivgen.spec import parse_spec

torch = require_module("torch")

FEATURES = LRN_FEATURES

OPTIONS = {"alpha": 0.3, "beta": 0.75, "k": 1.5}


def _torch_results(x, dy, ddx, tx, size, to_channels_first):
    """(y, dx, the double backward's dx and ddy, the JVP) by autograd of local_response_norm,
    with ``to_channels_first`` moving x's layout to (N, C, *) and back."""

    def ref(z):
        z, back = to_channels_first(z)
        return back(torch.nn.functional.local_response_norm(z, size, **OPTIONS))

    xt, dyt = torch.tensor(x, requires_grad=True), torch.tensor(dy, requires_grad=True)
    yt = ref(xt)
    (gx,) = torch.autograd.grad(yt, xt, dyt, create_graph=True)
    bx, bdy = torch.autograd.grad(gx, (xt, dyt), torch.tensor(ddx))
    _, jt = torch.func.jvp(ref, (torch.tensor(x),), (torch.tensor(tx),))
    return [t.detach().numpy() for t in (yt, gx, bx, bdy, jt)]


def _jax_results(f, x, dy, ddx, tx, kw):
    """The same by JAX: the forward, a VJP, grad of <VJP, ddx> in x and in dy, a JVP."""
    x, dy, ddx, tx = map(jnp.asarray, (x, dy, ddx, tx))

    def g(z):
        return f(z, **kw)

    def vjp(z, c):
        return jax.vjp(g, z)[1](c)[0]

    def pairing(z, c):
        return jnp.sum(vjp(z, c) * ddx)

    y, dx = g(x), vjp(x, dy)
    bx, bdy = jax.grad(pairing, argnums=(0, 1))(x, dy)
    ty = jax.jvp(g, (x,), (tx,))[1]
    return [np.asarray(a) for a in (y, dx, bx, bdy, ty)]


def _compare(f, shape, size, kw, to_channels_first, dtype, rtol, atol, seed=0):
    rng = np.random.default_rng(seed)
    x, dy, ddx, tx = (rng.standard_normal(shape) for _ in range(4))
    want = _torch_results(x, dy, ddx, tx, size, to_channels_first)
    cast = [a.astype(dtype) for a in (x, dy, ddx, tx)]
    got = _jax_results(f, *cast, {"size": size, **OPTIONS, **kw})
    names = ("y", "dx", "double backward dx", "double backward ddy", "jvp")
    for name, u, v in zip(names, got, want, strict=True):
        assert u.dtype == dtype, name
        np.testing.assert_allclose(u, v, rtol=rtol, atol=atol, err_msg=f"{name}, size {size}, shape {shape}")


def _channels_first(z):
    return z, lambda y: y


def _from_last(z):
    return z.movedim(-1, 1), lambda y: y.movedim(1, -1)


def _features(z):
    return z.reshape(-1, z.shape[-1], 1), lambda y: y.reshape(z.shape)


TOL = {np.float64: (1e-10, 1e-12), np.float32: (2e-5, 2e-6)}
DTYPES = [np.float64, np.float32]
IDS = [lambda shape: "x".join(map(str, shape)), str, lambda dtype: {np.float64: "f64", np.float32: "f32"}[dtype]]


# make test: every pair of a shape, a size and a dtype once (conftest.grid); make test-full all
@pytest.mark.parametrize("shape,size,dtype", grid([(2, 7, 3), (2, 4, 3, 2), (1, 1, 5)], [1, 2, 5], DTYPES, names=IDS))
def test_lrn_channels_first(shape, size, dtype):
    _compare(dj.function("lrn"), shape, size, {}, _channels_first, dtype, *TOL[dtype])


@pytest.mark.parametrize("shape,size,dtype", grid([(2, 3, 7), (2, 3, 2, 4)], [2, 5], DTYPES, names=IDS))
def test_lrn_channels_last(shape, size, dtype):
    f = dj.function("lrn")
    _compare(f, shape, size, {"channels_last": True}, _from_last, dtype, *TOL[dtype])


@pytest.mark.parametrize("shape,size,dtype", grid([(3, 1), (3, 4), (2, 3, 7)], [2, 5, 11], DTYPES, names=IDS))
def test_window_over_features(shape, size, dtype):
    f = dj.function(parse_spec(FEATURES, "lrn_features.toml"))
    _compare(f, shape, size, {}, _features, dtype, *TOL[dtype])


@pytest.mark.parametrize("size", [2, 5])
def test_rule_vjp_runs_the_derived_backward(size):
    rng = np.random.default_rng(size)
    x, dy = (rng.standard_normal((2, 6, 3)) for _ in range(2))
    want = _torch_results(x, dy, dy, dy, size, _channels_first)[1]
    f = dj.function("lrn", rule="vjp")
    _, pull = jax.vjp(lambda z: f(z, size=size, **OPTIONS), jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(pull(jnp.asarray(dy))[0]), want, rtol=1e-10, atol=1e-12)


def test_forward_over_reverse_and_jit():
    """jax.jvp of jax.grad (a Hessian-vector product) under jit, against the double backward:
    for a scalar loss L = <y, c>, H·t = the double backward's dx with dy = c and ddx = t."""
    rng = np.random.default_rng(3)
    x, c, t = (rng.standard_normal((2, 6, 3)) for _ in range(3))
    want = _torch_results(x, c, t, t, 3, _channels_first)[2]
    f = dj.function("lrn")

    def loss(z):
        return jnp.sum(f(z, size=3, **OPTIONS) * jnp.asarray(c))

    hvp = jax.jit(lambda z, v: jax.jvp(jax.grad(loss), (z,), (v,))[1])
    np.testing.assert_allclose(np.asarray(hvp(jnp.asarray(x), jnp.asarray(t))), want, rtol=1e-10, atol=1e-12)


def test_a_window_size_must_be_a_whole_number():
    f = dj.function("lrn")
    with pytest.raises(ValueError, match="size must be a whole number"):
        f(jnp.ones((2, 4, 3)), size=2.5)
    with pytest.raises(ValueError, match="size"):
        f(jnp.ones((2, 4, 3)), size=0)
