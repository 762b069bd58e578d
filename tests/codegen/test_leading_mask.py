"""``leading(p)`` selects the first int(p*d) features in every target, at products p*d that
round just above or just below an integer in double (0.7*10 is 7.000000000000001, 0.29*100
is 28.999999999999996): the NumPy, C, PyTorch and Triton backends of the zoo's partial RMS
norm against the reference implementation's ``int(d * p)`` slice, with PyTorch autograd."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_module

import derivgen

CASES = [(10, 0.7), (100, 0.29), (10, 0.1), (7, 1.0), (33, 0.5)]


def _reference(x, gamma, p, eps=1e-8):

    d = x.shape[-1]
    k = int(d * p)
    rms = x[..., :k].norm(2, dim=-1, keepdim=True) * k**-0.5
    return gamma * x / (rms + eps)


@pytest.mark.parametrize("backend", ["numpy", "c", "torch", "triton"])
@pytest.mark.parametrize("d, p", CASES)
def test_leading_slice_matches_int_d_times_p(backend, d, p):
    torch = require_module("torch")
    if backend == "triton":
        require_module("triton")
    rng = np.random.default_rng(d)
    x, gamma, dy = rng.normal(size=(4, d)), rng.normal(size=d), rng.normal(size=(4, d))
    xt, gt = torch.tensor(x, requires_grad=True), torch.tensor(gamma, requires_grad=True)
    want = _reference(xt, gt, p)
    want.backward(torch.tensor(dy))
    k = derivgen.load("prmsnorm", backend=backend)
    dt = torch.float32 if backend == "triton" else torch.float64  # Triton computes in float32
    if backend in ("torch", "triton"):
        y, cache = k.forward(torch.tensor(x, dtype=dt), torch.tensor(gamma, dtype=dt), p=p)
        grads = k.backward(torch.tensor(dy, dtype=dt), cache)
        y, dx, dgamma = (t.detach().double().numpy() for t in (y, grads.dx, grads.dgamma))
    else:
        y, cache = k.forward(x, gamma, p=p)
        grads = k.backward(dy, cache)
        dx, dgamma = grads.dx, grads.dgamma
    tol = 1e-4 if dt == torch.float32 else 1e-12
    for got, ref in ((y, want), (dx, xt.grad), (dgamma, gt.grad)):
        ref = ref.detach().numpy()
        assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref)), (backend, d, p)
