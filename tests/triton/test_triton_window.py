"""``window(e, k)`` in the Triton kernels, under Triton's interpreter: each window is a
``triton.jit`` function that sums its body at the neighbouring elements (masked loads at
index ± D·stride, a run-time k), nested where a body reads a window. The zoo's lrn (channels
first and last) and a window over a trailing layout's features against PyTorch's
local_response_norm with autograd (float32 kernels, float64 reference), in one tile per group
and swept in tiles; windows beside statistics, parameters and a fixed size against the NumPy
backend; the second order (the PyTorch closed forms on the device) against autograd."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import LRN_FEATURES, require_module, run_driver

torch = require_module("torch")
require_module("triton")
import triton_cases as tc

import derivgen
from derivgen.spec import parse_spec
from derivgen.triton.launch import tile_limit

F = torch.nn.functional
OPTIONS = {"alpha": 0.3, "beta": 0.75, "k": 1.5}

FEATURES = LRN_FEATURES

# a window beside statistics and a parameter (dx reads gamma and the statistics at the
# neighbours through the transposed window), and one of a fixed size
MIXED = """
name = "window_mixed"
title = "Normalized, then divided by a window's power"
summary = "x of shape (..., d)"

[layout]
kind = "trailing"

[params]
gamma = { role = "scale" }

[options]
size = { default = 3, min = 1, integer = true }
eps = { default = 1e-5, min = 0 }

[statistics]
mean = { expr = "mean(x)" }
var = { expr = "mean((x - mean)**2)" }

[normalized]
name = "xhat"
expr = "(x - mean)/sqrt(var + eps)"

[output]
y = "gamma*xhat/sqrt(1 + window(x**2, size)/size) + window(x, 2)*mean"
"""


def _lrn_ref(x: np.ndarray, size: int, layout: str) -> callable:
    """local_response_norm over x's channels (``layout`` "first") or its last axis ("features")."""

    def f(z):
        if layout == "features":
            return F.local_response_norm(z.reshape(-1, z.shape[-1], 1), size, **OPTIONS).reshape(z.shape)
        return F.local_response_norm(z, size, **OPTIONS)

    return f


def _check_lrn(spec, shape, size, layout, tol=1e-4):
    rng = np.random.default_rng(size + len(shape))
    x, dy = rng.normal(0.3, 1.3, shape), rng.standard_normal(shape)
    m = derivgen.load(spec, "triton")
    xt, dyt = torch.tensor(x, dtype=torch.float32), torch.tensor(dy, dtype=torch.float32)
    if layout == "last":  # x of shape (N, C, H, W) in channels-last memory
        xt = xt.contiguous(memory_format=torch.channels_last)
        dyt = dyt.contiguous(memory_format=torch.channels_last)
    ref = _lrn_ref(x, size, "first" if layout == "last" else layout)
    xr, dyr = torch.tensor(x, requires_grad=True), torch.tensor(dy)
    yr = ref(xr)
    (gr,) = torch.autograd.grad(yr, xr, dyr)
    for tile in (4096, 16):
        with tile_limit(tile):
            y, cache = m.forward(xt, size=size, **OPTIONS)
            dx = m.backward(dyt, cache).dx
        assert y.stride() == xt.stride() and dx.stride() == xt.stride()
        where = f"{spec if isinstance(spec, str) else spec.name} {shape} size {size} {layout} tile {tile}"
        assert tc.relerr(y, yr.detach().numpy()) < tol, f"{where}: y off by {tc.relerr(y, yr.detach().numpy())}"
        assert tc.relerr(dx, gr.numpy()) < tol, f"{where}: dx off by {tc.relerr(dx, gr.numpy())}"


@pytest.mark.parametrize("size", [1, 2, 5])
@pytest.mark.parametrize("shape", [(2, 7, 3), (2, 37, 2, 3), (1, 1, 4)])
def test_lrn_channels_first(shape, size):
    _check_lrn("lrn", shape, size, "first")


@pytest.mark.parametrize("size", [2, 5])
@pytest.mark.parametrize("shape", [(2, 7, 3, 2), (2, 37, 2, 3)])
def test_lrn_channels_last(shape, size):
    """x channels-last in memory: the window's neighbours lie one channel stride (1) apart."""
    _check_lrn("lrn", shape, size, "last")


@pytest.mark.parametrize("size", [1, 2, 9])
@pytest.mark.parametrize("shape", [(5, 37), (3, 4), (2, 3, 1)])
def test_window_over_features(shape, size):
    _check_lrn(parse_spec(FEATURES, "lrn_features.toml"), shape, size, "features")


@pytest.mark.parametrize("size", [1, 2, 4])
def test_windows_beside_statistics_and_parameters(size):
    """Against the NumPy backend in float64: y, dx and dgamma, one tile and swept in tiles."""
    spec = parse_spec(MIXED, "window_mixed.toml")
    for tile in (4096, 16):
        with tile_limit(tile):
            for case in tc.cases(spec):
                case.kw["size"] = size
                tc.compare(spec, case, torch.float32, 1e-5)


def test_the_kernels_call_one_function_per_window():
    """The forward's window and the backward's transposed window, which calls the forward's
    at each neighbour; the size is the option's run-time value."""
    from derivgen.api import materialize

    root, _ = materialize(derivgen.load_spec("lrn"), "triton")
    text = (root / "lrn.py").read_text()
    assert "def Window_train_1(Offs, Mask, Chan, Ib, B, sB, X_Ptr, size):" in text
    assert "Width = tl.cast(size, tl.int32)" in text
    assert "Win1 = Window_train_1(Offs_D, Mask_D, Chan_D, Ib_D, B, sB, X_Ptr, size)" in text
    assert text.count("@triton.jit\ndef Window_") == 2


@pytest.mark.parametrize("layout", ["first", "features"])
def test_second_order_by_the_closed_forms(layout):
    """backward_backward and jvp (the PyTorch closed forms on the tensors' device) against autograd."""
    spec = "lrn" if layout == "first" else parse_spec(FEATURES, "lrn_features.toml")
    shape, size = ((2, 6, 3), 3) if layout == "first" else ((3, 7), 4)
    rng = np.random.default_rng(5)
    x, dy, ddx, tx = (rng.standard_normal(shape) for _ in range(4))
    m = derivgen.load(spec, "triton")
    f32 = {n: torch.tensor(v, dtype=torch.float32) for n, v in {"x": x, "dy": dy, "ddx": ddx, "tx": tx}.items()}
    _, cache = m.forward(f32["x"], size=size, **OPTIONS)
    bb = m.backward_backward(f32["dy"], cache, f32["ddx"])
    ty = m.jvp(cache, f32["tx"])
    ref = _lrn_ref(x, size, layout)
    xr, dyr = torch.tensor(x, requires_grad=True), torch.tensor(dy, requires_grad=True)
    (gx,) = torch.autograd.grad(ref(xr), xr, dyr, create_graph=True)
    bx, bdy = torch.autograd.grad(gx, (xr, dyr), torch.tensor(ddx))
    _, jt = torch.func.jvp(ref, (torch.tensor(x),), (torch.tensor(tx),))
    for name, got, want in (("dx", bb.dx, bx), ("ddy", bb.ddy, bdy), ("jvp", ty, jt)):
        assert tc.relerr(got, want.detach().numpy()) < 1e-4, f"{name} off by {tc.relerr(got, want.detach().numpy())}"


def test_the_kernels_compile_for_a_gpu(tmp_path):
    """The kernels of the lrn layer and of a window beside statistics and a parameter, compiled
    for sm_90 in a process without Triton's interpreter (no GPU needed): the window functions'
    loops over a run-time k, masked neighbour loads and nested calls are valid Triton."""
    spec = tmp_path / "window_mixed.toml"
    spec.write_text(MIXED)
    r = run_driver("triton_compile_driver.py", tmp_path, "", "lrn", spec)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": compiled") == 8, r.stdout
