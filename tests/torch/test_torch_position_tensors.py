"""A channel layout's per-position tensors ((N, 1, *spatial): one value per sample and
position) go to the C kernels at their own shape, read at the element's (sample, position)
in the NCHW and the channels-last kernels: a gated, masked norm of every channel reduction
whose gate has a gradient (its element gradients summed over the channels) against
autograd of an independent PyTorch forward, with the same bits on 1 and 2 threads and for
NCHW and channels-last x, through derivgen.torch and the NumPy C binding."""

from __future__ import annotations

import pytest
from conftest import require_module

torch = require_module("torch")
import numpy as np

import derivgen
import derivgen.torch as dt
from derivgen.spec.parse import parse_spec

X = (3, 4, 21, 23)  # (N, C, H, W): over SERIAL_BELOW values; 483 positions, not whole lanes
GROUPS = 2  # the group reduction's groups (Cg = 2)

TEXT = """
name = "position_gate_{reduce}"
title = "A masked norm gated per position"
[layout]
kind = "channels"
reduce = "{reduce}"
[params]
weight = {{ init = 1.0 }}
bias = {{ role = "shift", init = 0.0 }}
[options]
eps = {{ default = 1e-5, min = 0 }}
[tensors]
mask = {{ shape = "position", mask = true }}
gate = {{ shape = "position" }}
[statistics]
frac = "mean(mask)"
mu = "mean(mask*gate*x)/frac"
var = "mean(mask*(x - mu)**2)/frac"
rstd = "1/sqrt(var + eps)"
[normalized]
name = "xhat"
expr = "(x - mu)*rstd"
[output]
y = "(weight*xhat + bias)*gate"
"""

# x viewed (N, G, Cg, H*W) and the axes each reduction's groups span
VIEWS = {"batch": (X[1], (0, 2, 3)), "instance": (X[1], (2, 3)), "group": (GROUPS, (2, 3)), "all": (1, (0, 2, 3))}


def reference(reduce: str, a: dict) -> torch.Tensor:
    """The layer in plain PyTorch: x as (N, G, Cg, S), the tensors broadcast over the channels."""
    n, c = X[:2]
    g, axes = VIEWS[reduce]
    x = a["x"].reshape(n, g, c // g, -1)
    m, gate = (a[t].reshape(n, 1, 1, -1) for t in ("mask", "gate"))
    frac = m.expand_as(x).mean(axes, keepdim=True)
    mu = (m * gate * x).mean(axes, keepdim=True) / frac
    var = (m * (x - mu) ** 2).mean(axes, keepdim=True) / frac
    xhat = ((x - mu) / torch.sqrt(var + 1e-5)).reshape(X)
    return (a["weight"].reshape(1, c, 1, 1) * xhat + a["bias"].reshape(1, c, 1, 1)) * a["gate"]


def draw(seed: int = 0) -> dict:
    """float64 arguments: masks 0/1 with every sample's first position valid."""
    g = torch.Generator().manual_seed(seed)
    pos = (X[0], 1, *X[2:])
    mask = (torch.rand(pos, generator=g, dtype=torch.float64) < 0.7).double()
    mask[..., 0, 0] = 1.0
    return {
        "x": torch.randn(X, generator=g, dtype=torch.float64) * 1.5 + 0.3,
        "mask": mask,
        "gate": torch.randn(pos, generator=g, dtype=torch.float64) * 0.7 + 0.5,
        "weight": 1 + 0.2 * torch.randn(X[1], generator=g, dtype=torch.float64),
        "bias": 0.2 * torch.randn(X[1], generator=g, dtype=torch.float64),
    }


WRT = ("x", "gate", "weight", "bias")


def step(f, reduce: str, a: dict, dy: torch.Tensor, channels_last: bool = False) -> list[torch.Tensor]:
    """y and the gradients of ``WRT`` of sum(y * dy) by ``f`` (x and dy channels last if asked)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    t = {
        k: v.detach().clone().contiguous(memory_format=fmt if k == "x" else torch.contiguous_format)
        for k, v in a.items()
    }
    for k in WRT:
        t[k].requires_grad_(True)
    kw = {"num_groups": GROUPS} if reduce == "group" else {}
    y = f(t["x"], t["mask"], t["gate"], t["weight"], t["bias"], **kw)
    grads = torch.autograd.grad((y * dy.contiguous(memory_format=fmt)).sum(), [t[k] for k in WRT])
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last) and grads[0].is_contiguous(
            memory_format=torch.channels_last
        )
    return [y.detach().contiguous(), *(g.contiguous() for g in grads)]


# each reduction compiles a layer's kernels (seconds): batch in the default tier, the rest in full
REDUCES = ["batch", *(pytest.param(r, marks=pytest.mark.full) for r in ("all", "group", "instance"))]


@pytest.mark.parametrize("reduce", REDUCES)
def test_position_tensors_are_read_at_their_own_shape(reduce):
    """float64 and float32 against autograd of the reference (y, dx, dgate summed over the
    channels, dweight, dbias); the same bits on 1 and 2 threads, NCHW and channels last (the
    reduce = "all" layout, which has no channels-last kernels, through its NCHW ones)."""
    spec = parse_spec(TEXT.format(reduce=reduce), source=f"position_gate_{reduce}.toml")
    f = dt.function(spec)
    a64 = draw()
    dy64 = torch.randn(X, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = step(
        lambda x, m, g, w, b, **kw: reference(reduce, {"x": x, "mask": m, "gate": g, "weight": w, "bias": b}),
        reduce,
        a64,
        dy64,
    )
    threads = torch.get_num_threads()
    try:
        for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            a = {k: v.to(dtype) for k, v in a64.items()}
            dy = dy64.to(dtype)
            got = {}
            for nth in (1, 2):
                torch.set_num_threads(nth)
                for last in (False, True):
                    got[(nth, last)] = step(f, reduce, a, dy, last)
            first = got[(1, False)]
            for key, out in got.items():
                assert all(torch.equal(p, q) for p, q in zip(out, first)), (reduce, dtype, key)
            for what, p, q in zip(("y", *WRT), first, want):
                err = float((p.double() - q).abs().max() / q.abs().max())
                assert err < tol, (reduce, dtype, what, err)
    finally:
        torch.set_num_threads(threads)


def test_the_numpy_c_binding_reads_them_at_their_own_shape():
    """The NumPy C binding (position tensors passed at their own shape, the gate's element
    gradients summed over the channels): the NumPy target's values, the same bits on 1 and
    2 threads."""
    spec = parse_spec(TEXT.format(reduce="batch"), source="position_gate_batch.toml")
    a = {k: v.numpy() for k, v in draw().items()}
    dy = np.random.default_rng(1).standard_normal(X)
    ref = derivgen.load(spec, backend="numpy")
    _, cache = ref.forward(a["x"], a["mask"], a["gate"], a["weight"], a["bias"])
    want = ref.backward(dy, cache)
    mod = derivgen.load(spec, backend="c")
    out = []
    for nth in (1, 2):
        mod.set_num_threads(nth)
        _, cache = mod.forward(a["x"], a["mask"], a["gate"], a["weight"], a["bias"])
        out.append(mod.backward(dy, cache))
    mod.set_num_threads(0)
    assert want._fields == ("dx", "dgate", "dweight", "dbias")
    for f, p, q, r in zip(want._fields, out[0], out[1], want):
        np.testing.assert_array_equal(p, q, err_msg=f)
        np.testing.assert_allclose(p, r, rtol=1e-11, atol=1e-11, err_msg=f)


def test_a_masks_values_are_checked_on_every_call():
    """After a valid call (the signature's plan made), a mask value other than 0 or 1 (a
    half, NaN, infinity, -1, 2; at the mask's last value) is an error naming it, in float64,
    float32 and bfloat16, NCHW and channels last (the library of the call's kernels counts
    them); -0 is a 0."""
    spec = parse_spec(TEXT.format(reduce="batch"), source="position_gate_batch.toml")
    f = dt.function(spec)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        a = {k: v.to(dtype) for k, v in draw().items()}
        for fmt in (torch.contiguous_format, torch.channels_last):
            x = a["x"].contiguous(memory_format=fmt)
            f(x, a["mask"], a["gate"], a["weight"], a["bias"])
            zero = a["mask"].clone()
            zero[zero == 0] = -0.0
            f(x, zero, a["gate"], a["weight"], a["bias"])
            for bad in (0.5, float("nan"), float("inf"), -1.0, 2.0):
                m = a["mask"].clone()
                m.view(-1)[-1] = bad
                with pytest.raises(ValueError, match="mask is a mask: every value must be 0 or 1"):
                    f(x, m, a["gate"], a["weight"], a["bias"])
