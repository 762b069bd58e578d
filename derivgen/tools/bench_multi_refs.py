"""Independent PyTorch references for the multi-tensor zoo layers.

The zoo tests compare what derivgen derives for each published fused normalization layer
against these forward functions, with torch.autograd as the reference backward. Each one
is written from the named library's own code (cited in its docstring), not from derivgen's
spec of the layer, so that a wrong spec and a wrong derivation cannot agree by accident.

All math runs in the dtype of the inputs (no fp32 upcast, no in-place updates), so float64
inputs give float64 references fit for torch.autograd.gradcheck. Where the library upcasts
(vLLM, mamba, flash-attn with upcast=True) the docstring says so; in float64 it is a no-op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _rstd_rms(h: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)


def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Fused residual add + RMSNorm: h = x + residual, y = h * rsqrt(mean(h^2) + eps) * weight.

    Sources: vllm-project/vllm vllm/model_executor/layers/layernorm.py (RMSNorm.forward_native with
    residual: upcasts x and residual to fp32, adds, returns residual = sum.to(orig_dtype); normalizes,
    casts to orig dtype, then multiplies by weight; returns (y, h)); vllm-project/vllm
    csrc/layernorm_kernels.cu (fused_add_rms_norm_kernel adds in scalar_t, writes h back into
    residual and y into input); linkedin/Liger-Kernel src/liger_kernel/ops/fused_add_rms_norm.py
    (S = X + R in the input dtype, Y = S * rstd * (offset + W), returns (Y, S); offset=0 here).
    """
    h = x + residual
    y = h * _rstd_rms(h, eps) * weight
    return y, h


def add_layernorm(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """Fused residual add + LayerNorm (biased variance): h = x + residual, y = LN(h) * weight + bias.

    Source: Dao-AILab/flash-attention flash_attn/ops/triton/layer_norm.py, layer_norm_ref with
    residual given, x1/rowscale None, dropout_p=0 and prenorm=True, which returns (out, x + residual).
    """
    h = x + residual
    y = F.layer_norm(h, h.shape[-1:], weight=weight, bias=bias, eps=eps)
    return y, h


def rmsnorm_gated(
    x: Tensor,
    z: Tensor | None,
    weight: Tensor,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> Tensor:
    """Mamba-2's gated (group) RMSNorm, bias None.

    Source: state-spaces/mamba mamba_ssm/ops/triton/layernorm_gated.py, rms_norm_ref (upcast
    to fp32 omitted: the dtype is kept). With z given and norm_before_gate=False the input is
    gated first, x = x * silu(z), then normalized; with norm_before_gate=True the output is
    gated, y = norm(x) * silu(z). group_size splits the last dim into contiguous groups of
    group_size features ("... (g d) -> ... g d"), each with its own rms; weight (full width)
    is applied after the groups are merged back. group_size=None is one group (plain RMSNorm).
    """
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    n = x.shape[-1]
    if group_size is None:
        out = x * _rstd_rms(x, eps) * weight
    else:
        assert n % group_size == 0, (n, group_size)
        xg = x.unflatten(-1, (n // group_size, group_size))
        out = (xg * _rstd_rms(xg, eps)).flatten(-2) * weight
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    # facebookresearch/DiT models.py: modulate(x, shift, scale)
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def adaln(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6) -> Tensor:
    """DiT adaLN: modulate(LayerNorm(x), shift, scale), x (B, T, D), shift/scale (B, D).

    Source: facebookresearch/DiT models.py (DiTBlock/FinalLayer: nn.LayerNorm(hidden_size,
    elementwise_affine=False, eps=1e-6), then modulate = x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)).
    """
    return _modulate(F.layer_norm(x, x.shape[-1:], eps=eps), shift, scale)


def ada_rmsnorm(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6) -> Tensor:
    """adaLN with RMSNorm in place of LayerNorm: modulate(x * rsqrt(mean(x^2) + eps), shift, scale).

    Choice: the RMSNorm has no weight (like DiT's elementwise_affine=False LayerNorm; vLLM's
    RMSNorm(has_weight=False) in vllm-project/vllm vllm/model_executor/layers/layernorm.py), so
    scale and shift are the only affine terms; modulate is DiT's (facebookresearch/DiT models.py).
    """
    return _modulate(x * _rstd_rms(x, eps), shift, scale)


def _per_sample_channel(p: Tensor, x: Tensor) -> Tensor:
    return p.reshape(p.shape + (1,) * (x.dim() - 2))


def conditional_batchnorm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5) -> Tensor:
    """Conditional batch norm (de Vries et al. 2017): BN without affine, then gamma[N, C], beta[N, C].

    x (N, C, *spatial); training-mode batch statistics per channel over (N, *spatial), biased
    variance. gamma/beta are the full per-sample values (the paper's gamma + delta_gamma, beta +
    delta_beta, predicted per sample: GuessWhatGame/neural_toolbox cbn_pluggin.py create_cbn_input
    returns delta_betas, delta_gammas of shape (batch, features)), broadcast over spatial.
    (ap229997/Conditional-Batch-Norm model/cbn.py uses one mean/var over the whole tensor with
    unbiased var; we follow the paper's BatchNorm, per channel.)
    """
    xhat = F.batch_norm(x, None, None, training=True, eps=eps)
    return xhat * _per_sample_channel(gamma, x) + _per_sample_channel(beta, x)


def spade(x: Tensor, gamma: Tensor, beta: Tensor, eps: float = 1e-5) -> Tensor:
    """SPADE (Park et al. 2019): param-free BN(x) * (1 + gamma) + beta, gamma/beta of x's shape.

    Source: NVlabs/SPADE models/networks/normalization.py (SPADE.forward: normalized =
    param_free_norm(x) with BatchNorm2d/SynchronizedBatchNorm2d(affine=False), training-mode
    batch stats; out = normalized * (1 + gamma) + beta).
    """
    return F.batch_norm(x, None, None, training=True, eps=eps) * (1 + gamma) + beta


def _per_channel(p: Tensor, x: Tensor) -> Tensor:
    return p.reshape((-1,) + (1,) * (x.dim() - 2))


def masked_batchnorm(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Masked batch norm over x (N, C, T) (or (N, C, *)) with a 0/1 mask (N, 1, T) or (N, C, T).

    Per-channel mean and biased variance over the valid positions only (mask == 1);
    every output, padded ones included, is (x - mean) * rstd * weight[c] + bias[c].
    Sources: generatebio/chroma chroma/layers/norm.py (MaskedBatchNorm1d: x (B, C, L), mask
    (B, 1, L), n = mask.sum(), mean = sum(x * mask) / n; but its var also counts the padded
    zeros as (0 - mean)^2 and it normalizes x * mask, not x); sIncerass/powernorm
    fairseq/modules/norms/mask_batchnorm.py (MaskBatchNorm: stats from the unpadded rows only,
    biased var; but clamp(var, eps) ** -0.5 in place of (var + eps) ** -0.5). This reference
    takes the statistics over valid positions exactly, adds eps, and normalizes x itself.
    """
    m = mask.to(x.dtype).expand_as(x)
    dims = [0] + list(range(2, x.dim()))
    count = m.sum(dim=dims, keepdim=True)
    mean = (x * m).sum(dim=dims, keepdim=True) / count
    var = (m * (x - mean).pow(2)).sum(dim=dims, keepdim=True) / count
    return (x - mean) * torch.rsqrt(var + eps) * _per_channel(weight, x) + _per_channel(bias, x)


def masked_layernorm(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Masked layer norm: per-row mean and biased variance over the valid features (mask == 1).

    x (..., D), mask of x's shape; masked positions' outputs are still (x - mu) * rstd * w + b.
    Statistics as pytorch/pytorch torch/masked/_ops.py defines them (masked mean = sum(x * mask)
    / sum(mask); masked var with unbiased=False = sum(mask * (x - mean)^2) / sum(mask)); the
    self-check below compares against torch.masked.mean / torch.masked.var.
    """
    m = mask.to(x.dtype)
    count = m.sum(dim=-1, keepdim=True)
    mean = (x * m).sum(dim=-1, keepdim=True) / count
    var = (m * (x - mean).pow(2)).sum(dim=-1, keepdim=True) / count
    return (x - mean) * torch.rsqrt(var + eps) * weight + bias


def flash_layernorm_parallel(
    x: Tensor,
    residual: Tensor | None,
    x1: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    weight1: Tensor | None,
    bias1: Tensor | None,
    rowscale: Tensor | None,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """flash-attn's parallel (two-output) residual LayerNorm, dropout off, prenorm=True.

    Source: Dao-AILab/flash-attention flash_attn/ops/triton/layer_norm.py, layer_norm_ref (and
    _layer_norm_fwd_1pass_kernel): x = x * rowscale[..., None]; (dropout); x = x + x1;
    x = x + residual; out = LN(x) * weight + bias; out1 = LN(x) * weight1 + bias1, both with the
    same mean/rstd; prenorm returns (out, out1, x). rowscale scales x only, never x1 or residual.
    Note: upstream asserts rowscale is None whenever x1 is given ("rowscale is not supported with
    parallel LayerNorm"); with both given this reference keeps the ref's order (x * rowscale + x1
    + residual). residual_in_fp32 only sets the dtype h is stored in (fp32 when residual is None);
    here h keeps the input dtype. flash-attn's default eps is 1e-6; this signature's is 1e-5.
    """
    h = x
    if rowscale is not None:
        h = h * rowscale[..., None]
    if x1 is not None:
        h = h + x1
    if residual is not None:
        h = h + residual
    y = F.layer_norm(h, h.shape[-1:], weight=weight, bias=bias, eps=eps)
    y1 = None if weight1 is None else F.layer_norm(h, h.shape[-1:], weight=weight1, bias=bias1, eps=eps)
    return y, y1, h


class FusedAddRMSNormRef(nn.Module):
    """Module form of add_rmsnorm, like Liger-Kernel's LigerFusedAddRMSNorm (init_fn="ones",
    offset=0; linkedin/Liger-Kernel src/liger_kernel/transformers/fused_add_rms_norm.py) and
    vLLM's RMSNorm called with a residual. forward(x, residual) -> (y, h)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        return add_rmsnorm(x, residual, self.weight, self.eps)


class RMSNormGatedRef(nn.Module):
    """Mirror of Mamba-2's gated RMSNorm class (state-spaces/mamba
    mamba_ssm/ops/triton/layernorm_gated.py class RMSNorm: weight initialised to ones, bias
    registered as None). Mamba2 (mamba_ssm/modules/mamba2.py) builds it with eps=1e-5,
    norm_before_gate=False (Mamba2's default) and group_size=d_ssm // ngroups."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        return rmsnorm_gated(x, z, self.weight, self.eps, self.group_size, self.norm_before_gate)


if __name__ == "__main__":
    from torch.autograd import gradcheck

    torch.manual_seed(0)
    f64 = torch.float64

    def r(*shape, grad=True):
        return torch.randn(*shape, dtype=f64, requires_grad=grad)

    B, T, D, C = 2, 3, 8, 3
    mask_bt = (torch.rand(B, 1, 5) > 0.4).to(f64)
    mask_bt[0, 0, 0] = 1
    mask_ct = (torch.rand(B, C, 5) > 0.4).to(f64)
    mask_ct[0, :, 0] = 1
    mask_ln = (torch.rand(B, T, D) > 0.4).to(f64)
    mask_ln[..., 0] = 1
    gate_mod = RMSNormGatedRef(D, group_size=4, norm_before_gate=False, dtype=f64)
    add_mod = FusedAddRMSNormRef(D, dtype=f64)
    cases = {
        "add_rmsnorm": (add_rmsnorm, (r(B, T, D), r(B, T, D), r(D))),
        "add_layernorm": (add_layernorm, (r(B, T, D), r(B, T, D), r(D), r(D))),
        "rmsnorm_gated": (rmsnorm_gated, (r(B, T, D), r(B, T, D), r(D), 1e-5, None, True)),
        "rmsnorm_gated_g4_after": (rmsnorm_gated, (r(B, T, D), r(B, T, D), r(D), 1e-5, 4, False)),
        "rmsnorm_gated_noz_g2": (rmsnorm_gated, (r(B, T, D), None, r(D), 1e-5, 2, True)),
        "adaln": (adaln, (r(B, T, D), r(B, D), r(B, D))),
        "ada_rmsnorm": (ada_rmsnorm, (r(B, T, D), r(B, D), r(B, D))),
        "conditional_batchnorm": (conditional_batchnorm, (r(B, C, 2, 3), r(B, C), r(B, C))),
        "spade": (spade, (r(B, C, 2, 3), r(B, C, 2, 3), r(B, C, 2, 3))),
        "masked_batchnorm_n1t": (masked_batchnorm, (r(B, C, 5), mask_bt, r(C), r(C))),
        "masked_batchnorm_nct": (masked_batchnorm, (r(B, C, 5), mask_ct, r(C), r(C))),
        "masked_layernorm": (masked_layernorm, (r(B, T, D), mask_ln, r(D), r(D))),
        "flash_layernorm_parallel": (
            flash_layernorm_parallel,
            (r(B * T, D), r(B * T, D), r(B * T, D), r(D), r(D), r(D), r(D), r(B * T)),
        ),
        "flash_layernorm_rowscale_only": (
            flash_layernorm_parallel,
            (r(B, T, D), r(B, T, D), None, r(D), r(D), None, None, r(B, T)),
        ),
        "FusedAddRMSNormRef": (add_mod, (r(B, T, D), r(B, T, D))),
        "RMSNormGatedRef": (gate_mod, (r(B, T, D), r(B, T, D))),
    }
    for name, (fn, args) in cases.items():

        def outputs(*a, fn=fn):  # gradcheck takes tensors only: drop a None y1
            out = fn(*a)
            return tuple(o for o in (out if isinstance(out, tuple) else (out,)) if o is not None)

        outs = outputs(*args)
        assert all(o.dtype == f64 for o in outs)
        ok = gradcheck(outputs, args, eps=1e-6, atol=1e-6)
        print(f"{name:30s} out {[tuple(o.shape) for o in outs]}  gradcheck {ok}")

    # Cross-checks against the libraries' own formulations where PyTorch has one.
    x, res, w, b = r(B, T, D, grad=False), r(B, T, D, grad=False), r(D, grad=False), r(D, grad=False)
    y, h = add_layernorm(x, res, w, b)
    y2, y1, h2 = flash_layernorm_parallel(x, res, None, w, b, w, b, None)
    assert torch.equal(h, h2) and torch.allclose(y, y2) and torch.allclose(y, y1)
    y, _ = add_rmsnorm(x, res, w)
    assert torch.allclose(y, F.rms_norm(x + res, (D,), w, eps=1e-6))
    assert torch.allclose(rmsnorm_gated(x, None, w, group_size=D), rmsnorm_gated(x, None, w))
    zero = torch.zeros(B, D, dtype=f64)
    assert torch.allclose(adaln(x, zero, zero), F.layer_norm(x, (D,), eps=1e-6))
    xc = r(B, C, 5, grad=False)
    bn = F.batch_norm(xc, None, None, training=True, eps=1e-5)
    ones_c = torch.ones(C, dtype=f64)
    assert torch.allclose(masked_batchnorm(xc, torch.ones(B, 1, 5), ones_c, 0 * ones_c), bn)
    assert torch.allclose(conditional_batchnorm(xc, torch.ones(B, C, dtype=f64), torch.zeros(B, C, dtype=f64)), bn)
    keep = mask_ln.bool()
    mu = torch.masked.mean(x, -1, keepdim=True, mask=keep)
    var = torch.masked.var(x, -1, unbiased=False, keepdim=True, mask=keep)
    assert torch.allclose(masked_layernorm(x, mask_ln, w, b), (x - mu) / torch.sqrt(var + 1e-5) * w + b)
    print("cross-checks passed")
