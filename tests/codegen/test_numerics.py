"""Numerics of the float32 kernels against a float64 reference on the same
float32 inputs. Tolerances (relative to max(1, max|reference|)) are stated per
test; the kernels accumulate and compute in double, so they are tight."""

import numpy as np
import pytest

import derivgen

BACKENDS = ["numpy", "c"]


def _ref(name, x, params, dy, **kw):
    """float64 run of the same backend-independent math: the numpy backend in float64."""
    k = derivgen.load(name, backend="numpy")
    y, c = k.forward(x.astype(np.float64), *[p.astype(np.float64) for p in params], **kw)
    return y, k.backward(dy.astype(np.float64), c)


def _run(backend, name, x, params, dy, **kw):
    k = derivgen.load(name, backend=backend)
    y, c = k.forward(x, *params, **kw)
    return y, k.backward(dy, c)


def _err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))


LAYERS = [
    ("layernorm", (64, 96), (96,), {}),
    ("rmsnorm", (64, 96), (96,), {}),
    ("batchnorm", (16, 8, 24), (8,), {}),
    ("groupnorm", (4, 8, 40), (8,), {"num_groups": 2}),
    ("instancenorm", (4, 8, 40), (8,), {}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", LAYERS, ids=[l[0] for l in LAYERS])
@pytest.mark.parametrize(
    "offset, scale, tol",
    [
        (1e4, 1.0, 1e-6),  # mean offset 1e4, unit std: no catastrophic cancellation
        (0.0, 1e-3, 1e-6),  # tiny scale (eps matters, still accurate)
        (0.0, 1e3, 1e-6),  # large scale
    ],
)
def test_float32_offset_and_scale(backend, layer, offset, scale, tol):
    name, xs, ps, kw = layer
    rng = np.random.default_rng(0)
    x = (offset + scale * rng.normal(size=xs)).astype(np.float32)
    params = [rng.normal(1, 0.2, ps).astype(np.float32)] + (
        [] if name == "rmsnorm" else [rng.normal(size=ps).astype(np.float32)]
    )
    dy = rng.normal(size=xs).astype(np.float32)
    y, g = _run(backend, name, x, params, dy, **kw)
    y64, g64 = _ref(name, x, params, dy, **kw)
    assert _err(y, y64) < tol
    for a, b in zip(g, g64):
        assert _err(a, b) < tol * 10  # gradients: sums of N products, one more rounding each


@pytest.mark.parametrize("backend", BACKENDS)
def test_constant_rows_are_exact(backend):
    """Constant rows: var = 0 exactly (two-pass), y = beta exactly, and with
    dy*gamma constant dx = 0 exactly -- not a spurious 1e-4."""
    k = derivgen.load("layernorm", backend=backend)
    x = np.full((6, 33), 0.1, np.float32) + np.arange(6, dtype=np.float32)[:, None] * 1e3
    beta = np.linspace(-1, 1, 33).astype(np.float32)
    gamma = np.full(33, 1.7, np.float32)
    y, c = k.forward(x, gamma, beta)
    np.testing.assert_array_equal(y, np.broadcast_to(beta, y.shape))
    assert (c.var == 0).all()
    g = k.backward(np.full_like(x, 0.3), c)
    np.testing.assert_array_equal(g.dx, 0.0)
    # general dy on constant rows: dx = rstd*(g - mean(g)) exactly as the reference says
    dy = np.random.default_rng(1).normal(size=x.shape).astype(np.float32)
    g = k.backward(dy, c)
    _, g64 = _ref("layernorm", x, [gamma, beta], dy)
    assert _err(g.dx, g64.dx) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_values_do_not_overflow_the_statistics(backend):
    """|x| ~ 1e30: (x - mean)**2 ~ 1e60 overflows float32 but not the double sums."""
    k = derivgen.load("layernorm", backend=backend)
    rng = np.random.default_rng(2)
    x = (1e30 * rng.normal(size=(4, 16))).astype(np.float32)
    g, b = np.ones(16, np.float32), np.zeros(16, np.float32)
    y, c = k.forward(x, g, b)
    assert np.isfinite(y).all()
    assert np.isfinite(c.stats["var"]).all()  # kept in double: 1e60 is not a float32
    x64 = x.astype(np.float64)
    yref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    assert _err(y, yref) < 1e-6
    gr = k.backward(np.ones_like(x), c)
    assert np.isfinite(gr.dx).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_eps_zero_on_non_constant_rows(backend):
    k = derivgen.load("layernorm", backend=backend)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 20)).astype(np.float32)
    y, _ = k.forward(x, np.ones(20, np.float32), np.zeros(20, np.float32), eps=0.0)
    x64 = x.astype(np.float64)
    yref = (x64 - x64.mean(1, keepdims=True)) / x64.std(1, keepdims=True)
    assert _err(y, yref) < 1e-6
    np.testing.assert_allclose(y.std(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_parameter_gradients_of_long_batches_stay_accurate(threads):
    """batchnorm on (N, C): each dβ is a sum over N = 300000 rows. Float partials
    must be flushed to double every few rows, not summed over the whole batch
    (which drifts by several percent, or stalls at 2**24 for unit dy)."""
    k = derivgen.load("batchnorm", backend="c")
    k.set_num_threads(threads)
    rng = np.random.default_rng(3)
    n = 300_000
    x = rng.normal(size=(n, 2)).astype(np.float32)
    dy = np.empty((n, 2), np.float32)
    dy[:, 0], dy[:, 1] = 1.0, 0.1
    params = [np.ones(2, np.float32), np.zeros(2, np.float32)]
    _, c = k.forward(x, *params)
    g = k.backward(dy, c)
    exact = dy.astype(np.float64).sum(axis=0)
    assert np.abs(g.dbeta - exact).max() / exact.max() < 1e-6, (g.dbeta, exact)
    ref = (dy.astype(np.float64) * (x - x.mean(0, dtype=np.float64)) / x.std(0, dtype=np.float64)).sum(axis=0)
    assert np.abs(g.dgamma - ref).max() / np.abs(dy).sum(0).max() < 1e-6, (g.dgamma, ref)
