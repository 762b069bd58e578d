"""derivgen.torch.convert(model, import_unknown=True): a tiny transformers Llama (built from a
config, no download) converted in one call: every LlamaRMSNorm imported and replaced, the
state_dict keys and the parameter tensors kept, and a few SGD steps giving the unconverted
copy's losses (float64); the report says what was left and why."""

from __future__ import annotations

import copy

import pytest
from conftest import require_module

torch = require_module("torch")
dt = pytest.importorskip("derivgen.torch")


def tiny_llama():
    transformers = require_module("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def train(model, tokens, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before any conversion of ``model``
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(input_ids=tokens).logits  # the loss in float64 (transformers' own casts to float32)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_llama_converts_in_one_call_and_trains_as_the_original():
    ref = tiny_llama()
    ours = copy.deepcopy(ref)
    before = dict(ours.named_parameters())
    opt_params = list(ours.parameters())
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 8))
    report = dt.ConvertReport()
    converted = dt.convert(ours, import_unknown=True, example_inputs=(tokens,), report=report)
    assert converted is ours
    norms = [p for p, m in ref.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5
    for p in norms:
        assert report.replaced[p] == "llama_rmsnorm", str(report)
        assert isinstance(ours.get_submodule(p), dt.Module)
    assert set(report.replaced) <= set(norms) | {f"model.layers.{i}.mlp.act_fn" for i in range(2)}
    assert "torch.int64" in report.left["model.embed_tokens"]
    assert "position_ids" in report.left["model.rotary_emb"]
    assert "model.layers.0.self_attn.q_proj" in report.left
    assert "llama_rmsnorm" in str(report) and "left" in str(report)
    # the same state_dict keys, and the very same parameter tensors (an optimizer made before)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert dict(ours.named_parameters()).keys() == before.keys()
    assert all(a is b for a, b in zip(ours.parameters(), opt_params, strict=True))
    # training: the same losses (the converted norms compute in float64 where LlamaRMSNorm
    # casts to float32; the difference stays far under 1e-6)
    steps = 4
    want = train(ref, tokens, steps)
    got = train(ours, tokens, steps)
    assert want[-1] < want[0]
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-6, (want, got)
    for (n, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), n


def test_convert_default_unchanged_and_import_needs_an_example():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    report = dt.ConvertReport()
    out = dt.convert(model, report=report)
    assert out is model and isinstance(model[1], dt.LayerNorm)
    assert report.replaced == {"1": "layernorm"} and report.left == {}
    with pytest.raises(TypeError, match="example_inputs"):
        dt.convert(model, import_unknown=True)


def tiny_mamba2():
    transformers = require_module("transformers")
    config = transformers.Mamba2Config(
        vocab_size=64,
        hidden_size=16,
        state_size=8,
        num_heads=4,
        head_dim=8,
        n_groups=1,
        expand=2,
        num_hidden_layers=1,
        chunk_size=8,
        conv_kernel=4,
    )
    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(config).double()


def test_mamba2_gated_norms_of_two_tensors_convert_and_train_as_the_original():
    """Mamba-2's MambaRMSNormGated is called as norm(x, gate): imported as a spec with the gate
    a tensor input beside x (the statistics read x·silu(gate)), and replaced."""
    ref = tiny_mamba2()
    ours = copy.deepcopy(ref)
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 8))
    report = dt.ConvertReport()
    dt.convert(ours, import_unknown=True, example_inputs=(tokens,), report=report)
    gated = [p for p, m in ref.named_modules() if type(m).__name__ == "MambaRMSNormGated"]
    norms = [p for p, m in ref.named_modules() if type(m).__name__ == "Mamba2RMSNorm"]
    assert len(gated) == 1 and len(norms) == 2
    assert {p: report.replaced.get(p) for p in gated} == dict.fromkeys(gated, "mamba_rmsnorm_gated"), str(report)
    assert all(report.replaced.get(p) == "mamba2_rmsnorm" for p in norms), str(report)
    layer = ours.get_submodule(gated[0])
    assert isinstance(layer, dt.Module) and list(layer._layer.meta.tensors) == ["gate"]
    assert list(ours.state_dict()) == list(ref.state_dict())
    want = train(ref, tokens, 3)
    got = train(ours, tokens, 3)
    assert want[-1] < want[0]
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-6, (want, got)
