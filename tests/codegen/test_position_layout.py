"""The position layout (``reduce = "position"``: one group per sample and position, its C
channels), through the zoo's ``layernorm2d``, against an independent PyTorch LayerNorm2d
(permute to channels last, ``F.layer_norm`` over C, permute back; autograd for the gradients,
``create_graph`` for the second order), in the NumPy and C backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import derivgen

TOL = {np.float64: 1e-10, np.float32: 1e-4}
EPS = 1e-6
SHAPES = [
    (2, 5, 3, 7),  # S = 21: not a multiple of any vector width
    (3, 4),  # (N, C): one position per sample
    (2, 1, 5),  # C = 1
    (1, 6, 1),  # N*S = 1
    (2, 3, 70),  # S longer than a block of positions
    (3, 33, 2, 3, 2),  # three spatial axes
]


def _ref(x, g, b):
    nd = x.dim()
    last = x.permute(0, *range(2, nd), 1)
    return F.layer_norm(last, (x.shape[1],), g, b, EPS).permute(0, nd - 1, *range(1, nd - 1))


def _close(what, got, want, dtype):
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.size:
        err = float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))
        assert err <= TOL[dtype], f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_position_layer_matches_torch(shape, dtype, backend):
    mod = derivgen.load("layernorm2d", backend=backend)
    rng = np.random.default_rng(sum(shape))
    C = shape[1]
    x = rng.normal(0.3, 1.3, size=shape).astype(dtype)
    g, b = rng.normal(1.0, 0.4, size=C).astype(dtype), rng.normal(size=C).astype(dtype)
    dy = rng.normal(size=shape).astype(dtype)
    tx, tg, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, g, b))
    ty = _ref(tx, tg, tb)
    tdy = torch.tensor(dy, dtype=torch.float64)
    rdx, rdg, rdb = torch.autograd.grad(ty, (tx, tg, tb), tdy)

    y, cache = mod.forward(x, g, b, eps=EPS)
    assert y.dtype == dtype and cache.mean.shape == (shape[0], *shape[2:])
    _close("y", y, ty, dtype)
    grads = mod.backward(dy, cache)
    for what, got, want in (("dx", grads.dx, rdx), ("dgamma", grads.dgamma, rdg), ("dbeta", grads.dbeta, rdb)):
        _close(what, got, want, dtype)

    # second order: the VJP of the backward with random cotangents, and the JVP
    ddx = rng.normal(size=shape).astype(dtype)
    ddg, ddb = rng.normal(size=C).astype(dtype), rng.normal(size=C).astype(dtype)
    t = [torch.tensor(a, dtype=torch.float64) for a in (ddx, ddg, ddb)]
    tdy2 = torch.tensor(dy, dtype=torch.float64, requires_grad=True)
    tx2, tg2, tb2 = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, g, b))
    r = torch.autograd.grad(_ref(tx2, tg2, tb2), (tx2, tg2, tb2), tdy2, create_graph=True)
    inner = (r[0] * t[0]).sum() + (r[1] * t[1]).sum() + (r[2] * t[2]).sum()
    want = torch.autograd.grad(inner, (tx2, tdy2, tg2, tb2), allow_unused=True)
    bb = mod.backward_backward(dy, cache, ddx, [ddg, ddb])
    assert bb._fields == ("dx", "ddy", "dgamma", "dbeta")
    for what, got, w in zip(bb._fields, bb, want):
        _close(f"bb.{what}", got, torch.zeros(np.shape(got), dtype=torch.float64) if w is None else w, dtype)
    _, jv = torch.autograd.functional.jvp(lambda a, p, q: _ref(a, p, q), (tx2, tg2, tb2), tuple(t))
    _close("jvp", mod.jvp(cache, ddx, [ddg, ddb]), jv, dtype)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_position_layer_of_an_empty_batch(backend):
    mod = derivgen.load("layernorm2d", backend=backend)
    x = np.zeros((0, 4, 3))
    y, cache = mod.forward(x, np.ones(4), np.zeros(4))
    assert y.shape == (0, 4, 3) and cache.mean.shape == (0, 3)
    g = mod.backward(np.zeros_like(x), cache)
    assert g.dx.shape == x.shape
    np.testing.assert_array_equal(g.dgamma, 0.0)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_position_layer_does_not_depend_on_the_thread_count(backend):
    """Each group sums its channels in order: y and dx are the same bits for 1 and 3 threads
    (parameter gradients too in NumPy; the C kernels add per-thread partials)."""
    mod = derivgen.load("layernorm2d", backend=backend)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 7, 13, 11))
    dy = rng.normal(size=x.shape)
    p = np.full(7, 1.5)
    out = []
    for th in (1, 3):
        mod.set_num_threads(th)
        y, c = mod.forward(x, p, p)
        out.append((y, c, mod.backward(dy, c)))
    mod.set_num_threads(0)
    (y1, c1, g1), (y3, c3, g3) = out
    np.testing.assert_array_equal(y1, y3)
    np.testing.assert_array_equal(c1.rstd, c3.rstd)
    np.testing.assert_array_equal(g1.dx, g3.dx)
    for a, b in zip(g1[1:], g3[1:]):
        if backend == "numpy":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_position_layer_bad_shapes_name_the_argument(backend):
    mod = derivgen.load("layernorm2d", backend=backend)
    x = np.ones((2, 4, 3))
    with pytest.raises(ValueError, match="x must have shape"):
        mod.forward(np.ones(4), np.ones(4), np.zeros(4))
    with pytest.raises(ValueError, match="gamma must have shape \\(4,\\)"):
        mod.forward(x, np.ones(3), np.zeros(4))
    with pytest.raises(ValueError, match="beta must have shape \\(4,\\)"):
        mod.forward(x, np.ones(4), np.zeros((4, 1)))
    _, cache = mod.forward(x, np.ones(4), np.zeros(4))
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        mod.backward(np.ones((2, 3, 4)), cache)
