"""The device-agnostic path: ``derivgen.load(name, backend="torch")`` (the NumPy and C
modules' calling convention on tensors) against the C modules; the operators' kernels for
devices without compiled ones (CompositeExplicitAutograd) against their CPU kernels;
``dt.portable()`` training a converted model as the C kernels do; the meta device; and
CUDA where a GPU is expected (DERIVGEN_EXPECT_CUDA=1) or present."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
from conftest import require_module

torch = require_module("torch")
from torch import nn
from torch_cases import arguments

import derivgen
import derivgen.torch as dt
from derivgen.torch.generic import forced
from derivgen.torch.ops import layer

TOL = {"atol": 1e-10, "rtol": 1e-9}


def _numpy_call(meta, x, params, inputs, options, buffers, groups, mode):
    kw = dict(options)
    if meta["reduce"] == "group":
        kw["num_groups"] = groups
    kw.update(inputs)
    kw.update(buffers)
    if "eval" in meta["modes"]:
        kw["training"] = mode == "train"
    return kw


@pytest.mark.parametrize("name", derivgen.names())
def test_torch_backend_matches_c(name):
    """forward, backward, backward_backward, jvp and the running buffers of the torch
    backend equal the C module's, in every mode; float32 and bfloat16 are close."""
    mc, mt = derivgen.load(name, "c"), derivgen.load(name, backend="torch")
    meta = mc._META
    lay = layer(name)
    for mode in meta["modes"]:
        x, params, inputs, options, buffers, groups = arguments(lay, mode, requires_grad=False)
        if mode == "train" and meta["buffers"]:
            buffers = {b: torch.rand(meta_shape, dtype=torch.float64) + 0.5 for b, meta_shape in _buf_shapes(meta, x)}
        nb = {k: v.numpy().copy() for k, v in buffers.items()}
        tb = {k: v.clone() for k, v in buffers.items()}
        kw_np = _numpy_call(meta, x, {}, {k: v.numpy() for k, v in inputs.items()}, options, nb, groups, mode)
        kw_t = _numpy_call(meta, x, {}, inputs, options, tb, groups, mode)
        y, c = mc.forward(x.numpy(), *(p.numpy() for p in params.values()), **kw_np)
        yt, ct = mt.forward(x, *params.values(), **kw_t)
        assert isinstance(yt, torch.Tensor)
        torch.testing.assert_close(yt, torch.from_numpy(y), **TOL)
        for k, v in nb.items():
            torch.testing.assert_close(tb[k], torch.from_numpy(v), **TOL)
        for s in meta["stats"][mode]:
            torch.testing.assert_close(getattr(ct, s), torch.from_numpy(np.asarray(getattr(c, s))), **TOL)
        dy = torch.randn(x.shape, dtype=torch.float64)
        g, gt = mc.backward(dy.numpy(), c), mt.backward(dy, ct)
        assert type(gt).__name__ == type(g).__name__ and gt._fields == g._fields
        for a, b in zip(g, gt):
            torch.testing.assert_close(b, torch.as_tensor(a), **TOL)
        dd = torch.randn(x.shape, dtype=torch.float64)
        ddp = {p: torch.randn(v.shape, dtype=torch.float64) for p, v in params.items()}
        s, st = (
            mc.backward_backward(dy.numpy(), c, dd.numpy(), {k: v.numpy() for k, v in ddp.items()}),
            mt.backward_backward(dy, ct, dd, ddp),
        )
        for a, b in zip(s, st):
            torch.testing.assert_close(b, torch.as_tensor(a), **TOL)
        j, jt = mc.jvp(c, dd.numpy(), {k: v.numpy() for k, v in ddp.items()}), mt.jvp(ct, dd, ddp)
        torch.testing.assert_close(jt, torch.from_numpy(j), **TOL)
        # low precision: computed in float32, returned in the input's dtype
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            conv = {k: v.to(dtype) for k, v in buffers.items()} if mode == "eval" else {}
            kw_l = _numpy_call(meta, x, {}, {k: v.to(dtype) for k, v in inputs.items()}, options, conv, groups, mode)
            yl, cl = mt.forward(x.to(dtype), *(p.to(dtype) for p in params.values()), **kw_l)
            assert yl.dtype == dtype
            torch.testing.assert_close(yl.double(), yt, atol=tol * 10, rtol=tol)
            gl = mt.backward(dy.to(dtype), cl)
            assert gl.dx.dtype == dtype


def _buf_shapes(meta, x):
    c = x.shape[1]
    return [(b, (c,)) for b in meta["buffers"]]


def test_torch_backend_errors_and_outputs():
    m = derivgen.load("layernorm", backend="torch")
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="eps must lie in"):
        m.forward(x, torch.ones(4), torch.zeros(4), eps=-1.0)
    with pytest.raises(ValueError, match="gamma has shape"):
        m.forward(x, torch.ones(5), torch.zeros(5))
    with pytest.raises(TypeError, match="beta has dtype"):
        m.forward(x, torch.ones(4), torch.zeros(4, dtype=torch.float64))
    out = torch.empty(3, 4)
    y, cache = m.forward(x, torch.ones(4), torch.zeros(4), out=out)
    assert y is out
    with pytest.raises(ValueError, match="dy must have the shape and dtype of x"):
        m.backward(torch.ones(3, 5), cache)
    # recorded by autograd: the forward differentiates like torch.nn's layer_norm
    xr = x.clone().requires_grad_(True)
    y, _ = m.forward(xr, torch.ones(4), torch.zeros(4))
    (gx,) = torch.autograd.grad((y**3).sum(), xr)
    xr2 = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad((torch.nn.functional.layer_norm(xr2, (4,)) ** 3).sum(), xr2)
    torch.testing.assert_close(gx, want)


def _ops_args(lay, mode):
    x, params, inputs, options, buffers, groups = arguments(lay, mode, requires_grad=False)
    tens = [x, *params.values(), *inputs.values(), *(buffers.values() if mode == "eval" else ())]
    opts = [float(options[o]) for o in lay.options]
    return tens, opts, groups


def test_composite_kernels_match_cpu_kernels():
    """Every catalogue layer's four operators: the CompositeExplicitAutograd kernels (any
    device without compiled kernels), called on CPU tensors by redispatch, equal the CPU kernels."""
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    for name in derivgen.names():
        lay = layer(name)
        for mode, ops in lay.modes.items():
            opname = f"derivgen::{lay.base}_{mode}_forward"
            assert torch._C._dispatch_has_kernel_for_dispatch_key(opname, "CompositeExplicitAutograd")
            tens, opts, groups = _ops_args(lay, mode)
            want = ops.forward(*tens, *opts, groups)
            got = ops.forward.redispatch(ks, *tens, *opts, groups)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype
                torch.testing.assert_close(a, b, **TOL)
            stats = want[1:]
            dy = torch.randn(tens[0].shape, dtype=torch.float64)
            bw = ops.backward(dy, *tens, *stats, *opts, groups)
            bg = ops.backward.redispatch(ks, dy, *tens, *stats, *opts, groups)
            for a, b in zip(_tup(bg), _tup(bw)):
                torch.testing.assert_close(a, b, **TOL)
            n = 1 + len(lay.params) + len(lay.inputs)
            seeds = [torch.randn(t.shape, dtype=torch.float64) for t in tens[:n]]
            bbw = ops.bb(dy, *tens, *stats, *seeds, *opts, groups)
            bbg = ops.bb.redispatch(ks, dy, *tens, *stats, *seeds, *opts, groups)
            for a, b in zip(bbg, bbw):
                torch.testing.assert_close(a, b, **TOL)
            jw = ops.jvp(*tens, *stats, *seeds, *opts, groups)
            jg = ops.jvp.redispatch(ks, *tens, *stats, *seeds, *opts, groups)
            torch.testing.assert_close(jg, jw, **TOL)


def _tup(v):
    return (v,) if isinstance(v, torch.Tensor) else tuple(v)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 9, 6)
        self.ln = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)

    def forward(self, x):
        h = self.gn(torch.relu(self.bn(self.conv(x)))).flatten(1)
        return self.rms(torch.tanh(self.ln(self.fc(h))))


def _train(model, portable: bool, steps: int = 3):
    torch.manual_seed(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        x = torch.randn(5, 2, 3, 3, dtype=torch.float64)
        with dt.portable(portable):
            loss = (model(x) ** 2).mean()
            opt.zero_grad()
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_portable_path_trains_like_the_kernels_and_torch_nn():
    torch.manual_seed(5)
    ref = _Net().double()
    a, b = dt.convert(copy.deepcopy(ref)), dt.convert(copy.deepcopy(ref))
    la, lb, lr = _train(a, False), _train(b, True), _train(ref, False)
    np.testing.assert_allclose(la, lr, rtol=1e-10)
    np.testing.assert_allclose(lb, lr, rtol=1e-10)
    for (k, p), (_, q) in zip(b.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(p, q, **TOL, msg=k)


def test_portable_second_order_and_forward_mode():
    m = dt.LayerNorm(5).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    with dt.portable():
        assert torch.autograd.gradcheck(m, (x,))
        assert torch.autograd.gradgradcheck(m, (x,))
        assert torch.autograd.gradcheck(m, (x,), check_forward_ad=True, check_backward_ad=False)
    assert not forced()  # restored on leaving the block


def test_meta_device():
    for m, shape in ((dt.LayerNorm(8, device="meta"), (4, 8)), (dt.BatchNorm2d(3, device="meta"), (2, 3, 4, 4))):
        x = torch.empty(shape, device="meta", requires_grad=True)
        y = m(x)
        assert y.device.type == "meta" and y.shape == x.shape
        y.sum().backward()
        assert m.weight.grad.device.type == "meta" and m.weight.grad.shape == m.weight.shape


def test_a_parameter_on_another_device_is_named():
    """A CPU x with a meta-device parameter: one error naming the parameter and both devices
    (not a NumPy TypeError from reading the meta tensor), in float32 and bfloat16."""
    for dt_ in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 16, dtype=dt_)
        gamma, beta = torch.ones(16, device="meta", dtype=dt_), torch.zeros(16, dtype=dt_)
        with pytest.raises(ValueError, match=r"layernorm: gamma is on meta but x is on cpu; use one device"):
            dt.function("layernorm")(x, gamma, beta)


def test_cuda_when_expected():
    """On a machine with CUDA (required with DERIVGEN_EXPECT_CUDA=1): a converted model
    runs through the device-agnostic operators and matches torch.nn."""
    if not torch.cuda.is_available():
        if os.environ.get("DERIVGEN_EXPECT_CUDA") == "1":
            pytest.fail("DERIVGEN_EXPECT_CUDA=1 but torch.cuda.is_available() is False")
        pytest.skip("no CUDA device (set DERIVGEN_EXPECT_CUDA=1 where one is expected)")
    torch.manual_seed(6)
    ref = _Net().cuda()
    ours = dt.convert(copy.deepcopy(ref))
    x = torch.randn(5, 2, 3, 3, device="cuda")
    ya, yb = ours(x), ref(x)
    torch.testing.assert_close(ya, yb, atol=1e-4, rtol=1e-4)
    ya.sum().backward()
    yb.sum().backward()
    for (k, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-3, msg=k)


def test_float16_on_cpu_runs_the_closed_forms():
    """float16 has no C kernels: CPU tensors take the device-agnostic path (computed in
    float32, returned in float16), close to torch.nn's float16 results."""
    torch.manual_seed(8)
    for ref, shape in ((nn.LayerNorm(16), (4, 16)), (nn.BatchNorm2d(3), (4, 3, 2, 2)), (nn.GroupNorm(2, 4), (2, 4, 3))):
        ref = ref.half()
        ours = dt.convert(copy.deepcopy(ref))
        x = torch.randn(shape, dtype=torch.float16)
        x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y1, y2 = ours(x1), ref(x2)
        assert y1.dtype == torch.float16
        torch.testing.assert_close(y1, y2, atol=2e-3, rtol=2e-3)
        y1.float().pow(2).sum().backward()
        y2.float().pow(2).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=5e-2, rtol=2e-2)
        for b1, b2 in zip(ours.buffers(), ref.buffers()):
            torch.testing.assert_close(b1, b2, atol=2e-3, rtol=2e-3)
