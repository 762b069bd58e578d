"""Bad input to the generated functions: a clear ValueError/TypeError naming
the argument, never a crash and never a silently wrong answer."""

import numpy as np
import pytest

import derivgen

BACKENDS = ["numpy", "c"]
F = np.float64


def ln(backend):
    return derivgen.load("layernorm", backend=backend)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _ln_args(shape=(4, 6), dtype=F):
    rng = np.random.default_rng(0)
    return rng.normal(size=shape).astype(dtype), np.ones(shape[-1], dtype), np.zeros(shape[-1], dtype)


@pytest.mark.parametrize(
    "mutate, exc, needle",
    [
        (lambda x, g, b: (x, np.ones(5), b), ValueError, "gamma has shape (5,)"),
        (lambda x, g, b: (x, g, np.zeros((2, 6))), ValueError, "beta must have shape (6,)"),
        (lambda x, g, b: (x.astype(np.int64), g, b), TypeError, "x must have dtype float32 or float64"),
        (lambda x, g, b: (x.astype(np.float16), g, b), TypeError, "float16"),
        (lambda x, g, b: (x.astype(np.complex128), g, b), TypeError, "complex128"),
        (lambda x, g, b: (x.astype(object), g, b), TypeError, "object"),
        (lambda x, g, b: (x, g.astype(np.float32), b), TypeError, "gamma has dtype float32 but x has float64"),
        (lambda x, g, b: (x.tolist(), g, b), TypeError, "x must be a numpy.ndarray"),
        (lambda x, g, b: (x, np.array(1.0), b), ValueError, "at least one dimension"),
    ],
)
def test_layernorm_forward_rejects(backend, mutate, exc, needle):
    x, g, b = mutate(*_ln_args())
    with pytest.raises(exc) as info:
        ln(backend).forward(x, g, b)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "eps, exc, needle",
    [
        (-1.0, ValueError, "eps must lie in [0.0, inf]"),
        (float("nan"), ValueError, "eps must be finite"),
        ("1e-5", TypeError, "eps must be a real number"),
    ],
)
def test_bad_options(backend, eps, exc, needle):
    with pytest.raises(exc) as info:
        ln(backend).forward(*_ln_args(), eps=eps)
    assert needle in str(info.value)


def test_backward_rejects(backend):
    k = ln(backend)
    x, g, b = _ln_args()
    _, cache = k.forward(x, g, b)
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        k.backward(np.ones((4, 5)), cache)
    with pytest.raises(TypeError, match="dy has dtype float32 but the forward ran in float64"):
        k.backward(np.ones((4, 6), np.float32), cache)
    with pytest.raises(TypeError, match="cache must be"):
        k.backward(np.ones((4, 6)), {"x": x})
    with pytest.raises(ValueError, match="out has unknown field"):
        k.backward(np.ones((4, 6)), cache, out={"dz": np.empty(3)})
    with pytest.raises(ValueError, match="out.dgamma must have shape"):
        k.backward(np.ones((4, 6)), cache, out={"dgamma": np.empty(3)})


def test_outputs_may_not_alias_inputs(backend):
    k = ln(backend)
    x, g, b = _ln_args()
    with pytest.raises(ValueError, match="overlaps input x"):
        k.forward(x, g, b, out=x)
    _, cache = k.forward(x, g, b)
    dy = np.ones_like(x)
    with pytest.raises(ValueError, match="overlaps input dy"):
        k.backward(dy, cache, out={"dx": dy})
    with pytest.raises(ValueError, match="must be a writeable C-contiguous"):
        k.forward(x, g, b, out=np.empty((6, 4)).T)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[:, ::2],  # strided
        lambda a: a[::-1],  # negative stride
        lambda a: np.asfortranarray(a),  # Fortran order
    ],
)
def test_non_contiguous_inputs_give_the_right_answer(backend, make):
    k = ln(backend)
    rng = np.random.default_rng(1)
    big = rng.normal(size=(5, 12))
    x = make(big)
    g = rng.normal(size=x.shape[-1])[::-1]
    b = rng.normal(size=2 * x.shape[-1])[::2]
    dy = make(rng.normal(size=big.shape))
    y, c = k.forward(x, g, b)
    gr = k.backward(dy, c)
    y0, c0 = k.forward(np.ascontiguousarray(x), np.ascontiguousarray(g), np.ascontiguousarray(b))
    gr0 = k.backward(np.ascontiguousarray(dy), c0)
    np.testing.assert_allclose(y, y0, rtol=0, atol=1e-14)
    for a0, a1 in zip(gr, gr0):
        np.testing.assert_allclose(a0, a1, rtol=0, atol=1e-13)


def test_groupnorm_num_groups(backend):
    k = derivgen.load("groupnorm", backend=backend)
    x = np.ones((2, 6, 3))
    g = np.ones(6)
    with pytest.raises(ValueError, match="num_groups=4 must be positive and divide the number of channels C=6"):
        k.forward(x, g, g, num_groups=4)
    with pytest.raises(TypeError, match="num_groups must be an int"):
        k.forward(x, g, g, num_groups=2.0)
    with pytest.raises(ValueError, match="num_groups=0"):
        k.forward(x, g, g, num_groups=0)


def test_batchnorm_edge_cases(backend):
    k = derivgen.load("batchnorm", backend=backend)
    g = np.ones(3)
    with pytest.raises(ValueError, match="train mode needs at least 2 values per normalization group"):
        k.forward(np.ones((1, 3)), g, g)
    k.forward(np.ones((1, 3)), g, g, training=False, running_mean=np.zeros(3), running_var=np.ones(3))
    with pytest.raises(ValueError, match="running_mean must have shape"):
        k.forward(np.ones((4, 3)), g, g, running_mean=np.zeros(4), running_var=np.ones(3))
    with pytest.raises(ValueError, match="eval mode .* needs running_mean"):
        k.forward(np.ones((4, 3)), g, g, training=False)
    with pytest.raises(ValueError, match="momentum must lie in"):
        k.forward(np.ones((4, 3)), g, g, momentum=1.5)
    with pytest.raises(TypeError, match="training must be a bool"):
        k.forward(np.ones((4, 3)), g, g, training="no")
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="running_mean must be writeable"):
        k.forward(np.ones((4, 3)), g, g, running_mean=ro, running_var=np.ones(3))
    with pytest.raises(ValueError, match=r"x must have shape \(N, C"):
        k.forward(np.ones(3), g, g)


def test_batchnorm_updates_strided_buffers_in_place(backend):
    k = derivgen.load("batchnorm", backend=backend)
    x = np.random.default_rng(2).normal(size=(8, 3))
    store = np.zeros(6)
    rm = store[::2]
    rv = np.ones(3)
    k.forward(x, np.ones(3), np.zeros(3), running_mean=rm, running_var=rv, momentum=1.0)
    np.testing.assert_allclose(store[::2], x.mean(0))
    np.testing.assert_array_equal(store[1::2], 0.0)
    np.testing.assert_allclose(rv, x.var(0, ddof=1))


def test_online_edge_cases(backend):
    k = derivgen.load("online_layernorm", backend=backend)
    g = np.ones(4)
    with pytest.raises(ValueError, match="at least 2 values"):
        k.forward(np.ones((3, 1)), np.ones(1), np.ones(1), alpha=0.5, prev_mean=0.0, prev_std=1.0)
    with pytest.raises(ValueError, match="alpha must lie in"):
        k.forward(np.ones((3, 4)), g, g, alpha=-0.1, prev_mean=0.0, prev_std=1.0)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'alpha'"):
        k.forward(np.ones((3, 4)), g, g, prev_mean=0.0, prev_std=1.0)
    with pytest.raises(ValueError, match=r"prev_mean must be a scalar or have shape \(3,\)"):
        k.forward(np.ones((3, 4)), g, g, alpha=0.5, prev_mean=np.zeros(4), prev_std=1.0)


def test_instancenorm_needs_spatial_axes(backend):
    k = derivgen.load("instancenorm", backend=backend)
    with pytest.raises(ValueError, match="at least 3 dimensions"):
        k.forward(np.ones((2, 3)), np.ones(3), np.ones(3))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_and_inf_propagate(backend, dtype):
    """IEEE semantics: a NaN or Inf poisons its own group and nothing else."""
    k = ln(backend)
    x = np.random.default_rng(3).normal(size=(3, 5)).astype(dtype)
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    y, c = k.forward(x, np.ones(5, dtype), np.zeros(5, dtype))
    assert np.isfinite(y[0]).all()
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    g = k.backward(np.ones_like(x), c)
    assert np.isfinite(g.dx[0]).all() and np.isnan(g.dx[1]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("alpha", [0.7, 1, np.float64(0.7), np.float32(0.7), np.int64(1)])
def test_a_scalar_parameter_takes_python_and_numpy_numbers(backend, dtype, alpha):
    from conftest import ROOT

    k = derivgen.load(ROOT / "examples" / "dynamic_tanh.toml", backend=backend)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 5)).astype(dtype)
    g, b = np.ones(5, dtype), np.zeros(5, dtype)
    y, cache = k.forward(x, alpha, g, b)
    y0, cache0 = k.forward(x, np.asarray(alpha, dtype), g, b)
    np.testing.assert_array_equal(y, y0)
    dy = np.ones_like(x)
    np.testing.assert_array_equal(k.backward(dy, cache).dalpha, k.backward(dy, cache0).dalpha)


@pytest.mark.parametrize(
    "alpha, exc, needle", [(True, TypeError, "alpha"), ("0.7", TypeError, "alpha"), (np.inf, ValueError, "finite")]
)
def test_a_scalar_parameter_still_rejects_what_is_no_number(backend, alpha, exc, needle):
    from conftest import ROOT

    k = derivgen.load(ROOT / "examples" / "dynamic_tanh.toml", backend=backend)
    x = np.ones((3, 5))
    with pytest.raises(exc, match=needle):
        k.forward(x, alpha, np.ones(5), np.zeros(5))
