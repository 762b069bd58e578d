"""derivgen.jax for layers beyond the catalogue: the examples/ specs, the zoo and a slice of the
spec fuzzer's, against JAX's autodiff of a tree walk of each spec's own expressions
(tests/jax_ref.py), which shares nothing with derivgen's derivation or generated code."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, fuzz_corpus, require_module, spec_file_corpus

jax = require_module("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import jax_ref
import specfuzz

import derivgen.jax as dj
from derivgen.spec import load_spec_file, parse_spec
from derivgen.tools.check import _inputs, cases_for

EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
# the layers with tensor inputs or outputs beside y: tests/zoo/test_zoo_multi.py, which checks this
# target refuses them
ZOO = [p for p in sorted((ROOT / "derivgen" / "spec" / "zoo").glob("*.toml")) if not load_spec_file(p).multi]
# every layout kind, scalar parameters, per-group inputs, buffers with eval modes (0-11); maximum,
# stop_gradient, clip, sigmoid, erf, minimum, a group minimum and a group maximum (12 to 80)
FUZZ_SEEDS = [*range(12), 13, 15, 27, 38, 67, 70, 80]


def _check(spec, rule="jvp"):
    for case in cases_for(spec):
        _check_case(spec, case, rule)


def _check_case(spec, case, rule="jvp"):
    x, _, params, kw, _ = _inputs(spec, case, np.float64, seed=7)
    kw = dict(kw)
    training = kw.pop("training", True)
    num_groups = kw.pop("num_groups", None)
    inputs = {i.name: jnp.asarray(kw.pop(i.name)) for i in spec.inputs}
    bufs = {b.name: jnp.asarray(kw.pop(b.name)) for b in spec.buffers}
    opts = {o.name: kw.get(o.name, o.default) for o in spec.options}  # the reference needs the defaults
    pnames = [p.name for p in spec.params]
    f = dj.function(spec, rule=rule)
    L = dj.make_layout(f.meta, x.shape, {p: np.shape(v) for p, v in zip(pnames, params)}, num_groups, x.dtype)
    args = (jnp.asarray(x), *map(jnp.asarray, params), *inputs.values())
    n_p = len(pnames)

    def ours(*a):
        out = f(
            *a[: 1 + n_p],
            **dict(zip(inputs, a[1 + n_p :])),
            **opts,
            **bufs,
            training=training,
            num_groups=num_groups,
        )
        return out[0] if bufs else out

    def ref(*a):
        p4 = {
            p.name: v.reshape(L.scalar_view if p.scalar else L.param_view) for p, v in zip(spec.params, a[1 : 1 + n_p])
        }
        per_group = {
            k: (v.reshape(L.scalar_view) if v.size == 1 else v.reshape(L.stat_view))
            for k, v in {**dict(zip(inputs, a[1 + n_p :])), **bufs}.items()
        }
        y = jax_ref.spec_forward(
            spec, case.mode, a[0].reshape(L.view), p4, {**opts, **per_group}, L.reduce_axes, L.axes4
        )
        return y.reshape(a[0].shape)

    rng = np.random.default_rng(11)
    t = tuple(jnp.asarray(rng.normal(size=np.shape(a))) for a in args)
    ct = jnp.asarray(rng.normal(size=x.shape))

    def both(*a):  # rule="vjp" is a custom_vjp: reverse mode only
        return [(g(*a), jax.vjp(g, *a)[1](ct), jax.jvp(g, a, t)[1] if rule == "jvp" else ()) for g in (ours, ref)]

    got, want = jax.jit(both)(*args)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-9, atol=1e-10, err_msg=case.mode)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples(path):
    _check(load_spec_file(str(path)))


# make test: the zoo's layers that together have every feature of the zoo (the zoo's own tests
# run every layer on NumPy, C and PyTorch)
@pytest.mark.parametrize("path", spec_file_corpus(ZOO))
def test_zoo(path):
    spec = load_spec_file(str(path))
    _check(spec)


# the layers whose derived VJP the JAX target writes otherwise than the IR (derivgen.codegen.jax.plan):
# block statistics (instance means, the forward's block values handed on), a layer without
# statistics (dx's element factor shared with the parameters' sums), a group maximum's ties
# (one comparison)
VJP_REWRITTEN = ["switchnorm", "evonorm_b0", "dynamic_tanh", "derf", "absmax_scale"]


@pytest.mark.parametrize("name", VJP_REWRITTEN)
def test_zoo_rule_vjp(name):
    _check(load_spec_file(str(ROOT / "derivgen" / "spec" / "zoo" / f"{name}.toml")), rule="vjp")


@pytest.mark.parametrize("seed", fuzz_corpus(FUZZ_SEEDS))
def test_fuzzed_specs(seed):
    _check(parse_spec(specfuzz.generate(seed), source=f"fuzz{seed}.toml"))


def test_the_jvp_does_not_split_an_exponential():
    """tests/regressions/exp_of_a_shifted_square.toml, y = gamma exp(-(alpha x + s)^2), at
    x = 20, alpha = 1, s = -20: the JVP split exp(-u^2) into exp(-alpha^2 x^2) exp(-2 alpha s x)
    times exp(-s^2), 0 * inf there (NaN in float32, where e^800 and e^-400 are out of range);
    the gradients through its transpose are finite and those of the closed form, float32 and
    float64, at u = 0 and u = 1e-3 (float32 within the monomials' cancellation there)."""
    f = dj.function(ROOT / "tests" / "regressions" / "exp_of_a_shifted_square.toml")
    for dt in (jnp.float32, jnp.float64):
        for x0 in (20.0, 20.001):
            x = jnp.full((2, 4), x0, dt)
            gamma, alpha, s = jnp.ones(4, dt), jnp.ones((), dt), jnp.full((), -20.0, dt)
            gx, ga, gs = jax.grad(lambda x, a, s, g: f(x, g, a, s).sum(), argnums=(0, 1, 2))(x, alpha, s, gamma)
            u = np.float64(x[0, 0]) - 20.0
            du = -2 * u * np.exp(-(u**2))  # d/du of exp(-u^2), each element
            # float32: the JVP's monomials -2 alpha x exp(-u^2) - 2 s exp(-u^2) cancel to 1e-4 of
            # their size at u = 1e-3 (float32's rounding of 40 is 4e-6 of 2e-3: 0.2%)
            tol = {"rtol": 5e-3, "atol": 1e-6} if dt == jnp.float32 else {"rtol": 1e-9, "atol": 0}
            np.testing.assert_allclose(np.asarray(gx, np.float64), du, **tol)
            np.testing.assert_allclose(float(gs), 8 * du, **tol)
            np.testing.assert_allclose(float(ga), 8 * du * float(x0), **tol)
