"""derivgen.from_torch: torch.nn layers, transformers' own RMSNorm (Llama), T5 layer norm,
Gemma (1 + w) RMSNorm and OLMo layer norm, and DyT imported as specs through torch.export; each
derives to the hand-written spec's closed form and reduction count, and the module generated
from it equals the original torch module's forward and autograd backward in float64. What no
spec can say is refused with one line naming the operation and its source line."""

from __future__ import annotations

import contextlib
import importlib
import time

import numpy as np
import pytest
from conftest import require_module

import derivgen
from derivgen.spec import SpecError, parse_spec
from derivgen.spec.from_torch import TorchImportError, from_torch, from_torch_toml, import_command_main

torch = require_module("torch")
nn = torch.nn


# -- the layers as their libraries write them: transformers' real classes (imported when a case
# runs: skipped where transformers is missing, a failure under CI=true); DyT copied from
# github.com/jiachenzhu/DyT, dynamic_tanh.py -------------------------------------------------
TRANSFORMERS = {
    "LlamaRMSNorm": "llama.modeling_llama",
    "GemmaRMSNorm": "gemma.modeling_gemma",
    "T5LayerNorm": "t5.modeling_t5",
    "OlmoLayerNorm": "olmo.modeling_olmo",
}


def transformers_class(name: str):
    """transformers' own class ``name`` (models/<model>/modeling_<model>.py)."""
    require_module("transformers")
    return getattr(importlib.import_module(f"transformers.models.{TRANSFORMERS[name]}"), name)


def hf(name: str, *args, **kwargs):
    return lambda: transformers_class(name)(*args, **kwargs)


class DynamicTanh(nn.Module):
    def __init__(self, normalized_shape, channels_last, alpha_init_value=0.5):
        super().__init__()
        self.normalized_shape = normalized_shape
        self.alpha_init_value = alpha_init_value
        self.channels_last = channels_last
        self.alpha = nn.Parameter(torch.ones(1) * alpha_init_value)
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x):
        x = torch.tanh(self.alpha * x)
        if self.channels_last:
            x = x * self.weight + self.bias
        else:
            x = x * self.weight[:, None, None] + self.bias[:, None, None]
        return x


# class, constructor, example shape, the hand-written spec, forward keywords of the generated module
CASES = {
    "torch.nn.LayerNorm": (lambda: nn.LayerNorm(8), (3, 8), "layernorm", {}),
    "torch.nn.RMSNorm": (lambda: nn.RMSNorm(8, eps=1e-6), (3, 8), "rmsnorm", {}),
    "torch.nn.RMSNorm(eps=None)": (lambda: nn.RMSNorm(8), (3, 8), "rmsnorm", {}),
    "torch.nn.GroupNorm": (lambda: nn.GroupNorm(2, 4), (2, 4, 5), "groupnorm", {"num_groups": 2}),
    "LlamaRMSNorm": (hf("LlamaRMSNorm", 8), (3, 8), "rmsnorm", {}),
    "GemmaRMSNorm": (hf("GemmaRMSNorm", 8), (3, 8), "gemma_rmsnorm", {}),
    "T5LayerNorm": (hf("T5LayerNorm", 8), (3, 8), "rmsnorm", {}),
    "OlmoLayerNorm": (hf("OlmoLayerNorm", 8), (3, 8), "layernorm_simple", {}),
    "DynamicTanh": (lambda: DynamicTanh(8, channels_last=True), (3, 8), "dynamic_tanh", {}),
    "torch.nn.BatchNorm1d": (lambda: nn.BatchNorm1d(4), (6, 4), "batchnorm", {}),
    "torch.nn.BatchNorm2d": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 5), "batchnorm", {}),
    "torch.nn.BatchNorm2d.eval()": (lambda: nn.BatchNorm2d(3).eval(), (2, 3, 4, 5), "batchnorm", {}),
    "torch.nn.InstanceNorm2d": (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 4, 5), "instancenorm", {}),
    "torch.nn.LocalResponseNorm": (lambda: nn.LocalResponseNorm(3), (2, 6, 3, 4), "lrn", {}),
    "torch.nn.LocalResponseNorm(size=4), 3-d": (lambda: nn.LocalResponseNorm(4, k=2.0), (2, 7, 5), "lrn", {}),
    "torch.softmax": (lambda: lambda x: torch.softmax(x, dim=-1), (3, 8), "softmax", {}),
    "torch.log_softmax": (lambda: lambda x: torch.log_softmax(x, -1), (3, 8), "log_softmax", {}),
}


@contextlib.contextmanager
def casts_kept_in_float64():
    """The layers' float32 casts as no-ops on float64 tensors: the original's arithmetic in
    float64, to compare with the spec's (which drops the casts) at 1e-10."""
    to, flt = torch.Tensor.to, torch.Tensor.float

    def keep_to(self, *args, **kwargs):
        if self.dtype == torch.float64 and (
            (args and args[0] is torch.float32) or kwargs.get("dtype") is torch.float32
        ):
            return self
        return to(self, *args, **kwargs)

    torch.Tensor.to = keep_to
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else flt(self, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float = to, flt


def _randomized(module):
    """The module in float64 with parameters (and running statistics) away from their inits
    (so each gradient shows); a function as it is."""
    if not isinstance(module, nn.Module):
        return module
    module = module.double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in module.named_buffers():
            if b.is_floating_point():
                b.add_(0.3 * torch.rand(b.shape, generator=gen, dtype=b.dtype))
    return module


def _closed_form_same(imported, handwritten) -> bool:
    """dx of the training mode, the imported spec's names mapped onto the hand-written one's
    by position (parameters, options, statistics, the normalized coordinate)."""
    a, b = imported.spec, handwritten.spec
    pairs = list(zip(a.params, b.params)) + _by_name_then_position(a.options, b.options)
    pairs += list(zip(a.buffers, b.buffers))
    pairs += list(zip(a.modes[0].statistics, b.modes[0].statistics))
    if imported.train.coordinate and handwritten.train.coordinate:  # named or implicit (Xn)
        pairs.append((imported.train.coordinate, handwritten.train.coordinate))
    rename = {p.symbol: q.symbol for p, q in pairs}
    for mode in handwritten.modes:  # every mode: batch norm's eval mode too
        mine, theirs = imported.modes[mode], handwritten.modes[mode]
        grads_a = [g.element + g.group for g in mine.grads.values()]
        grads_b = [g.element + g.group for g in theirs.grads.values()]
        if mine.dx.xreplace(rename) != theirs.dx or any(ga.xreplace(rename) != gb for ga, gb in zip(grads_a, grads_b)):
            return False
    return set(imported.modes) == set(handwritten.modes)


def _by_name_then_position(mine, theirs) -> list:
    """Options with the same name paired (LRN's alpha, beta, k in another order), the rest by position."""
    names = {o.name for o in mine} & {o.name for o in theirs}
    pairs = [(o, next(t for t in theirs if t.name == o.name)) for o in mine if o.name in names]
    return pairs + list(zip([o for o in mine if o.name not in names], [t for t in theirs if t.name not in names]))


@pytest.mark.parametrize("case", list(CASES))
def test_imports_derives_and_matches(case):
    make, shape, reference, kwargs = CASES[case]
    module = _randomized(make())
    start = time.perf_counter()
    spec = from_torch(module, torch.zeros(shape, dtype=torch.float64))
    took = time.perf_counter() - start
    # the TOML round-trips: parsed again, the same spec
    text = from_torch_toml(module, shape)
    assert parse_spec(text, source=spec.source) == spec
    if case in TRANSFORMERS:  # the real class, its float32 casts recorded
        assert type(module).__module__.startswith("transformers.models."), type(module)
        assert "computes in float32" in text
    # the derivation: the hand-written spec's reductions and closed form
    mine, theirs = derivgen.derive(spec), derivgen.derive(reference)
    assert mine.train.reduction_counts == theirs.train.reduction_counts, case
    assert _closed_form_same(mine, theirs), (case, mine.train.dx, theirs.train.dx)
    # the generated module against the torch module: forward and autograd backward, float64
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape)
    dy = rng.normal(size=shape)
    params = dict(module.named_parameters()) if isinstance(module, nn.Module) else {}
    buffers = {n: b.detach().numpy().copy() for n, b in module.named_buffers()} if params else {}
    if spec.buffers:  # batch norm: the running statistics, updated in training mode, read in eval mode
        kwargs = {**kwargs, "training": module.training, **{b.name: buffers[b.name] for b in spec.buffers}}
    k = derivgen.load(spec, backend="numpy")
    args = [params[p.name].detach().numpy().reshape(-1 if not p.scalar else ()) for p in spec.params]
    if spec.layout == "trailing":
        args = [params[p.name].detach().numpy() if not p.scalar else a for p, a in zip(spec.params, args)]
    y, cache = k.forward(x, *args, **kwargs)
    grads = k.backward(dy, cache)
    xt = torch.tensor(x, requires_grad=True)
    with casts_kept_in_float64():
        yt = module(xt)
    yt.backward(torch.tensor(dy))
    assert np.abs(y - yt.detach().numpy()).max() < 1e-10, case
    assert np.abs(grads.dx - xt.grad.numpy()).max() < 1e-10, case
    for p in spec.params:
        got = np.asarray(getattr(grads, "d" + p.name)).reshape(-1)
        want = params[p.name].grad.numpy().reshape(-1)
        assert np.abs(got - want).max() < 1e-10, (case, p.name)
    for b in spec.buffers:  # updated in place by both (training), read by both (eval)
        assert np.abs(buffers[b.name] - getattr(module, b.name).numpy()).max() < 1e-10, (case, b.name)
    print(f"{case}: imported in {took:.2f} s, reductions {mine.train.reduction_summary}")


def test_names_options_and_casts():
    text = from_torch_toml(transformers_class("LlamaRMSNorm")(8, eps=1e-5), (2, 8))
    assert 'variance = "mean(x**2)"' in text  # the source's variable
    assert "variance_epsilon = { default = 1e-05, min = 0 }" in text  # the module's attribute
    assert "weight = " in text
    assert "LlamaRMSNorm" in text.splitlines()[0]
    gn = from_torch(nn.GroupNorm(3, 6), (2, 6, 4))
    assert (gn.layout, gn.reduce) == ("channels", "group")
    bn = from_torch(nn.BatchNorm2d(3), (2, 3, 4, 4))  # float32 buffers, a float64 example: cast back
    assert [b.name for b in bn.buffers] == ["running_mean", "running_var"]


def test_a_function_imports():
    def rms(x):
        return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-8)

    spec = from_torch(rms, (2, 8))
    assert [o.name for o in spec.options] == ["eps"] and spec.options[0].default == 1e-8
    assert derivgen.derive(spec).train.reduction_counts == {"group": 1}


# -- refusals: one line naming the operation and the source line ------------------------------
class Sorted(nn.Module):
    def forward(self, x):
        s = torch.sort(x, dim=-1).values
        return s / s.pow(2).mean(-1, keepdim=True)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.matmul(x, self.proj) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class InPlace(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SliceAssign(nn.Module):
    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        y[..., 0] = 0
        return y


class Cumulative(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, -1) - x.mean(-1, keepdim=True)


class TwoGroups(nn.Module):
    def forward(self, x):
        return x - x.mean(-1, keepdim=True) - x.mean(0, keepdim=True)


@pytest.fixture(scope="module")
def custom_op():
    lib = torch.library.Library("derivgen_test", "FRAGMENT")
    lib.define("squish(Tensor x) -> Tensor")
    lib.impl("squish", lambda x: x * 0.5, "CompositeExplicitAutograd")
    lib.impl("squish", lambda x: torch.empty_like(x), "Meta")
    yield torch.ops.derivgen_test.squish
    lib._destroy()


class Selected(nn.Module):
    def forward(self, x):
        return torch.where(x > 0, x, 0.1 * x) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


class RunningMean(nn.Module):  # a running statistic kept by hand, not batch norm's
    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


REFUSALS = {
    "sort": (Sorted, "torch.sort in forward, line", "no spec construct computes a sort"),
    "matmul": (Mixed, "in forward, line", "matrix product"),
    "branch": (Branchy, "`if x.sum() > 0:` in forward, line", "control flow on tensor values"),
    "in-place": (InPlace, "an in-place update of the input x in forward, line", "changes none of its inputs"),
    "slice assignment": (SliceAssign, "an assignment to part of a tensor in forward, line", "in-place update"),
    "cumsum": (Cumulative, "torch.cumsum in forward, line", "running sum"),
    "two groups": (TwoGroups, "torch.mean in forward, line", "one set of axes"),
    "where": (Selected, "torch.gt in forward, line", "a comparison of values"),
    "linear": (Linear, "in forward, line", "proj_weight"),
    "buffer update": (RunningMean, "an in-place update of the buffer ema in forward, line", "changes none"),
    "cumulative batch norm": (lambda: nn.BatchNorm1d(8, momentum=None), "BatchNorm1d", "momentum=None"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_in_one_line(case):
    cls, where, why = REFUSALS[case]
    with pytest.raises(TorchImportError) as info:
        from_torch(cls(), (2, 8))
    msg = str(info.value)
    assert "\n" not in msg and where in msg and why in msg, msg
    assert isinstance(info.value, SpecError)  # what the CLI prints without a traceback


def test_unknown_custom_op_refused(custom_op):
    def f(x):
        return custom_op(x) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))

    with pytest.raises(
        TorchImportError, match=r"^custom operator derivgen_test::squish in f \(defined at line \d+\): "
    ) as info:
        from_torch(f, (2, 8))
    assert "\n" not in str(info.value)


def test_import_command_main(tmp_path):
    path = tmp_path / "mylayers.py"
    path.write_text(
        "import torch\n\nclass Norm(torch.nn.Module):\n"
        "    def __init__(self, dim, eps=1e-6):\n        super().__init__()\n"
        "        self.weight = torch.nn.Parameter(torch.ones(dim))\n        self.eps = eps\n"
        "    def forward(self, x):\n"
        "        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)\n",
        encoding="utf-8",
    )
    text, seconds = import_command_main(f"{path}:Norm", (2, 16), (16,))
    assert 'name = "norm"' in text and seconds > 0
    with pytest.raises(TorchImportError, match="has no Missing"):
        import_command_main(f"{path}:Missing", (2, 16))


def test_import_derivgen_leaves_torch_alone():
    import subprocess
    import sys

    code = "import sys, derivgen; assert derivgen.from_torch; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- activations inside a layer: a block's fused form (act(w*x + b) + x) ----------------------
class ScaleActResidual(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.weight, self.bias, self.act = nn.Parameter(torch.ones(8)), nn.Parameter(torch.zeros(8)), act

    def forward(self, x):
        return self.act(self.weight * x + self.bias) + x


ACTIVATIONS = {
    "gelu": (nn.GELU(), "erf("),
    "gelu_tanh": (nn.GELU(approximate="tanh"), "tanh("),
    "silu": (nn.SiLU(), "sigmoid("),
}


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_activations_import(act):
    """GELU (exact and tanh) and SiLU become spec expressions; the imported layer's forward and
    backward equal torch autograd's in float64."""
    fn, spelled = ACTIVATIONS[act]
    module = _randomized(ScaleActResidual(fn))
    spec = from_torch(module, (3, 8))
    y_line = next(line for line in from_torch_toml(module, (3, 8)).splitlines() if line.startswith("y = "))
    assert spelled in y_line, y_line
    rng = np.random.default_rng(1)
    x, dy = rng.normal(size=(3, 8)) * 2, rng.normal(size=(3, 8))
    k = derivgen.load(spec, backend="numpy")
    w, b = (p.detach().numpy() for p in (module.weight, module.bias))
    y, cache = k.forward(x, w, b)
    grads = k.backward(dy, cache)
    xt = torch.tensor(x, requires_grad=True)
    yt = module(xt)
    yt.backward(torch.tensor(dy))
    assert np.abs(y - yt.detach().numpy()).max() < 1e-12
    assert np.abs(grads.dx - xt.grad.numpy()).max() < 1e-12
    assert np.abs(grads.dweight - module.weight.grad.numpy()).max() < 1e-12
    assert np.abs(grads.dbias - module.bias.grad.numpy()).max() < 1e-12
