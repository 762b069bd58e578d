"""torch.func on derivgen.torch: grad, vjp, jvp, vmap, jacrev, jacfwd, hessian and
functional_call on the drop-in modules and on dt.function, before and after a first
call, against the torch.nn twins; per-sample gradients (vmap of grad) of small models."""

from __future__ import annotations

import copy

import pytest
from conftest import require_module

torch = require_module("torch")
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import derivgen
import derivgen.torch as dt

TOL = {"atol": 1e-10, "rtol": 1e-9}


def _twins():
    """(id, torch.nn module, input shape): float64, parameters moved off their init."""
    cases = [
        ("LayerNorm", nn.LayerNorm(6), (3, 6)),
        ("RMSNorm", nn.RMSNorm(6), (3, 6)),
        ("GroupNorm", nn.GroupNorm(2, 4), (2, 4, 3)),
        ("InstanceNorm1d", nn.InstanceNorm1d(3, affine=True), (2, 3, 4)),
        ("BatchNorm1d-eval", nn.BatchNorm1d(3).eval(), (4, 3, 2)),
        ("BatchNorm2d-batchstats", nn.BatchNorm2d(3, track_running_stats=False), (4, 3, 2, 2)),
    ]
    g = torch.Generator().manual_seed(1)
    out = []
    for name, m, shape in cases:
        m = m.double()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.rand(p.shape, generator=g, dtype=torch.float64) - 0.5)
            for b in m.buffers():
                if b.is_floating_point():
                    b.add_(torch.rand(b.shape, generator=g, dtype=torch.float64))
        out.append(pytest.param(m, shape, id=name))
    return out


def _pair(ref, called_first: bool, shape):
    d = dt.convert(copy.deepcopy(ref))
    assert type(d) is not type(ref)
    if called_first:
        d(torch.randn(shape, dtype=torch.float64))
        ref = copy.deepcopy(ref)
        ref(torch.randn(shape, dtype=torch.float64))
    return ref, d


@pytest.mark.parametrize("called_first", [False, True], ids=["fresh", "called"])
@pytest.mark.parametrize(("ref", "shape"), _twins())
def test_transforms_agree_with_torch_nn(ref, shape, called_first):
    r, d = _pair(ref, called_first, shape)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + 0.2
    t = torch.randn(shape, generator=g, dtype=torch.float64)

    def loss(m):
        return lambda x: (m(x) * t).sin().sum()

    # jvp and vjp
    torch.testing.assert_close(jvp(d, (x,), (t,))[1], jvp(r, (x,), (t,))[1], **TOL)
    torch.testing.assert_close(vjp(d, x)[1](t)[0], vjp(r, x)[1](t)[0], **TOL)
    # grad (with respect to x, and to the parameters through functional_call)
    torch.testing.assert_close(grad(loss(d))(x), grad(loss(r))(x), **TOL)
    params = dict(d.named_parameters())

    def ploss(m):
        return lambda p, x: (functional_call(m, p, (x,)) * t).sin().sum()

    gd, gr = grad(ploss(d))(params, x), grad(ploss(r))(dict(r.named_parameters()), x)
    assert set(gd) == set(gr)
    for k in gd:
        torch.testing.assert_close(gd[k], gr[k], **TOL)
    # vmap over a leading batch of inputs (per-sample calls)
    xs = torch.stack([x, 0.5 * x + 1.0])
    torch.testing.assert_close(vmap(d)(xs), vmap(r)(xs), **TOL)
    # Jacobians and the Hessian on a small input
    xs1 = x[:2] if x.shape[0] > 2 else x
    torch.testing.assert_close(jacrev(d)(xs1), jacrev(r)(xs1), **TOL)
    torch.testing.assert_close(jacfwd(d)(xs1), jacfwd(r)(xs1), **TOL)
    h = hessian(loss(d))(x)
    torch.testing.assert_close(h, hessian(loss(r))(x), **TOL)
    assert h.abs().sum() > 0


def test_function_under_transforms():
    f = dt.function("layernorm")
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((4, 5), (5,), (5,)))

    def ours(x, w):
        return f(x, w, b, eps=1e-3).pow(3).sum()

    def theirs(x, w):
        return torch.nn.functional.layer_norm(x, (5,), w, b, 1e-3).pow(3).sum()

    for argnums in (0, 1, (0, 1)):
        got, want = grad(ours, argnums)(x, w), grad(theirs, argnums)(x, w)
        torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(hessian(ours, 1)(x, w), hessian(theirs, 1)(x, w), **TOL)


def test_every_layer_jacobian_under_torch_func_matches_the_kernels():
    """torch.func's Jacobian (the generated PyTorch forward) equals autograd's through the C
    kernels, for every catalogue layer and mode."""
    from torch_cases import arguments

    from derivgen.torch.ops import layer

    for name in derivgen.names():
        lay = layer(name)
        for mode in lay.meta.modes:
            x, params, inputs, options, buffers, groups = arguments(lay, mode, requires_grad=False)

            def f(x, lay=lay, mode=mode, params=params, inputs=inputs, options=options, buffers=buffers, groups=groups):
                return lay.forward(
                    x, params, inputs, options, training=mode == "train", buffers=buffers, num_groups=groups
                )[0]

            want = torch.autograd.functional.jacobian(f, x)
            torch.testing.assert_close(jacrev(f)(x), want, **TOL, msg=f"{name} {mode}")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.fc1 = nn.Linear(4 * 5, 8)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)
        self.rms = nn.RMSNorm(3)

    def forward(self, x):
        h = torch.tanh(self.gn(self.conv(x))).flatten(-2)
        return self.rms(self.fc2(torch.tanh(self.ln(self.fc1(h)))))


def test_per_sample_gradients_equal_torch_nn():
    torch.manual_seed(4)
    ref = _Net().double()
    ours = dt.convert(copy.deepcopy(ref))
    assert isinstance(ours.ln, dt.LayerNorm) and isinstance(ours.gn, dt.GroupNorm)
    assert isinstance(ours.rms, dt.RMSNorm)
    x = torch.randn(6, 2, 5, dtype=torch.float64)
    target = torch.randn(6, 3, dtype=torch.float64)

    def per_sample(model):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, xi, ti):
            out = functional_call(model, p, (xi.unsqueeze(0),))
            return ((out.squeeze(0) - ti) ** 2).sum()

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)

    got, want = per_sample(ours), per_sample(ref)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)
        assert got[k].shape[0] == 6
    # the per-sample gradients sum to the batch gradient
    ref.zero_grad()
    ((ref(x) - target) ** 2).sum().backward()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(got[k].sum(0), p.grad, **TOL)


def test_parametrized_weight_is_used():
    """The per-call path reads parameters from the module's own dict; a parametrized weight
    (torch.nn.utils.parametrize) lives elsewhere and must still be the one used."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w + 1

    x = torch.randn(3, 4, dtype=torch.float64)
    for ours, ref in ((dt.LayerNorm(4), nn.LayerNorm(4)), (dt.RMSNorm(4), nn.RMSNorm(4))):
        ours, ref = ours.double(), ref.double()
        parametrize.register_parametrization(ours, "weight", Double())
        parametrize.register_parametrization(ref, "weight", Double())
        torch.testing.assert_close(ours(x), ref(x), **TOL)
