"""derivgen.jax.nnx: the twins of flax.nnx's LayerNorm, RMSNorm, BatchNorm and GroupNorm have
their parameters, defaults and collections, give their outputs, gradients and running
averages, and a model built with them trains as one built with Flax's layers; the generic
Module takes any spec."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_module

jax = require_module("jax")
require_module("flax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
from flax import nnx

import derivgen.jax as dj
import derivgen.jax.nnx as dn

F64 = {"param_dtype": jnp.float64}
TWINS = [
    ("LayerNorm", (12,), {}, (5, 12)),
    ("LayerNorm", (12,), {"epsilon": 1e-3, "use_bias": False}, (2, 3, 12)),
    ("RMSNorm", (12,), {}, (4, 3, 12)),
    ("RMSNorm", (12,), {"use_scale": False}, (4, 12)),
    ("BatchNorm", (6,), {}, (7, 6)),
    ("BatchNorm", (6,), {"momentum": 0.9, "use_scale": False}, (3, 4, 5, 6)),
    ("GroupNorm", (6,), {"num_groups": 3}, (4, 5, 2, 6)),
    ("GroupNorm", (8,), {"num_groups": None, "group_size": 4, "use_bias": False}, (3, 8)),
]


def _pair(cls, args, kw):
    theirs = getattr(nnx, cls)(*args, **kw, **F64, rngs=nnx.Rngs(0))
    ours = getattr(dn, cls)(*args, **kw, **F64, rngs=nnx.Rngs(0))
    return theirs, ours


def _perturb(m, seed):
    """Parameters away from their initial ones (ones, zeros), the same for twins."""
    rng = np.random.default_rng(seed)
    for name in ("scale", "bias"):
        v = getattr(m, name, None)
        if v is not None:
            v[...] = v[...] + jnp.asarray(rng.normal(0, 0.3, v[...].shape))


@pytest.mark.parametrize(("cls", "args", "kw", "xshape"), TWINS, ids=[f"{t[0]}-{k}" for k, t in enumerate(TWINS)])
def test_twin_matches_flax(cls, args, kw, xshape):
    theirs, ours = _pair(cls, args, kw)
    assert isinstance(ours, getattr(nnx, cls))
    st, so = nnx.state(theirs), nnx.state(ours)
    assert jax.tree.structure(st) == jax.tree.structure(so)
    for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(so), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
    assert {k: type(v).__name__ for k, v in nnx.to_flat_state(st)} == {
        k: type(v).__name__ for k, v in nnx.to_flat_state(so)
    }
    _perturb(theirs, 1)
    _perturb(ours, 1)
    x = jnp.asarray(np.random.default_rng(2).normal(0.3, 1.4, xshape))
    w = jnp.asarray(np.random.default_rng(3).normal(size=xshape))

    @nnx.jit
    def step(m, x):
        def loss(m, x):
            return jnp.sum(jnp.sin(m(x)) * w)

        (val, grads) = nnx.value_and_grad(loss, argnums=(0, 1))(m, x)
        return val, grads, m(x)

    for m in (theirs, ours):  # both in train mode
        m.train()
    (lt, gt, yt), (lo, go, yo) = step(theirs, x), step(ours, x)
    np.testing.assert_allclose(lo, lt, rtol=1e-10)
    np.testing.assert_allclose(yo, yt, rtol=1e-9, atol=1e-10)
    for a, b in zip(jax.tree.leaves(go), jax.tree.leaves(gt), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    for a, b in zip(jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(theirs)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)  # the running averages too
    if cls == "BatchNorm":
        theirs.eval()
        ours.eval()
        np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-9, atol=1e-10)


class _Net(nnx.Module):
    """Linear, LayerNorm, Linear, BatchNorm, RMSNorm, GroupNorm, Linear."""

    def __init__(self, norms, rngs):
        self.l1 = nnx.Linear(6, 12, param_dtype=jnp.float64, rngs=rngs)
        self.ln = norms.LayerNorm(12, **F64, rngs=rngs)
        self.l2 = nnx.Linear(12, 12, param_dtype=jnp.float64, rngs=rngs)
        self.bn = norms.BatchNorm(12, momentum=0.9, **F64, rngs=rngs)
        self.rms = norms.RMSNorm(12, **F64, rngs=rngs)
        self.gn = norms.GroupNorm(12, num_groups=3, **F64, rngs=rngs)
        self.l3 = nnx.Linear(12, 1, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.ln(self.l1(x)))
        h = jax.nn.gelu(self.bn(self.l2(h)))
        return self.l3(self.gn(self.rms(h)))


def test_model_trains_as_with_flax_layers():
    """20 steps of plain SGD in float64: the same losses, parameters and running averages."""
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(20, 16, 6)))
    ys = jnp.sin(xs.sum(-1, keepdims=True))

    @nnx.jit
    def step(model, x, y):
        def loss(model):
            return jnp.mean((model(x) - y) ** 2)

        val, grads = nnx.value_and_grad(loss)(model)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads))
        return val

    results = []
    for norms in (nnx, dn):
        model = _Net(norms, nnx.Rngs(0))
        losses = [float(step(model, x, y)) for x, y in zip(xs, ys)]
        results.append((losses, nnx.state(model)))
    (lt, st), (lo, so) = results
    assert lt[-1] < 0.6 * lt[0]  # it trains
    np.testing.assert_allclose(lo, lt, rtol=1e-9)
    for a, b in zip(jax.tree.leaves(so), jax.tree.leaves(st), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


def test_generic_module_for_a_spec():
    """Module(spec): parameters and buffers named by the spec; it computes derivgen.jax.function."""
    m = dn.Module("batchnorm", 3, momentum=0.2, rngs=nnx.Rngs(0))
    flat = {k: type(v).__name__ for k, v in nnx.to_flat_state(nnx.state(m))}
    assert flat == {
        ("beta",): "Param",
        ("gamma",): "Param",
        ("running_mean",): "BatchStat",
        ("running_var",): "BatchStat",
    }
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3, 5)))
    f = dj.function("batchnorm")
    y_ref, bufs = f(x, jnp.ones(3), jnp.zeros(3), running_mean=jnp.zeros(3), running_var=jnp.ones(3), momentum=0.2)
    np.testing.assert_allclose(m(x), y_ref, rtol=1e-12)
    np.testing.assert_allclose(m.running_var[...], bufs["running_var"], rtol=1e-6)
    m.eval()
    y_eval = f(
        x, jnp.ones(3), jnp.zeros(3), running_mean=m.running_mean[...], running_var=m.running_var[...], training=False
    )[0]
    np.testing.assert_allclose(m(x), y_eval, rtol=1e-12)
    ln = dn.Module("online_layernorm", 5, alpha=0.5, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5)))
    got = ln(x, prev_mean=jnp.zeros(3), prev_std=jnp.ones(3))
    want = dj.function("online_layernorm")(
        x, jnp.ones(5), jnp.zeros(5), alpha=0.5, prev_mean=jnp.zeros(3), prev_std=jnp.ones(3)
    )
    np.testing.assert_allclose(got, want, rtol=1e-12)
