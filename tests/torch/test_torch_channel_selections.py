"""Group max()/min() in channel layouts through derivgen.torch: the channels-last kernels
give the NCHW kernels' bits, and both match PyTorch autograd of the forward written here
with torch.amax/torch.amin (their gradient convention: split evenly among tied elements);
a split reduction across processes refuses them by name."""

import pytest
from conftest import QUICK_CFLAGS, ROOT, require_module

torch = require_module("torch")
import derivgen.torch as dt

SPEC = """
name = "range_{reduce}"
title = "Range normalization"
summary = "y = gamma*(x - mean)/(max(x) - min(x) + eps) + beta"
[layout]
kind = "channels"
reduce = "{reduce}"
[params]
gamma = {{ role = "scale" }}
beta = {{ role = "shift" }}
[options]
eps = {{ default = 1e-3, min = 0 }}
[statistics]
mean = "mean(x)"
hi = "max(x)"
lo = "min(x)"
[output]
y = "gamma*(x - mean)/(hi - lo + eps) + beta"
"""

GROUPS = 2


def _reference(x, gamma, beta, reduce, eps=1e-3):
    """The forward written with torch operations: the statistics over each group's axes."""
    n, c = x.shape[:2]
    if reduce == "group":
        v = x.reshape(n, GROUPS, -1)
        dims = (2,)
    elif reduce == "instance":
        v = x.reshape(n, c, -1)
        dims = (2,)
    else:
        v = x.transpose(0, 1).reshape(c, -1)
        dims = (1,)
    mean = v.mean(dims, keepdim=True)
    rng = v.amax(dims, keepdim=True) - v.amin(dims, keepdim=True) + eps
    z = (v - mean) / rng
    z = z.reshape(n, c, *x.shape[2:]) if reduce != "batch" else z.reshape(c, n, *x.shape[2:]).transpose(0, 1)
    shape = (1, c) + (1,) * (x.dim() - 2)
    return gamma.reshape(shape) * z + beta.reshape(shape)


@pytest.mark.parametrize("reduce", ["instance", "group", "batch"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_group_selections_in_channel_layouts(reduce, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)  # a user spec: built as the regression specs are
    path = tmp_path / f"range_{reduce}.toml"
    path.write_text(SPEC.format(reduce=reduce))
    tdt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 5, 6, generator=gen, dtype=tdt)
    x[1, 2, 0, 0] = x[1, 2].max()  # ties with a group's maximum (instance, group, batch alike)
    x[2, 1, 3, 3] = x[2, 1].min()
    x[0, 3, 4, 5] = x[:, 3].max()
    dy = torch.randn(x.shape, generator=gen, dtype=tdt)
    kw = {"num_groups": GROUPS} if reduce == "group" else {}
    m = dt.Module(path, 4, **kw).to(tdt)
    with torch.no_grad():
        m.gamma.normal_(1.0, 0.3, generator=gen)
        m.beta.normal_(0.0, 0.3, generator=gen)
    outs = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        xi = x.clone().to(memory_format=fmt).requires_grad_()
        y = m(xi)
        y.backward(dy.to(memory_format=fmt))
        outs.append((y.detach(), xi.grad, m.gamma.grad.clone(), m.beta.grad.clone()))
        m.gamma.grad = m.beta.grad = None
    for a, b in zip(*outs):
        assert torch.equal(a, b)  # channels last: the NCHW kernels' bits
    xr = x.clone().requires_grad_()
    g, b = (m.gamma.detach().clone().requires_grad_(), m.beta.detach().clone().requires_grad_())
    yr = _reference(xr, g, b, reduce)
    yr.backward(dy)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == "float64" else {"rtol": 1e-4, "atol": 1e-5}
    for got, want in zip(outs[0], (yr.detach(), xr.grad, g.grad, b.grad)):
        torch.testing.assert_close(got, want, **tol)


def test_split_reduction_refuses_group_selections():
    path = ROOT / "tests" / "regressions" / "group_max_over_batch_blocks.toml"
    with pytest.raises(ValueError, match="hi, lo take a group max"):
        dt.Module(path, 4, sync=True)


SIGNED = """
name = "signed_range_{reduce}"
title = "A selection whose zero's sign and NaN's payload reach y"
summary = "y = x*hi*lo: the sign of a zero hi or lo, and the payload of a NaN one, reach y"
[layout]
kind = "channels"
reduce = "{reduce}"
[statistics]
hi = "max(x)"
lo = "min(x)"
[output]
y = "x*hi*lo"
"""


@pytest.mark.parametrize("reduce", ["instance", "group", "batch"])
def test_channels_last_chooses_zeros_and_nans_as_nchw(reduce, tmp_path, monkeypatch):
    """Which zero (-0, +0) or NaN a group max/min keeps is the NCHW sweep's choice in both
    memory formats (the first zero, the last NaN in NCHW order): channels last sweeps positions
    before channels, and redoes a zero or NaN result in that order (_c_groups.j2, best_order)."""
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)
    path = tmp_path / f"signed_range_{reduce}.toml"
    path.write_text(SIGNED.format(reduce=reduce))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 5, 6, generator=gen)
    x[:, :2] = -x[:, :2].abs() - 1  # channels 0, 1 (group 0): the maximum is a zero
    x[:, 2:] = x[:, 2:].abs() + 1  # channels 2, 3 (group 1): the minimum is a zero
    x[:, 1, 0, 0], x[:, 0, 0, 5] = -0.0, 0.0  # NCHW order meets channel 0's +0 first
    x[:, 3, 0, 0], x[:, 2, 0, 5] = 0.0, -0.0  # and channel 2's -0
    nan = torch.tensor([0x7FC00011, -0x3FFFDE], dtype=torch.int32).view(torch.float32)  # two payloads
    x[1, 2, 4, 1], x[1, 3, 0, 2] = nan[0], nan[1]  # NCHW order meets nan[1] last, channels last nan[0]
    kw = {"num_groups": GROUPS} if reduce == "group" else {}
    m = dt.Module(path, 4, **kw)
    with torch.no_grad():
        ys = [m(x.clone().to(memory_format=fmt)) for fmt in (torch.contiguous_format, torch.channels_last)]
    assert (ys[0] == 0).any() and torch.isnan(ys[0]).any()
    assert torch.equal(ys[0].contiguous().view(torch.int32), ys[1].contiguous().view(torch.int32))
