"""derivgen.torch modules of regression specs (tests/regressions/) whose bug was in derivgen.torch:
each against an independent PyTorch forward, on each path an eager call takes."""

from __future__ import annotations

import pytest
from conftest import QUICK_CFLAGS, ROOT, require_module, require_torch_extension

torch = require_module("torch")
import torch.autograd.forward_ad as fwad

import derivgen.torch as dt
from derivgen.torch import ext
from derivgen.torch.ops import layer

OPTIONS_ONLY = ROOT / "tests" / "regressions" / "second_order_options_only.toml"


@pytest.mark.parametrize("path", ["extension", "python"])
def test_options_only_layer_second_order(path, monkeypatch):
    """second_order_options_only (c*tanh(x/c): an option, no parameters, no per-group inputs,
    no statistics): the double backward through the module (gradgradcheck, and against
    autograd of c*tanh(x/c)) on the C++ extension's node and on the Python per-call path,
    and forward mode (dual numbers, torch.func.jvp). The extension's node returned one
    gradient per row of dx (x.shape[0] of them) where autograd expected one."""
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)  # built as the regression specs' tests build it
    require_torch_extension()
    c = 1.5
    m = dt.Module(OPTIONS_ONLY, 5, c=c)
    lay = layer(OPTIONS_ONLY)
    if path == "python":
        monkeypatch.setattr(ext, "module", lambda: None)
        monkeypatch.setattr(lay.plans, "_plans", {})
        monkeypatch.setattr(lay.plans, "last_ext", {})
    g = torch.Generator().manual_seed(0)
    x, dy, v, t = (torch.randn(3, 4, 5, generator=g, dtype=torch.float64) * 2 for _ in range(4))
    x.requires_grad_()
    dy.requires_grad_()

    def ref(x):
        return c * torch.tanh(x / c)

    y = m(x)
    assert y.grad_fn.name() == ("DerivgenBackward" if path == "extension" else "_EagerBackward")
    torch.testing.assert_close(y, ref(x), rtol=1e-12, atol=1e-12)
    (dx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    (ref_dx,) = torch.autograd.grad(ref(x), x, dy, create_graph=True)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((dx * v).sum(), [x, dy])
    want = torch.autograd.grad((ref_dx * v).sum(), [x, dy])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradgradcheck(m, (x,))
    with fwad.dual_level():
        ty = fwad.unpack_dual(m(fwad.make_dual(x.detach(), t))).tangent
    want_ty = torch.func.jvp(ref, (x.detach(),), (t,))[1]
    torch.testing.assert_close(ty, want_ty, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.func.jvp(m, (x.detach(),), (t,))[1], want_ty, rtol=1e-10, atol=1e-12)
