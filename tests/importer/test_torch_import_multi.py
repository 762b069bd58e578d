"""derivgen.from_torch on forwards of several tensors: the fused layers as their libraries write
them (vLLM's residual add + RMSNorm, flash-attn's add + LayerNorm with prenorm, transformers'
real MambaRMSNormGated, Mamba-2's gate-after reference, DiT's modulate, a masked layer norm).
Each imports with its tensors beside x, the value its statistics read and its outputs beside y;
derives to the zoo's hand-written spec's closed form and reduction count; and the module
generated from it equals the original's forward and autograd backward in float64."""

from __future__ import annotations

import time

import numpy as np
import pytest
import sympy
from conftest import corpus, require_module
from test_torch_import import _randomized, casts_kept_in_float64

import derivgen
from derivgen.spec import parse_spec
from derivgen.spec.from_torch import TorchImportError, from_torch, from_torch_toml

torch = require_module("torch")
nn = torch.nn
F = torch.nn.functional


class AddRMSNorm(nn.Module):
    """vLLM's RMSNorm.forward_native with a residual (vllm/model_executor/layers/layernorm.py):
    returns (y, h)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x, residual):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        x = x + residual.to(torch.float32)
        residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = x.to(orig_dtype)
        x = x * self.weight
        return x, residual


class AddLayerNorm(nn.Module):
    """flash-attn's layer_norm_ref with a residual and prenorm=True (ops/triton/layer_norm.py)."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x, residual):
        x = (x + residual).to(x.dtype)
        out = F.layer_norm(x, x.shape[-1:], weight=self.weight, bias=self.bias, eps=self.eps)
        return out, x


class GatedRMSNormAfter(nn.Module):
    """Mamba-2's rms_norm_ref with norm_before_gate=True, one group
    (mamba_ssm/ops/triton/layernorm_gated.py)."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x, z):
        rstd = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + self.eps)
        out = x * rstd * self.weight
        return out * F.silu(z)


def dit_modulate(x, shift, scale):
    """DiT's modulate(norm_final(x), shift, scale), norm_final = nn.LayerNorm(D,
    elementwise_affine=False, eps=1e-6) (facebookresearch/DiT, models.py)."""
    x = F.layer_norm(x, x.shape[-1:], eps=1e-6)
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class MaskedLayerNorm(nn.Module):
    """Layer norm over each row's valid features (a bool mask), every feature normalized."""

    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x, mask):
        m = mask.to(x.dtype)
        frac = m.mean(-1, keepdim=True)
        mu = (m * x).mean(-1, keepdim=True) / frac
        var = (m * (x - mu) ** 2).mean(-1, keepdim=True) / frac
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


def mamba_gated():
    require_module("transformers")
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    return MambaRMSNormGated(8, group_size=8)


# the forward, the example inputs' shapes (x first), the zoo's hand-written spec
CASES = {
    "vLLM residual add + RMSNorm": (lambda: AddRMSNorm(8), [(3, 8), (3, 8)], "add_rmsnorm"),
    "flash-attn add + LayerNorm, prenorm": (lambda: AddLayerNorm(8), [(3, 8), (3, 8)], "add_layernorm"),
    "transformers MambaRMSNormGated": (mamba_gated, [(2, 3, 8), (2, 3, 8)], "rmsnorm_gated_before"),
    "Mamba-2 gated RMSNorm, gate after": (lambda: GatedRMSNormAfter(8), [(3, 8), (3, 8)], "rmsnorm_gated"),
    "DiT modulate": (lambda: dit_modulate, [(2, 3, 8), (2, 8), (2, 8)], "adaln"),
    "masked layer norm": (lambda: MaskedLayerNorm(8), [(3, 8), (3, 8)], "masked_layernorm"),
}


def _inputs(case: str, shapes: list, gen: torch.Generator) -> list:
    xs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    if case == "masked layer norm":
        xs[1] = torch.rand(shapes[1], generator=gen, dtype=torch.float64) < 0.7
        xs[1][:, 0] = True  # every row has a valid feature
    return xs


def _inlined(d, e):
    """``e`` with the statistics and the normalized coordinate replaced by their definitions
    (so that specs naming their statistics differently compare)."""
    spec = d.spec
    defs = {st.symbol: st.expr for st in spec.modes[0].statistics}
    if d.train.coordinate is not None and d.train.coordinate_expr is not None:
        defs[d.train.coordinate.symbol] = d.train.coordinate_expr
    for _ in range(len(defs) + 1):
        e = e.xreplace(defs)
    return e


def _closed_forms_same(imported, handwritten) -> bool:
    """Every gradient of the training mode, equal once the imported spec's parameters, options,
    tensors, values and outputs are mapped onto the hand-written one's by position and both
    specs' statistics are inlined."""
    a, b = imported.spec, handwritten.spec
    pairs = [*zip(a.params, b.params), *zip(a.options, b.options), *zip(a.tensors, b.tensors)]
    pairs += [*zip(a.values, b.values)]
    rename = {p.symbol: q.symbol for p, q in pairs}
    rename.update({o.cotangent: q.cotangent for o, q in zip(a.outputs, b.outputs)})
    mine, theirs = imported.train, handwritten.train
    got = [mine.dx] + [g.element + g.group for g in mine.grads.values()] + list(mine.dtensors.values())
    want = [theirs.dx] + [g.element + g.group for g in theirs.grads.values()] + list(theirs.dtensors.values())
    return len(got) == len(want) and all(
        sympy.expand(_inlined(imported, x).xreplace(rename) - _inlined(handwritten, y)) == 0 for x, y in zip(got, want)
    )


# make test's sample: a value and an output beside y (vLLM), the real class (transformers), tensors
# broadcast per sample (DiT), a mask (masked layer norm); make test-full runs the rest
QUICK = ["vLLM residual add + RMSNorm", "transformers MambaRMSNormGated", "DiT modulate", "masked layer norm"]


@pytest.mark.parametrize("case", corpus(list(CASES), QUICK))
def test_imports_derives_and_matches(case):
    make, shapes, reference = CASES[case]
    module = _randomized(make())
    gen = torch.Generator().manual_seed(0)
    xs = _inputs(case, shapes, gen)
    start = time.perf_counter()
    spec = from_torch(module, tuple(xs))
    took = time.perf_counter() - start
    text = from_torch_toml(module, tuple(xs))
    assert parse_spec(text, source=spec.source) == spec  # the TOML round-trips
    mine, theirs = derivgen.derive(spec), derivgen.derive(reference)
    hand = theirs.spec
    assert [(t.shape, t.grad, t.mask) for t in spec.tensors] == [(t.shape, t.grad, t.mask) for t in hand.tensors]
    assert len(spec.values) == len(hand.values) and len(spec.outputs) == len(hand.outputs), text
    assert mine.train.reduction_counts == theirs.train.reduction_counts, case
    assert _closed_forms_same(mine, theirs), (case, mine.train.dx, theirs.train.dx)

    # the generated module against the original: forward and autograd backward, float64
    k = derivgen.load(spec, backend="numpy")
    params = dict(module.named_parameters()) if isinstance(module, nn.Module) else {}
    x, *tensors = xs
    outs, cache = k.forward(
        x.numpy(),
        *[t.numpy().astype(np.float64) for t in tensors],
        *[params[p.name].detach().numpy() for p in spec.params],
    )
    leaves = [x.clone().requires_grad_(True)] + [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]
    with casts_kept_in_float64():
        want = module(*leaves)
    want = want if isinstance(want, tuple) else (want,)
    got = outs if spec.outputs else (outs,)
    assert len(got) == len(want)
    cots = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    for g, w in zip(got, want):
        assert np.abs(g - w.detach().numpy()).max() < 1e-10, case
    torch.autograd.backward(list(want), cots)
    grads = k.backward(cots[0].numpy(), cache, **{f"d{o.name}": c.numpy() for o, c in zip(spec.outputs, cots[1:])})
    assert np.abs(grads.dx - leaves[0].grad.numpy()).max() < 1e-10, case
    for t, leaf in zip(spec.tensors, leaves[1:]):
        if t.grad:
            assert np.abs(getattr(grads, "d" + t.name) - leaf.grad.numpy()).max() < 1e-10, (case, t.name)
    for p in spec.params:
        assert np.abs(getattr(grads, "d" + p.name) - params[p.name].grad.numpy()).max() < 1e-10, (case, p.name)
    print(f"{case}: imported in {took:.2f} s, reductions {mine.train.reduction_summary}")


def test_names_of_tensors_value_and_outputs():
    text = from_torch_toml(AddRMSNorm(8), ((2, 8), (2, 8)))
    assert "[tensors]\nresidual = {}" in text  # the forward's argument name
    assert '[values]\nh = "x + residual"' in text
    assert 'variance = "mean(h**2)"' in text
    assert 'h = "h"' in text.split("[output]")[1]  # the second output is the value itself
    text = from_torch_toml(dit_modulate, ((2, 3, 8), (2, 8), (2, 8)))
    assert 'shift = { shape = "sample" }' in text and 'scale = { shape = "sample" }' in text
    text = from_torch_toml(MaskedLayerNorm(8), (torch.randn(2, 8), torch.ones(2, 8, dtype=torch.bool)))
    assert "mask = { mask = true }" in text and "computes in float32" not in text


class TwoOutputs(nn.Module):
    def forward(self, x, r):
        h = x + r
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y, torch.tanh(y)


@pytest.mark.parametrize(
    "forward, shapes, message",
    [
        (  # Mamba's groups within a row
            lambda: __import__("transformers.models.mamba2.modeling_mamba2", fromlist=["x"]).MambaRMSNormGated(
                8, group_size=4
            ),
            [(3, 8), (3, 8)],
            "splits the last axis into 2 groups of 4",
        ),
        (  # the statistics read r apart from x
            lambda: lambda x, r: x / torch.sqrt((x * x).mean(-1, keepdim=True) + (r * r).mean(-1, keepdim=True)),
            [(3, 8), (3, 8)],
            "read x and its tensors through one value",
        ),
        (  # a tensor of a shape the layout has not
            lambda: lambda x, s: F.layer_norm(x, (8,)) * s,
            [(3, 8), (8,)],
            "tensor s of shape (8,) for x of shape (3, 8)",
        ),
        (  # an integer tensor
            lambda: lambda x, n: F.layer_norm(x, (8,)) * n,
            [(3, 8), None],
            "tensor argument 'n' is int64",
        ),
    ],
)
def test_refused_with_one_line(forward, shapes, message):
    if "transformers" in message or shapes[0] == (3, 8) and "groups" in message:
        require_module("transformers")
    xs = tuple(torch.randn(s, dtype=torch.float64) if s else torch.ones(3, 8, dtype=torch.long) for s in shapes)
    with pytest.raises(TorchImportError) as err:
        from_torch(forward(), xs)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_outputs_beside_y_named_in_order():
    text = from_torch_toml(TwoOutputs(), ((2, 8), (2, 8)))
    out = text.split("[output]")[1]
    assert 'y = "hhat"' in out and 'out1 = "tanh(hhat)"' in out, out
    derivgen.derive(from_torch(TwoOutputs(), ((2, 8), (2, 8))))  # a valid spec that derives
