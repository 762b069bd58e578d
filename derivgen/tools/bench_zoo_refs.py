"""The zoo's single-tensor layers written from their papers in PyTorch, independently of
derivgen's specs: the references of the zoo tests (tests/zoo/test_zoo.py) and of ``derivgen bench
--zoo`` (derivgen.tools.bench_zoo), which autograd differentiates. Each takes
(x, params, inputs, options, buffers, training) by name and returns y; a layer with running
buffers updates them in place in training, as its paper does."""

from __future__ import annotations

import math

import torch


def _c(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over (N, C, *spatial)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _spatial(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.dim()))


def _batch(x: torch.Tensor) -> tuple[int, ...]:
    return (0, *_spatial(x))


def _group_std(x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """timm's group_std: sqrt of the biased variance over (C/G, *spatial) + eps, per (sample, group)."""
    xg = x.reshape(x.shape[0], groups, -1)
    std = (xg.var(dim=-1, unbiased=False, keepdim=True) + eps).sqrt()
    return std.expand_as(xg).reshape(x.shape)


# ---- the papers' forwards: (x, params, inputs, options, buffers, training) -> y


def frn(x, p, i, o, b, training):
    nu2 = x.pow(2).mean(dim=_spatial(x), keepdim=True)
    y = _c(p["gamma"], x) * x * torch.rsqrt(nu2 + o["eps"]) + _c(p["beta"], x)
    return torch.max(y, _c(p["tau"], x).expand_as(y))


def batch_renorm(x, p, i, o, b, training):
    rm, rs = _c(b["running_mean"], x), _c(b["running_std"], x)
    if not training:
        return _c(p["gamma"], x) * (x - rm) / rs + _c(p["beta"], x)
    mu = x.mean(dim=_batch(x), keepdim=True)
    sigma = (x.var(dim=_batch(x), unbiased=False, keepdim=True) + o["eps"]).sqrt()
    r = (sigma / rs).clamp(1 / o["rmax"], o["rmax"]).detach()
    d = ((mu - rm) / rs).clamp(-o["dmax"], o["dmax"]).detach()
    with torch.no_grad():
        b["running_mean"] += o["momentum"] * (mu.flatten() - b["running_mean"])
        b["running_std"] += o["momentum"] * (sigma.flatten() - b["running_std"])
    return _c(p["gamma"], x) * ((x - mu) / sigma * r + d) + _c(p["beta"], x)


def adanorm(x, p, i, o, b, training):
    mean = x.mean(-1, keepdim=True)
    std = x.std(-1, keepdim=True)
    z = (x - mean) / (std + o["eps"])
    return o["c"] * z * (1 - (o["k"] * z).detach())


def derf(x, p, i, o, b, training):
    return p["gamma"] * torch.erf(p["alpha"] * x + p["s"]) + p["beta"]


def l2_normalize(x, p, i, o, b, training):
    return torch.nn.functional.normalize(x, p=2, dim=-1, eps=o["eps"])


def evonorm_s0(x, p, i, o, b, training):
    n = x * (x * _c(p["v"], x)).sigmoid()
    return n / _group_std(x, o["num_groups"], o["eps"]) * _c(p["gamma"], x) + _c(p["beta"], x)


def weight_norm(x, p, i, o, b, training):
    # torch._weight_norm(v, g, dim=0): v*(g/norm_except_dim(v, 2, 0)) (it has no forward AD)
    return x * (i["gain"].unsqueeze(-1) / torch.linalg.vector_norm(x, dim=-1, keepdim=True))


def polynorm(x, p, i, o, b, training):
    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + o["eps"])

    return p["w0"] * norm(x**3) + p["w1"] * norm(x**2) + p["w2"] * norm(x) + p["b"]


def scalenorm(x, p, i, o, b, training):
    return x * (p["scale"] / torch.norm(x, dim=-1, keepdim=True).clamp(min=o["eps"]))


def dynamic_tanh(x, p, i, o, b, training):
    return torch.tanh(p["alpha"] * x) * p["gamma"] + p["beta"]


def gemma_rmsnorm(x, p, i, o, b, training):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + o["eps"]) * (1.0 + p["w"])


def layernorm_simple(x, p, i, o, b, training):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=o["eps"])


def pixelnorm(x, p, i, o, b, training):
    return x * torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + o["eps"])


def squash(x, p, i, o, b, training):
    sq = (x**2).sum(-1, keepdim=True)
    return sq / (1 + sq) * x / torch.sqrt(sq + o["eps"])


def weight_standardization(x, p, i, o, b, training):
    w = x - x.mean(dim=1, keepdim=True)
    std = w.std(dim=1, keepdim=True) + o["eps"]
    return w / std


def scaled_ws(x, p, i, o, b, training):
    fan_in = x.shape[-1]
    scale = o["gamma"] * fan_in**-0.5
    w = torch.nn.functional.batch_norm(
        x.reshape(1, x.shape[0], -1), None, None, weight=(i["gain"] * scale), training=True, momentum=0.0, eps=o["eps"]
    )
    return w.reshape_as(x)


def mean_only_bn(x, p, i, o, b, training):
    if not training:
        return x - _c(b["running_mean"], x) + _c(p["beta"], x)
    mu = x.mean(dim=_batch(x), keepdim=True)
    with torch.no_grad():
        b["running_mean"].mul_(1 - o["momentum"]).add_(o["momentum"] * mu.flatten())
    return x - mu + _c(p["beta"], x)


def layernorm_annotated(x, p, i, o, b, training):
    mean = x.mean(-1, keepdim=True)
    std = x.std(-1, keepdim=True)
    return p["a_2"] * (x - mean) / (std + o["eps"]) + p["b_2"]


def l1_batchnorm(x, p, i, o, b, training):
    if not training:
        mu, scale = _c(b["running_mean"], x), _c(b["running_scale"], x)
    else:
        mu = x.mean(dim=_batch(x), keepdim=True)
        scale = (x - mu).abs().mean(dim=_batch(x), keepdim=True) * math.sqrt(math.pi / 2)
        with torch.no_grad():
            b["running_mean"].mul_(1 - o["momentum"]).add_(o["momentum"] * mu.flatten())
            b["running_scale"].mul_(1 - o["momentum"]).add_(o["momentum"] * scale.flatten())
    return (x - mu) / (scale + o["eps"]) * _c(p["gamma"], x) + _c(p["beta"], x)


def adain(x, p, i, o, b, training):
    n, c = x.shape[:2]
    flat = x.reshape(n, c, -1)
    mean = flat.mean(-1).view(n, c, 1, 1)
    std = (flat.var(-1, unbiased=False) + o["eps"]).sqrt().view(n, c, 1, 1)
    return (x - mean) / std * i["style_std"].view(n, c, 1, 1) + i["style_mean"].view(n, c, 1, 1)


def softmax(x, p, i, o, b, training):
    return torch.softmax(x, dim=-1)


def log_softmax(x, p, i, o, b, training):
    return torch.log_softmax(x, dim=-1)


def absmax_scale(x, p, i, o, b, training):
    return x * o["q"] / x.abs().amax(dim=-1, keepdim=True)


def softmax_temperature(x, p, i, o, b, training):
    return torch.softmax(x / p["t"], dim=-1)


def edm2_normalize(x, p, i, o, b, training):
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    norm = torch.add(o["eps"], norm, alpha=math.sqrt(norm.numel() / x.numel()))
    return x / norm


def prmsnorm(x, p, i, o, b, training):
    # bzhangGo/rmsnorm's RMSNorm with 0 <= p <= 1: the norm of the first int(d*p) features
    d = x.shape[-1]
    k = int(d * o["p"])
    partial, _ = torch.split(x, [k, d - k], dim=-1)
    rms = partial.norm(2, dim=-1, keepdim=True) * k ** (-1.0 / 2)
    return p["gamma"] * (x / (rms + o["eps"]))


def layernorm2d(x, p, i, o, b, training):
    # timm's LayerNorm2d: permute to channels last, F.layer_norm over C, permute back
    last = x.permute(0, *range(2, x.dim()), 1)
    y = torch.nn.functional.layer_norm(last, (x.shape[1],), p["gamma"], p["beta"], o["eps"])
    return y.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


def lrn(x, p, i, o, b, training):
    # AlexNet's local response normalization, written out: squares zero padded along the
    # channels (size//2 before, (size-1)//2 after), a sum over size of them, divided by size
    size = int(o["size"])
    sq = torch.nn.functional.pad((x * x).unsqueeze(1), (0, 0) * (x.dim() - 2) + (size // 2, (size - 1) // 2))
    win = sum(sq.narrow(2, d, x.shape[1]) for d in range(size)).squeeze(1)
    return x / (o["k"] + o["alpha"] * win / size) ** o["beta"]


def evonorm_b0(x, p, i, o, b, training):
    # timm's EvoNorm2dB0: the biased batch variance per channel (running_var in eval, updated
    # with it times n/(n - 1) in training), the instance std per (sample, channel)
    if training:
        var = x.var(dim=_batch(x), unbiased=False)
        n = x.numel() / x.shape[1]
        with torch.no_grad():
            b["running_var"].copy_(b["running_var"] * (1 - o["momentum"]) + var * o["momentum"] * (n / (n - 1)))
    else:
        var = b["running_var"]
    left = _c((var + o["eps"]).sqrt(), x).expand_as(x)
    istd = (x.var(dim=_spatial(x), unbiased=False, keepdim=True) + o["eps"]).sqrt().expand(x.shape)
    right = x * _c(p["v"], x) + istd
    return x / left.max(right) * _c(p["gamma"], x) + _c(p["beta"], x)


def switchnorm(x, p, i, o, b, training):
    # the reference SwitchNorm2d's training forward, every variance biased (the paper's)
    n, c = x.shape[:2]
    flat = x.reshape(n, c, -1)
    mean_in = flat.mean(-1, keepdim=True)
    var_in = flat.var(-1, unbiased=False, keepdim=True)
    temp = var_in + mean_in**2
    mean_ln = mean_in.mean(1, keepdim=True)
    var_ln = temp.mean(1, keepdim=True) - mean_ln**2
    mean_bn = mean_in.mean(0, keepdim=True)
    var_bn = temp.mean(0, keepdim=True) - mean_bn**2
    mw = torch.softmax(torch.stack([p["mw_in"], p["mw_ln"], p["mw_bn"]]), 0)
    vw = torch.softmax(torch.stack([p["vw_in"], p["vw_ln"], p["vw_bn"]]), 0)
    mean = mw[0] * mean_in + mw[1] * mean_ln + mw[2] * mean_bn
    var = vw[0] * var_in + vw[1] * var_ln + vw[2] * var_bn
    y = ((flat - mean) / (var + o["eps"]).sqrt()).reshape(x.shape)
    return y * _c(p["gamma"], x) + _c(p["beta"], x)


# ---- the catalogue, by PyTorch's own functional layers (online layer norm from its formula)


def layernorm(x, p, i, o, b, training):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], p["gamma"], p["beta"], o["eps"])


def rmsnorm(x, p, i, o, b, training):
    return torch.nn.functional.rms_norm(x, x.shape[-1:], p["gamma"], o["eps"])


def batchnorm(x, p, i, o, b, training):
    return torch.nn.functional.batch_norm(
        x, b["running_mean"], b["running_var"], p["gamma"], p["beta"], training, o["momentum"], o["eps"]
    )


def instancenorm(x, p, i, o, b, training):
    return torch.nn.functional.instance_norm(x, weight=p["gamma"], bias=p["beta"], eps=o["eps"])


def groupnorm(x, p, i, o, b, training):
    return torch.nn.functional.group_norm(x, o["num_groups"], p["gamma"], p["beta"], o["eps"])


def online_layernorm(x, p, i, o, b, training):
    # Online normalization's layer form: the row's mean and sample std blended with the
    # previous ones (per row) by alpha
    a = o["alpha"]
    mu = a * x.mean(-1, keepdim=True) + (1 - a) * i["prev_mean"].unsqueeze(-1)
    s = torch.sqrt(((x - mu) ** 2).sum(-1, keepdim=True) / (x.shape[-1] - 1) + o["eps"])
    sigma = a * s + (1 - a) * i["prev_std"].unsqueeze(-1)
    return p["gamma"] * (x - mu) / sigma + p["beta"]


# ---- the layers with tensors beside x (derivgen.tools.bench_multi_refs, written from the
# libraries' code): (arguments by the spec's names, options) -> the outputs in the spec's order


def _multi():
    from derivgen.tools import bench_multi_refs as R

    return {
        "add_rmsnorm": lambda a, o: R.add_rmsnorm(a["x"], a["residual"], a["weight"], o["eps"]),
        "add_layernorm": lambda a, o: R.add_layernorm(a["x"], a["residual"], a["weight"], a["bias"], o["eps"]),
        "rmsnorm_gated": lambda a, o: R.rmsnorm_gated(a["x"], a["z"], a["weight"], o["eps"], norm_before_gate=True),
        "rmsnorm_gated_before": lambda a, o: R.rmsnorm_gated(
            a["x"], a["z"], a["weight"], o["eps"], norm_before_gate=False
        ),
        "adaln": lambda a, o: R.adaln(a["x"], a["shift"], a["scale"], o["eps"]),
        "ada_rmsnorm": lambda a, o: R.ada_rmsnorm(a["x"], a["shift"], a["scale"], o["eps"]),
        "conditional_batchnorm": lambda a, o: R.conditional_batchnorm(a["x"], a["gamma"], a["beta"], o["eps"]),
        "spade": lambda a, o: R.spade(a["x"], a["gamma"], a["beta"], o["eps"]),
        "masked_batchnorm": lambda a, o: R.masked_batchnorm(a["x"], a["mask"], a["weight"], a["bias"], o["eps"]),
        "masked_layernorm": lambda a, o: R.masked_layernorm(a["x"], a["mask"], a["weight"], a["bias"], o["eps"]),
        "flash_layernorm_parallel": lambda a, o: R.flash_layernorm_parallel(
            a["x"], a["residual"], a["x1"], a["weight"], a["bias"], a["weight1"], a["bias1"], None, o["eps"]
        ),
    }


SINGLE = {
    f.__name__: f
    for f in (
        layernorm, rmsnorm, batchnorm, instancenorm, groupnorm, online_layernorm,
        frn, batch_renorm, adanorm, derf, l2_normalize, evonorm_s0, weight_norm, polynorm, scalenorm,
        dynamic_tanh, gemma_rmsnorm, layernorm_simple, pixelnorm, squash, weight_standardization, scaled_ws,
        mean_only_bn, layernorm_annotated, l1_batchnorm, adain, softmax, log_softmax, absmax_scale,
        softmax_temperature, edm2_normalize, prmsnorm, layernorm2d, lrn, evonorm_b0, switchnorm,
    )
}  # fmt: skip


def reference(name: str):
    """Layer ``name``'s independent PyTorch forward as ``f(args, options, buffers) -> tuple of outputs``,
    ``args`` the tensors by the spec's names (x, tensors beside x, parameters, per-group inputs);
    None where there is none."""
    multi = _multi()
    if name in multi:
        fn = multi[name]

        def call(args, options, buffers):
            out = fn(args, options)
            out = out if isinstance(out, tuple) else (out,)
            return tuple(v for v in out if v is not None)

        return call
    if name in SINGLE:
        fn = SINGLE[name]

        def call(args, options, buffers, fn=fn):
            return (fn(args["x"], args, args, options, buffers, True),)

        return call
    return None
