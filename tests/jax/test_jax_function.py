"""derivgen.jax.function against JAX's autodiff of independent jax.numpy forwards
(tests/jax_ref.py): every catalogue layer and mode, the JAX transformations, dtypes,
running buffers, and the reductions of the transposed JVP against the derived VJP."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_module
from oracle import CASES, make_inputs

jax = require_module("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import jax_ref

import derivgen
import derivgen.jax as dj

DIFF_INPUTS = ("prev_mean", "prev_std")


def _pair(case, dtype=np.float64, rule="jvp"):
    """(ours, reference, differentiable arguments): two functions of the same arrays
    (x, parameters, per-group inputs) returning y, and those arrays."""
    name = case[0]
    x, params, kw, _ = make_inputs(case, dtype)
    kw = dict(kw)
    f = dj.function(name, rule=rule)
    pnames = list(params)
    inames = [k for k in DIFF_INPUTS if k in kw]
    args = (jnp.asarray(x), *(jnp.asarray(params[p]) for p in pnames), *(jnp.asarray(kw.pop(i)) for i in inames))
    training = kw.pop("training", True)
    bufs = {b: jnp.asarray(kw.pop(b)) for b in ("running_mean", "running_var") if b in kw}
    opts = kw

    def ours(*a):
        out = f(
            a[0], *a[1 : 1 + len(pnames)], **dict(zip(inames, a[1 + len(pnames) :])), **opts, **bufs, training=training
        )
        return out[0] if bufs else out

    def ref(*a):
        x, ps, ins = a[0], dict(zip(pnames, a[1 : 1 + len(pnames)])), dict(zip(inames, a[1 + len(pnames) :]))
        if name == "layernorm":
            return jax_ref.layernorm(x, ps["gamma"], ps["beta"], **opts)
        if name == "rmsnorm":
            return jax_ref.rmsnorm(x, ps["gamma"], **opts)
        if name == "batchnorm":
            return jax_ref.batchnorm(x, ps["gamma"], ps["beta"], training=training, **bufs, **opts)[0]
        if name == "instancenorm":
            return jax_ref.instancenorm(x, ps["gamma"], ps["beta"], **opts)
        if name == "groupnorm":
            return jax_ref.groupnorm(x, ps["gamma"], ps["beta"], **opts)
        return jax_ref.online_layernorm(x, ps["gamma"], ps["beta"], **ins, **opts)

    return ours, ref, args


def _close(a, b, rtol=1e-10, atol=1e-11):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def _tangents(args, seed=1):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=np.shape(a))) for a in args)


IDS = [f"{c[0]}-{'x'.join(map(str, c[1]))}-{k}" for k, c in enumerate(CASES)]
# every layer and mode (batchnorm eval is case 13), half of the shapes: jit compiles are slow
SOME = sorted({*range(0, len(CASES), 2), 13})


@pytest.mark.parametrize("case", [CASES[k] for k in SOME], ids=[IDS[k] for k in SOME])
def test_forward_jvp_vjp_against_autodiff(case):
    """y, the JVP (the derived rule) and the VJP (its transpose) against JAX's autodiff of
    the hand-written forward, along random tangents and cotangents (one jit per case)."""
    ours, ref, args = _pair(case)
    t = _tangents(args)
    ct = jnp.asarray(np.random.default_rng(2).normal(size=args[0].shape))

    def both(*a):
        return [(f(*a), jax.jvp(f, a, t)[1], jax.vjp(f, *a)[1](ct)) for f in (ours, ref)]

    got, want = jax.jit(both)(*args)
    _close(got[0], want[0], rtol=1e-12, atol=1e-12)
    _close(got[1:], want[1:])


@pytest.mark.parametrize("case", CASES[::4], ids=IDS[::4])
def test_derived_vjp_rule_against_autodiff(case):
    """rule="vjp": a custom_vjp over the derived closed-form backward."""
    ours, ref, args = _pair(case, rule="vjp")
    ct = jnp.asarray(np.random.default_rng(3).normal(size=args[0].shape))
    got, want = jax.jit(lambda *a: [jax.vjp(f, *a)[1](ct) for f in (ours, ref)])(*args)
    _close(got, want)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(ours, args, _tangents(args))


TRANSFORM_CASES = [CASES[0], CASES[9], CASES[17], CASES[22]]  # layernorm, batchnorm, groupnorm, online


@pytest.mark.parametrize("case", TRANSFORM_CASES, ids=lambda c: c[0])
def test_transformations(case):
    """grad, jacfwd, jacrev, hessian, forward-over-reverse and vmap (of y and of grad), under
    jit, agree with the reference."""
    ours, ref, args = _pair(case)
    argn = tuple(range(len(args)))
    t = _tangents(args)
    w = jnp.asarray(np.random.default_rng(4).normal(size=args[0].shape))
    xs = jnp.stack([args[0], 2.0 * args[0] + 1.0, -args[0]])  # vmap over a new leading axis of x

    def everything(f):
        def loss(*a):
            return jnp.sum(jnp.sin(f(*a)) * w)

        return (
            jax.grad(loss, argn)(*args),
            jax.jacfwd(f, argn)(*args),
            jax.jacrev(f, argn)(*args),
            jax.hessian(loss, argn)(*args),
            jax.jvp(jax.grad(loss, argn), args, t)[1],
            jax.vmap(lambda x: f(x, *args[1:]))(xs),
            jax.vmap(jax.grad(lambda x: loss(x, *args[1:])))(xs),
        )

    got, want = jax.jit(lambda: (everything(ours), everything(ref)))()
    _close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["layernorm", "batchnorm", "groupnorm"])
def test_low_precision_inputs_use_float32_statistics(name, dtype):
    """y and the gradients keep x's dtype; the statistics are float32 and, like y, close to
    the float64 result (rounding x to the dtype aside)."""
    case = next(c for c in CASES if c[0] == name)
    x64, params, kw, _ = make_inputs(case, np.float64)
    kw = {k: v for k, v in kw.items() if k not in ("running_mean", "running_var")}
    f = dj.function(name)
    x = jnp.asarray(x64).astype(dtype)
    ps = [jnp.asarray(p).astype(dtype) for p in params.values()]

    def run(x, *ps):
        y, stats = f(x, *ps, return_stats=True, **kw)
        g = jax.grad(lambda x: jnp.sum(f(x, *ps, **kw).astype(jnp.float32) ** 2))(x)
        ty = jax.jvp(lambda x: f(x, *ps, **kw), (x,), (jnp.cos(x),))[1]  # not along x: y is nearly scale-invariant
        return y, stats, g, ty

    y, stats, g, ty = jax.jit(run)(x, *ps)
    assert y.dtype == jnp.dtype(dtype)
    assert all(s.dtype == jnp.float32 for s in stats.values())
    y64, stats64, _, ty64 = jax.jit(run)(x.astype(jnp.float64), *[p.astype(jnp.float64) for p in ps])
    tol = 1e-5 if dtype == "float32" else 1e-2
    for k in stats:
        np.testing.assert_allclose(np.asarray(stats[k]), np.asarray(stats64[k]), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(y64), rtol=tol * 2, atol=tol * 4)
    assert g.dtype == jnp.dtype(dtype) and ty.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(ty, np.float64), np.asarray(ty64), rtol=tol * 4, atol=tol * 8)
    assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))


def test_running_buffers_are_taken_and_returned():
    """batchnorm: training returns the buffers updated by the spec's rule (unbiased variance),
    eval normalizes with them; neither differentiates them; the inputs are not changed."""
    case = CASES[9]  # batchnorm (4, 5, 7), momentum 0.3
    x, params, kw, _ = make_inputs(case, np.float64)
    rm, rv = jnp.asarray(kw["running_mean"]), jnp.asarray(kw["running_var"])
    g, b = jnp.asarray(params["gamma"]), jnp.asarray(params["beta"])
    f = dj.function("batchnorm")
    y, new = jax.jit(lambda x, rm, rv: f(x, g, b, running_mean=rm, running_var=rv, momentum=0.3))(x, rm, rv)
    y_ref, (rm_ref, rv_ref) = jax_ref.batchnorm(jnp.asarray(x), g, b, running_mean=rm, running_var=rv, momentum=0.3)
    _close((y, new["running_mean"], new["running_var"]), (y_ref, rm_ref, rv_ref), rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.asarray(rm), kw["running_mean"])  # functional: nothing updated in place
    ye, same = f(x, g, b, running_mean=rm, running_var=rv, training=False)
    _close(ye, jax_ref.batchnorm(jnp.asarray(x), g, b, training=False, running_mean=rm, running_var=rv)[0])
    assert same["running_mean"] is rm
    for training in (True, False):

        def loss(rm, training=training):
            return jnp.sum(f(x, g, b, running_mean=rm, running_var=rv, training=training)[0] ** 2)

        assert not np.any(np.asarray(jax.grad(loss)(rm)))
    y_nobuf = f(x, g, b, momentum=0.3)
    _close(y_nobuf, y_ref, rtol=1e-12, atol=1e-12)


def test_arguments_are_checked():
    f = dj.function("layernorm")
    x, g = jnp.ones((2, 4)), jnp.ones(4)
    with pytest.raises(TypeError, match="parameter beta is required"):
        f(x, g)
    with pytest.raises(TypeError, match="unknown argument"):
        f(x, g, g, epsilon=1e-3)
    with pytest.raises(ValueError, match="eps must lie in"):
        f(x, g, g, eps=-1.0)
    with pytest.raises(ValueError, match="trailing axes"):
        f(x, jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match="axis_name"):
        f(x, g, g, axis_name="batch")
    with pytest.raises(TypeError, match="static"):
        jax.jit(lambda e: f(x, g, g, eps=e))(1e-3)
    with pytest.raises(ValueError, match="at least 2 values per group"):
        dj.function("batchnorm")(jnp.ones((1, 2)), jnp.ones(2), jnp.ones(2))
    with pytest.raises(ValueError, match="training=False"):
        dj.function("batchnorm")(jnp.ones((3, 2)), jnp.ones(2), jnp.ones(2), training=False)


def test_channels_last_is_the_channels_first_layer_transposed():
    """channels_last=True (Flax's order) computes the same layer on (N, *spatial, C)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 6, 3, 4)))
    g, b = jnp.asarray(rng.normal(1, 0.2, 6)), jnp.asarray(rng.normal(0, 0.2, 6))
    xl = jnp.moveaxis(x, 1, -1)
    for name, kw in (("batchnorm", {}), ("instancenorm", {}), ("groupnorm", {"num_groups": 3})):
        f = dj.function(name)

        def run(x, xl, f=f, kw=kw):
            return (
                f(x, g, b, **kw),
                f(xl, g, b, channels_last=True, **kw),
                jax.grad(lambda x: jnp.sum(f(x, g, b, **kw) ** 3))(x),
                jax.grad(lambda x: jnp.sum(f(x, g, b, channels_last=True, **kw) ** 3))(xl),
            )

        y, yl, gf, gl = jax.jit(run)(x, xl)
        _close(yl, jnp.moveaxis(y, 1, -1), rtol=1e-12, atol=1e-12)
        _close(gl, jnp.moveaxis(gf, 1, -1))


# ------------------------------------------------------------------ reductions


def _reduce_sums(jaxpr, size: int) -> tuple[int, int]:
    """(reduce_sum equations over an operand of ``size`` elements (x's: passes over data of
    x's size), all reduce_sum equations that reduce something (not only axes of size 1)) in
    a jaxpr, its sub-jaxprs included."""
    full = some = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_sum":
            n_in, n_out = eqn.invars[0].aval.size, eqn.outvars[0].aval.size
            full += n_in == size and n_out < n_in
            some += n_out < n_in
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else (v,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    f, s = _reduce_sums(getattr(inner, "jaxpr", inner), size)
                    full, some = full + f, some + s
    return full, some


def reduction_counts(name: str, mode: str) -> dict:
    """The reduce_sum operations of reverse mode for one layer and mode: JAX's transpose of the
    derived JVP (the function's linearization, transposed) against the derived VJP (the
    generated closed-form backward, given the forward's statistics)."""
    case = next(c for c in CASES if c[0] == name and c[3].get("training", True) == (mode == "train"))
    ours, _, args = _pair(case)
    _, lin = jax.linearize(ours, *args)
    transposed = jax.make_jaxpr(jax.linear_transpose(lin, *args))(jnp.ones_like(args[0]))
    f = dj.function(name)
    mod, L = f.module, None
    x = args[0]
    ps = {p: a for p, a in zip(mod.META["params"], args[1:])}
    L = dj.make_layout(mod.META, x.shape, {p: a.shape for p, a in ps.items()}, case[3].get("num_groups"), x.dtype)
    kw = {p: a.reshape(L.param_view) for p, a in ps.items()}
    kw.update({i: jnp.zeros(L.stat_view) for i in mod.META["inputs"] + mod.META["buffers"]})
    kw.update({o: 0.5 for o in mod.META["options"]})
    stats = {s: jnp.ones(L.stat_view) for s in mod.META["stats"][mode]}
    x4 = x.reshape(L.view)
    derived = jax.make_jaxpr(lambda dy: mod.BACKWARD[mode](dy, x4, **kw, _stats=stats, _L=L))(x4)
    (t_full, t_all), (d_full, d_all) = _reduce_sums(transposed.jaxpr, x.size), _reduce_sums(derived.jaxpr, x.size)
    return {
        "transposed_jvp": t_full,
        "derived_vjp": d_full,
        "transposed_jvp_all": t_all,
        "derived_vjp_all": d_all,
        "group_reductions": mod.REDUCTIONS[mode],
    }


LAYER_MODES = [(n, m.name) for n in derivgen.names() for m in derivgen.load_spec(n).modes]
# (layer, mode) -> reductions over x-sized data of (JAX's transpose of the derived JVP, the derived VJP).
# The JVP is generated as per-group coefficients times element monomials (issue 41); its transpose
# reads x-sized data fewer times than the factored closed form's did (batch, group and instance
# norm 3, were 4; online layer norm 4, was 6: the sums for its per-group inputs now run over
# values already reduced, counted in the _all figures only).
EXPECTED = {
    ("batchnorm", "train"): (3, 4),
    ("batchnorm", "eval"): (2, 2),
    ("groupnorm", "train"): (3, 4),
    ("instancenorm", "train"): (3, 4),
    ("layernorm", "train"): (4, 4),
    ("online_layernorm", "train"): (4, 4),
    ("rmsnorm", "train"): (2, 2),
}


@pytest.mark.parametrize(("name", "mode"), LAYER_MODES, ids=[f"{n}-{m}" for n, m in LAYER_MODES])
def test_transposed_jvp_needs_no_more_reductions_than_the_derived_vjp(name, mode):
    """Reductions over x-sized data in reverse mode: JAX's transpose of the derived JVP needs
    no more than the derived VJP (the group means and the parameter sums), but one more per per-group input. Transposition may
    split a reduction in two (over S, then over Cg in groupnorm): the second runs over data
    already reduced, and counts in the ``_all`` figures only."""
    counts = reduction_counts(name, mode)
    print(name, mode, counts)
    n_inputs = len(derivgen.load_spec(name).inputs)
    assert counts["transposed_jvp"] <= counts["derived_vjp"] + n_inputs, counts
    assert (counts["transposed_jvp"], counts["derived_vjp"]) == EXPECTED[(name, mode)], counts
    assert len(counts["group_reductions"]["jvp"]) == len(counts["group_reductions"]["vjp"])
