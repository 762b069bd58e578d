"""derivgen.from_torch on timm's own normalization layers (LayerNorm2d: x permuted to channels
last around F.layer_norm; EvoNorm2dS0: x's channels reshaped into groups; FRN + TLU: per-channel
parameters over spatial statistics; GroupNorm1), and convert on a ConvNeXt-style network made of
timm's LayerNorm2d: each derives to the zoo's or catalogue's closed form and reduction count,
and matches the original's forward and autograd backward (float64); the network trains as the
original. The classes are timm's installed files (tests/importer/timm_layers.py says how they
load without torchvision)."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
from conftest import require_module
from test_torch_import import casts_kept_in_float64
from test_torch_import_multi import _closed_forms_same
from timm_layers import timm_class

import derivgen
from derivgen.spec import parse_spec
from derivgen.spec.from_torch import from_torch, from_torch_toml

torch = require_module("torch")
nn = torch.nn

# timm file, class, constructor arguments, example shape, the hand-written spec, num_groups
CASES = {
    "LayerNorm2d": ("norm", "LayerNorm2d", (6,), {}, (2, 6, 3, 4), "layernorm2d", None),
    "EvoNorm2dS0": ("evo_norm", "EvoNorm2dS0", (8,), {"group_size": 4}, (2, 8, 3, 4), "evonorm_s0", 2),
    "FilterResponseNormTlu2d": ("filter_response_norm", "FilterResponseNormTlu2d", (5,), {}, (2, 5, 3, 4), "frn", None),
    "GroupNorm1": ("norm", "GroupNorm1", (6,), {}, (2, 6, 3, 4), "groupnorm", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_timm_layer_imports_derives_and_matches(case):
    file, cls, args, kwargs, shape, reference, groups = CASES[case]
    module = timm_class(file, cls)(*args, **kwargs).double()
    assert type(module).__module__ == f"timm.layers.{file}"
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    start = time.perf_counter()
    spec = from_torch(module, shape)
    took = time.perf_counter() - start
    assert parse_spec(from_torch_toml(module, shape), source=spec.source) == spec
    mine, theirs = derivgen.derive(spec), derivgen.derive(reference)
    assert (spec.layout, spec.reduce) == (theirs.spec.layout, theirs.spec.reduce)
    assert mine.train.reduction_counts == theirs.train.reduction_counts, case
    assert _closed_forms_same(mine, theirs), (case, mine.train.dx, theirs.train.dx)

    k = derivgen.load(spec, backend="numpy")
    params = dict(module.named_parameters())
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    extra = {"num_groups": groups} if groups else {}
    y, cache = k.forward(x.numpy(), *[params[p.name].detach().numpy().reshape(-1) for p in spec.params], **extra)
    grads = k.backward(dy.numpy(), cache)
    xt = x.clone().requires_grad_(True)
    with casts_kept_in_float64():
        yt = module(xt)
    yt.backward(dy)
    assert np.abs(y - yt.detach().numpy()).max() < 1e-10, case
    assert np.abs(grads.dx - xt.grad.numpy()).max() < 1e-10, case
    for p in spec.params:
        got = np.asarray(getattr(grads, "d" + p.name)).reshape(-1)
        assert np.abs(got - params[p.name].grad.numpy().reshape(-1)).max() < 1e-10, (case, p.name)
    print(f"{case}: imported in {took:.2f} s, reductions {mine.train.reduction_summary}")


def convnext_style(layer_norm_2d):
    """A small ConvNeXt (Liu et al. 2022, timm's convnext.py: stem, blocks of a 7x7 depthwise
    conv, LayerNorm2d, an inverted MLP as 1x1 convs with GELU, layer scale, residual), with
    timm's LayerNorm2d, in float64."""

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
            self.norm = layer_norm_2d(dim)
            self.fc1 = nn.Conv2d(dim, 4 * dim, 1)
            self.act = nn.GELU()
            self.fc2 = nn.Conv2d(4 * dim, dim, 1)
            self.gamma = nn.Parameter(torch.full((dim, 1, 1), 0.5))

        def forward(self, x):
            return x + self.gamma * self.fc2(self.act(self.fc1(self.norm(self.conv_dw(x)))))

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 4, stride=4),
        layer_norm_2d(8),
        Block(8),
        Block(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.LayerNorm(8),
        nn.Linear(8, 5),
    ).double()


def test_convnext_style_network_converts_in_one_call_and_trains_as_the_original():
    dt = pytest.importorskip("derivgen.torch")

    ref = convnext_style(timm_class("norm", "LayerNorm2d"))
    ours = copy.deepcopy(ref)
    torch.manual_seed(1)
    images, labels = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (4,))
    report = dt.ConvertReport()
    dt.convert(ours, import_unknown=True, example_inputs=(images,), report=report)
    norms = [p for p, m in ref.named_modules() if type(m).__name__ == "LayerNorm2d"]
    assert len(norms) == 3
    assert all(report.replaced.get(p) == "layer_norm2d" for p in norms), str(report)
    assert report.replaced["6"] == "layernorm"  # torch.nn's, by the known twins
    assert "an activation" in report.left["2.act"]  # no statistics, no parameters: left, with the reason
    assert list(ours.state_dict()) == list(ref.state_dict())

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    want, got = train(ref), train(ours)
    assert want[-1] < want[0]
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-10, (want, got)
