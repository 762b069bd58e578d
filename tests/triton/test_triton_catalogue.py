"""The Triton kernels of every catalogue layer under Triton's interpreter: against the NumPy
backend (float64), the C backend (float32) and PyTorch autograd (tools/torch_ref.py, float64);
one tile per group and swept in tiles; channels first and last; float32 tight, float16
and bfloat16 loose."""

from __future__ import annotations

import pytest
from conftest import require_module

torch = require_module("torch")
require_module("triton")
require_module("numpy")
import numpy as np
import triton_cases as tc

import derivgen
from derivgen.tools.torch_ref import torch_reference
from derivgen.triton.launch import tile_limit

CATALOGUE = derivgen.names()
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("name", CATALOGUE)
def test_catalogue_float32_against_numpy(name):
    spec = derivgen.load_spec(name)
    for case in tc.cases(spec):
        tc.compare(spec, case, torch.float32, TOL[torch.float32])


@pytest.mark.parametrize("name", CATALOGUE)
def test_catalogue_swept_in_tiles(name):
    # 16-value tiles: every group is larger than one tile, so the kernels loop
    spec = derivgen.load_spec(name)
    with tile_limit(16):
        for case in tc.cases(spec):
            tc.compare(spec, case, torch.float32, TOL[torch.float32])


@pytest.mark.parametrize("name", ["batchnorm", "instancenorm", "groupnorm"])
def test_channels_last(name):
    spec = derivgen.load_spec(name)
    for tile in (4096, 16):
        with tile_limit(tile):
            for case in tc.cases(spec, channels_last=True):
                tc.compare(spec, case, torch.float32, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "batchnorm", "groupnorm"])
def test_low_precision(name, dtype):
    spec = derivgen.load_spec(name)
    for case in tc.cases(spec):
        tc.compare(spec, case, dtype, TOL[dtype])


@pytest.mark.parametrize("name", ["layernorm", "batchnorm", "groupnorm"])
def test_against_c_float32(name):
    spec = derivgen.load_spec(name)
    for case in tc.cases(spec):
        x, dy, params, kw = tc.inputs(spec, case)
        y, grads, _ = tc.run_triton(spec, case, torch.float32, x, dy, params, kw)
        ry, rgrads, _ = tc.reference(spec, x, dy, params, kw, backend="c", dtype=np.float32)
        assert tc.relerr(y, ry) < 1e-5
        for g, r in zip(grads, rgrads):
            assert tc.relerr(g, r) < 1e-5


@pytest.mark.parametrize("name", CATALOGUE)
def test_against_pytorch_autograd(name):
    spec = derivgen.load_spec(name)
    for case in tc.cases(spec):
        x, dy, params, kw = tc.inputs(spec, case)
        y, grads, bufs = tc.run_triton(spec, case, torch.float32, x, dy, params, kw)
        pnames = [p.name for p in spec.params]
        ref_kw = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        ry, rgrads, rbufs = torch_reference(name, x, dict(zip(pnames, params)), ref_kw, dy)
        assert tc.relerr(y, ry) < 1e-5
        for f, g in zip(grads._fields, grads):
            assert tc.relerr(g, rgrads[f]) < 1e-4, f
        for b, v in rbufs.items():
            if v is not None:
                assert tc.relerr(bufs[b], v) < 1e-5, b


def test_statistics_in_the_cache_and_empty_batches():
    ln = derivgen.load("layernorm", "triton")
    x = torch.randn(5, 37) * 3 + 1e3  # a large mean: two passes keep the variance
    y, cache = ln.forward(x, torch.ones(37), torch.zeros(37))
    ref = x.double()
    assert torch.allclose(cache.var.double().reshape(-1), ref.var(1, unbiased=False), rtol=1e-4)
    assert torch.allclose(cache.mean.double().reshape(-1), ref.mean(1), rtol=1e-6)
    y, cache = ln.forward(torch.zeros(0, 37), torch.ones(37), torch.zeros(37))
    g = ln.backward(torch.zeros(0, 37), cache)
    assert y.shape == (0, 37) and g.dx.shape == (0, 37) and float(g.dgamma.abs().sum()) == 0.0


def test_second_order_by_the_pytorch_closed_forms():
    ln = derivgen.load("layernorm", "triton")
    tn = derivgen.load("layernorm", "torch")
    x, g, b = torch.randn(3, 37), torch.randn(37), torch.randn(37)
    dy, ddx = torch.randn(3, 37), torch.randn(3, 37)
    _, c = ln.forward(x, g, b)
    _, c2 = tn.forward(x, g, b)
    got, ref = ln.backward_backward(dy, c, ddx), tn.backward_backward(dy, c2, ddx)
    for a, r in zip(got, ref):
        assert torch.allclose(a, r)
    assert torch.allclose(ln.jvp(c, ddx), tn.jvp(c2, ddx))


def test_errors_name_the_argument():
    ln = derivgen.load("layernorm", "triton")
    with pytest.raises(TypeError, match="float64"):
        ln.forward(torch.randn(3, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), torch.zeros(8))
    with pytest.raises(ValueError, match="gamma"):
        ln.forward(torch.randn(3, 8), torch.ones(7), torch.zeros(7))
