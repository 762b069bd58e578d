"""What the JAX target's planner (derivgen.codegen.jax.plan) writes, read from the jaxprs: the
passes over x-sized data of switchable normalization's reverse mode (block statistics: the
forward's block values handed on, every sum over whole instances taken as instance means
first), the forward's block values handed to the VJP, and the terms of a JVP's tangent
gathered under one per-group tangent. Results are checked elsewhere (test_jax_specs.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import require_module

jax = require_module("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp

import derivgen
import derivgen.jax as dj


def _passes(jaxpr, size: int) -> int:
    """Reductions (reduce_sum, reduce_max, reduce_min) of an operand of ``size`` elements in a
    jaxpr and its sub-jaxprs: the passes over x-sized data that sum or select."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("reduce_sum", "reduce_max", "reduce_min"):
            n += eqn.invars[0].aval.size == size and eqn.outvars[0].aval.size < size
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    n += _passes(getattr(inner, "jaxpr", inner), size)
    return n


def _switchnorm(rule: str):
    spec = derivgen.load_spec("switchnorm")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 3, 5, 6)))
    params = [jnp.asarray(rng.normal(size=() if p.scalar else (3,))) for p in spec.params]
    f = dj.function("switchnorm", rule=rule)
    return f, x, params


@pytest.mark.parametrize("rule", ["jvp", "vjp"])
def test_switchnorm_reverse_mode_reads_x_in_few_passes(rule):
    """Reverse mode of SwitchNorm (y and every gradient): the forward's six block statistics
    (the layer's and the batch's means from the instance means: four passes over x), then the
    backward's per-instance means of dy, dy·(μ_in - x) and dy·(μ - x) -- the transposed JVP
    sums dy and dy·x over each instance --, every other sum over values one per instance. The
    closed forms printed as the engine writes them summed dy-products over whole samples,
    channels and the tensor, and computed the block statistics again in the VJP: 45 passes
    (35 with rule="vjp")."""
    f, x, params = _switchnorm(rule)

    def step(x, params):
        y, pull = jax.vjp(lambda x, p: f(x, *p), x, params)
        return y, pull(jnp.ones_like(y))

    jaxpr = jax.make_jaxpr(step)(x, params)
    assert _passes(jaxpr.jaxpr, x.size) == {"jvp": 6, "vjp": 7}[rule]


def test_switchnorm_forward_hands_its_block_values_to_the_vjp():
    """The generated forward returns the block statistics beside the group statistics, one
    value per block (not broadcast to x's shape), and the VJP given them computes none again."""
    f, x, params = _switchnorm("vjp")
    mod, meta = f.module, f.meta
    names = [p.name for p in derivgen.load_spec("switchnorm").params]
    L = dj.make_layout(meta, x.shape, {n: v.shape for n, v in zip(names, params)}, None, x.dtype)
    kw = {n: v.reshape(L.scalar_view if v.ndim == 0 else L.param_view) for n, v in zip(names, params)}
    x4 = x.reshape(L.view)
    _, stats = mod.FORWARD["train"](x4, **kw, eps=1e-5, _L=L)
    blocks = {"m_in", "v_in", "m_ln", "v_ln", "m_bn", "v_bn", "mu", "var"}
    assert blocks <= set(stats)
    assert all(stats[b].size < x.size for b in blocks)
    backward = jax.make_jaxpr(lambda dy: mod.BACKWARD["train"](dy, x4, **kw, eps=1e-5, _stats=stats, _L=L))(x4)
    assert _passes(backward.jaxpr, x.size) == 3  # instance means of dy, dy·(μ_in - x), dy·(μ - x)


def test_jvp_terms_linear_in_one_tangent_are_gathered():
    """Gemma's RMS norm, y = x̂·(1 + w): the two terms the tangent's group mean ⟨ẋ x̂⟩ multiplies
    (x̂ and x̂·w) are one term of its tangent, so reverse mode by transposition sums over x
    once for it (and once for w's gradient), as the derived VJP does."""
    f = dj.function("gemma_rmsnorm")
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(rng.normal(size=(6, 16))), jnp.asarray(rng.normal(size=16))
    _, lin = jax.linearize(lambda x, w: f(x, w), x, w)
    transposed = jax.make_jaxpr(jax.linear_transpose(lin, x, w))(x)
    assert _passes(transposed.jaxpr, x.size) == 2
    assert "Mean_tx_xhat*KTY_xhat*(xhat + xhat*w)" in Path(f.module.__file__).read_text()
