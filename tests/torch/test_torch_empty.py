"""Empty batches as torch.nn treats them: empty outputs, zero parameter gradients and running
buffers left as they are, in every layer and mode of derivgen.torch (the NumPy and C
modules: tests/runtime/test_empty.py); and a derivgen.torch.Module's options checked when
it is constructed."""

from __future__ import annotations

import copy

import pytest
from conftest import require_module

torch = require_module("torch")
from torch import nn

import derivgen
import derivgen.torch as dt

CASES = [
    ("LayerNorm", lambda: nn.LayerNorm(6), (0, 6)),
    ("LayerNorm-3d", lambda: nn.LayerNorm(6), (2, 0, 6)),
    ("LayerNorm-no-features", lambda: nn.LayerNorm((3, 0)), (2, 3, 0)),
    ("RMSNorm", lambda: nn.RMSNorm(6), (0, 6)),
    ("BatchNorm1d", lambda: nn.BatchNorm1d(3), (0, 3)),
    ("BatchNorm2d", lambda: nn.BatchNorm2d(3), (0, 3, 2, 2)),
    ("BatchNorm2d-no-pixels", lambda: nn.BatchNorm2d(3), (2, 3, 0, 2)),
    ("BatchNorm2d-momentum-None", lambda: nn.BatchNorm2d(3, momentum=None), (0, 3, 2, 2)),
    ("GroupNorm", lambda: nn.GroupNorm(2, 4), (0, 4, 3)),
]


def _run(m, x):
    y = m(x)
    (y * 2.0).sum().backward()
    return y, {k: None if p.grad is None else p.grad.clone() for k, p in m.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("make", "shape"), [pytest.param(m, s, id=n) for n, m, s in CASES])
def test_empty_batch_like_torch_nn(make, shape, training, dtype):
    torch.manual_seed(0)
    ref = make().to(dtype).train(training)
    with torch.no_grad():
        for b in ref.buffers():  # running statistics off their initial values
            if b.is_floating_point():
                b.add_(0.25)
    ours = dt.convert(copy.deepcopy(ref))
    assert type(ours) is not type(ref)
    x1 = torch.randn(shape, dtype=dtype, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y1, g1 = _run(ours, x1)
    y2, g2 = _run(ref, x2)
    assert y1.shape == y2.shape == x1.shape and y1.dtype == dtype and y1.numel() == 0
    assert x1.grad is not None and x1.grad.shape == x1.shape
    assert g1.keys() == g2.keys()
    for k in g2:
        assert g1[k] is not None, k
        torch.testing.assert_close(g1[k], g2[k], atol=0, rtol=0)
    for (k, b1), (_, b2) in zip(ours.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b1, b2, atol=0, rtol=0, msg=k)


@pytest.mark.parametrize("track", [False, True], ids=["batch-stats", "running-stats"])
def test_instance_norm_on_an_empty_batch(track):
    """torch.nn's InstanceNorm raises IndexError on an empty batch (torch 2.13); derivgen's
    returns the empty output, zero parameter gradients, and leaves the running statistics
    as they are."""
    m = dt.InstanceNorm1d(3, affine=True, track_running_stats=track)
    before = [b.clone() for b in m.buffers()]
    for training in (True, False):
        m.train(training)
        x = torch.randn(0, 3, 4, requires_grad=True)
        m.weight.grad = None
        y = m(x)
        y.sum().backward()
        assert y.shape == (0, 3, 4)
        assert torch.equal(m.weight.grad, torch.zeros(3))
    for b, b0 in zip(m.buffers(), before):
        assert torch.equal(b, b0)


def test_empty_through_every_layer_and_torch_path():
    """Every catalogue layer and mode: through the C kernels, the device-agnostic path and
    torch.func, an empty x gives an empty y and zero gradients."""
    from torch_cases import arguments

    from derivgen.torch.ops import layer

    for name in derivgen.names():
        lay = layer(name)
        for mode in lay.meta.modes:
            x, params, inputs, options, buffers, groups = arguments(lay, mode, requires_grad=False)
            x = x[:0].clone().requires_grad_(True)
            inputs = {i: v[:0] if v.dim() and lay.meta.layout != "channels" else v for i, v in inputs.items()}
            if lay.meta.reduce in ("instance", "group"):
                inputs = {i: v[:0] if v.numel() > 1 else v for i, v in inputs.items()}
            for p in params.values():
                p.requires_grad_(True)
            for path in ("c", "portable"):
                with dt.portable(path == "portable"):
                    y, _ = lay.forward(
                        x, params, inputs, options, training=mode == "train", buffers=buffers, num_groups=groups
                    )
                assert y.shape == x.shape, (name, mode, path)
                grads = torch.autograd.grad(y.sum(), [x, *params.values()])
                assert grads[0].shape == x.shape
                for gp in grads[1:]:
                    assert torch.count_nonzero(gp) == 0, (name, mode, path)


def test_module_options_checked_at_construction():
    with pytest.raises(ValueError, match=r"layernorm: option eps must lie in \[0\.0, inf\], got -1\.0"):
        dt.Module("layernorm", 8, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be finite"):
        dt.Module("layernorm", 8, eps=float("nan"))
    with pytest.raises(TypeError, match="eps must be a real number, got str"):
        dt.Module("layernorm", 8, eps="1e-5")
    with pytest.raises(ValueError, match="momentum must lie in"):
        dt.Module("batchnorm", 3, momentum=1.5)
    with pytest.raises(ValueError, match="alpha"):
        dt.OnlineLayerNorm(8, alpha=-2.0)
    m = dt.Module("layernorm", 8, eps=0.25)
    assert m.eps == 0.25 and isinstance(m.eps, float)
