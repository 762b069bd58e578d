"""Both generated backends, float32 and float64, against PyTorch autograd."""

import numpy as np
import pytest
from conftest import require_module
from oracle import CASES, make_inputs, torch_reference

import derivgen

TOL = {np.float64: 1e-10, np.float32: 2e-5}  # relative to the largest reference value


@pytest.fixture(autouse=True)
def _default_flags(monkeypatch):
    """The catalogue's C as users build it (the default -O3 and -march of this machine's
    x86-64 level), against PyTorch: the suite's other value tests build at -O0 (conftest's
    QUICK_CFLAGS)."""
    monkeypatch.delenv("CFLAGS", raising=False)


def _close(name, got, ref, dtype):
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(got - ref).max()) / scale
    assert err <= TOL[dtype], f"{name}: relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{i}" for i, c in enumerate(CASES)])
def test_matches_torch(case, dtype, backend):
    require_module("torch")
    name = case[0]
    mod = derivgen.load(name, backend=backend)
    x, params, kw, dy = make_inputs(case, dtype)
    ref_kw = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    y_ref, g_ref, buf_ref = torch_reference(
        name,
        x.astype(np.float64),
        {k: v.astype(np.float64) for k, v in params.items()},
        {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v) for k, v in ref_kw.items()},
        dy.astype(np.float64),
    )
    y, cache = mod.forward(x, *params.values(), **kw)
    assert y.dtype == dtype
    _close("y", y, y_ref, dtype)
    grads = mod.backward(dy, cache)
    for field in grads._fields:
        got = getattr(grads, field)
        assert np.asarray(got).dtype == dtype, field
        _close(field, got, g_ref[field], dtype)
    for b, ref in buf_ref.items():
        if kw.get("training", True):
            _close(b, kw[b], ref, dtype)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_online_exposes_new_moments(backend):
    mod = derivgen.load("online_layernorm", backend=backend)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 6))
    g, b = np.ones(6), np.zeros(6)
    _, cache = mod.forward(x, g, b, alpha=0.25, prev_mean=1.0, prev_std=2.0)
    mu = 0.25 * x.mean(-1) + 0.75 * 1.0
    np.testing.assert_allclose(cache.mean, mu, rtol=1e-12)
    s = np.sqrt(((x - mu[:, None]) ** 2).sum(-1) / 5)
    np.testing.assert_allclose(cache.std, 0.25 * s + 0.75 * 2.0, rtol=1e-12)
    assert cache.mean.shape == (5,)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_preallocated_outputs_are_used(backend):
    mod = derivgen.load("layernorm", backend=backend)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 16)).astype(np.float32)
    g, b = np.ones(16, np.float32), np.zeros(16, np.float32)
    out = np.empty_like(x)
    y, cache = mod.forward(x, g, b, out=out)
    assert y is out
    bufs = mod.Grads(np.empty_like(x), np.empty(16, np.float32), np.empty(16, np.float32))
    grads = mod.backward(np.ones_like(x), cache, out=bufs)
    assert all(a is b for a, b in zip(grads, bufs))


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("given", ["per group", "scalar"])
def test_preallocated_input_gradients_are_filled(backend, given):
    """The per-group inputs' gradients (online layer norm's prev_mean, prev_std) land in the
    arrays passed for them as out=, first and second order, as every other field does."""
    mod = derivgen.load("online_layernorm", backend=backend)
    rng = np.random.default_rng(2)
    x, g, b = rng.normal(size=(5, 6)), rng.normal(size=6), rng.normal(size=6)
    prev = (rng.normal(size=5), rng.uniform(1, 2, size=5)) if given == "per group" else (0.5, 1.5)
    kw = {"alpha": 0.25, "prev_mean": prev[0], "prev_std": prev[1]}
    _, cache = mod.forward(x, g, b, **kw)
    dy = rng.normal(size=x.shape)
    want = mod.backward(dy, cache)
    bufs = {f: np.full_like(np.asarray(v), np.nan) for f, v in want._asdict().items()}
    grads = mod.backward(dy, cache, out=bufs)
    for f, a in bufs.items():
        assert getattr(grads, f) is a, f
        np.testing.assert_array_equal(a, getattr(want, f), err_msg=f)
    ddx = rng.normal(size=x.shape)
    want2 = mod.backward_backward(dy, cache, ddx)
    bufs2 = {f: np.full_like(np.asarray(v), np.nan) for f, v in want2._asdict().items()}
    got2 = mod.backward_backward(dy, cache, ddx, out=bufs2)
    for f, a in bufs2.items():
        assert getattr(got2, f) is a, f
        np.testing.assert_array_equal(a, getattr(want2, f), err_msg=f)
    with pytest.raises(ValueError, match="out.dprev_mean"):
        mod.backward(dy, cache, out={**bufs, "dprev_mean": np.empty(7)})


def test_backends_agree_on_every_layer():
    for case in CASES:
        name = case[0]
        x, params, kw, dy = make_inputs(case, np.float64, seed=5)
        res = []
        for backend in ("numpy", "c"):
            kw_b = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
            mod = derivgen.load(name, backend=backend)
            y, c = mod.forward(x, *params.values(), **kw_b)
            res.append((y, mod.backward(dy, c)))
        (y0, g0), (y1, g1) = res
        np.testing.assert_allclose(y0, y1, rtol=1e-12, atol=1e-12)
        for a, b in zip(g0, g1):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("name", ["layernorm", "batchnorm", "groupnorm"])
def test_results_do_not_depend_on_the_thread_count(name, backend):
    """Per-group sums run in a fixed order: y and dx are the same bits for 1 and 3
    threads. Parameter gradients are too in the NumPy backend (chunks summed in
    order); the C kernels reduce per-thread partials, so they may differ in the
    last bits between thread counts (never between runs with the same count)."""
    mod = derivgen.load(name, backend=backend)
    rng = np.random.default_rng(9)
    shape = (300, 40) if name == "layernorm" else (12, 8, 30)
    x = rng.normal(size=shape)
    p = np.full(shape[-1] if name == "layernorm" else 8, 1.5)
    kw = {"num_groups": 4} if name == "groupnorm" else {}
    out = []
    for th in (1, 3):
        mod.set_num_threads(th)
        y, c = mod.forward(x, p, p, **kw)
        out.append((y, mod.backward(np.ones_like(x), c)))
    mod.set_num_threads(0)
    (y1, g1), (y3, g3) = out
    np.testing.assert_array_equal(y1, y3)
    np.testing.assert_array_equal(g1.dx, g3.dx)
    for a, b in zip(g1[1:], g3[1:]):
        if backend == "numpy":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
