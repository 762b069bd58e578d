"""What ``derivgen bench`` times the generated code against: a textbook NumPy forward +
backward of each catalogue layer (:func:`plain_numpy`) and PyTorch's own layers
(:func:`torch_step`, :func:`fused_torch_step`) on the same arrays."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from derivgen.api import load_spec
from derivgen.runtime import resolve_layout


def _view(name: str, x: np.ndarray, params: list[np.ndarray], kw: dict) -> tuple:
    """(x4, params4, reduce axes, param axes, N) in the (O, G, Cg, S) view, as the runtime does."""
    spec = load_spec(name)
    meta = {"name": name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"]}
    layout = resolve_layout(meta, x, {"p": params[0]}, kw.get("num_groups"))
    return (
        x.reshape(layout.view4),
        [p.reshape(layout.param4) for p in params],
        layout.reduce_axes,
        layout.param_axes,
        layout.group_size,
    )


def plain_numpy(name: str, x: np.ndarray, params: list[np.ndarray], dy: np.ndarray, kw: dict) -> tuple:
    """A textbook NumPy forward + backward of a catalogue layer (what one writes without
    derivgen): (y, (dx, the parameters' gradients...))."""
    x4, p4, ax, pax, N = _view(name, x, params, kw)
    dy4 = dy.reshape(x4.shape)
    eps = kw.get("eps", 1e-6 if name == "rmsnorm" else (0.0 if name == "online_layernorm" else 1e-5))
    if name == "rmsnorm":
        (gamma,) = p4
        r = 1.0 / np.sqrt(np.mean(x4 * x4, axis=ax, keepdims=True) + eps)
        xhat = x4 * r
        y = gamma * xhat
        g = dy4 * gamma
        dx = r * (g - xhat * np.mean(g * xhat, axis=ax, keepdims=True))
        return y, (dx, np.sum(dy4 * xhat, axis=pax))
    gamma, beta = p4
    if name == "online_layernorm":
        a, pm, ps = kw["alpha"], kw["prev_mean"], kw["prev_std"]
        mu = a * np.mean(x4, axis=ax, keepdims=True) + (1 - a) * pm
        d = x4 - mu
        s = np.sqrt(np.sum(d * d, axis=ax, keepdims=True) / (N - 1) + eps)
        sig = a * s + (1 - a) * ps
        xhat = d / sig
        y = gamma * xhat + beta
        g = dy4 * gamma
        m_g, m_gx = np.mean(g, axis=ax, keepdims=True), np.mean(g * xhat, axis=ax, keepdims=True)
        dsig = -N * m_gx / sig
        ds = a * dsig
        dmu = -N * m_g / sig + ds * (-(np.sum(d, axis=ax, keepdims=True)) / ((N - 1) * s))
        dx = g / sig + ds * d / ((N - 1) * s) + a * dmu / N
        return y, (dx, np.sum(dy4 * xhat, axis=pax), np.sum(dy4, axis=pax))
    mu = np.mean(x4, axis=ax, keepdims=True)
    var = np.var(x4, axis=ax, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x4 - mu) * rstd
    y = gamma * xhat + beta
    g = dy4 * gamma
    dx = rstd * (g - np.mean(g, axis=ax, keepdims=True) - xhat * np.mean(g * xhat, axis=ax, keepdims=True))
    return y, (dx, np.sum(dy4 * xhat, axis=pax), np.sum(dy4, axis=pax))


def torch_step(
    name: str, x: np.ndarray, params: list[np.ndarray], dy: np.ndarray, kw: dict, threads: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """PyTorch's own layer on the same arrays (shared, not copied), with ``threads`` threads:
    (forward without autograd, forward + backward through autograd)."""
    import torch  # optional dependency: only when it is installed
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    tx = torch.from_numpy(x).requires_grad_(True)
    tp = [torch.from_numpy(p).requires_grad_(True) for p in params]
    tdy = torch.from_numpy(dy)
    eps = kw.get("eps")

    def fwd() -> torch.Tensor:
        """y by torch's own functional layer (online layer norm: from its formula)."""
        if name == "layernorm":
            return F.layer_norm(tx, tuple(params[0].shape), tp[0], tp[1], eps or 1e-5)
        if name == "rmsnorm":
            return F.rms_norm(tx, tuple(params[0].shape), tp[0], eps or 1e-6)
        if name == "batchnorm":
            return F.batch_norm(tx, None, None, tp[0], tp[1], True, 0.1, eps or 1e-5)
        if name == "instancenorm":
            return F.instance_norm(tx, weight=tp[0], bias=tp[1], eps=eps or 1e-5)
        if name == "groupnorm":
            return F.group_norm(tx, kw["num_groups"], tp[0], tp[1], eps or 1e-5)
        if name == "online_layernorm":
            a = kw["alpha"]
            mu = a * tx.mean(-1, keepdim=True) + (1 - a) * kw["prev_mean"]
            s = torch.sqrt(((tx - mu) ** 2).sum(-1, keepdim=True) / (x.shape[-1] - 1))
            sig = a * s + (1 - a) * kw["prev_std"]
            return tp[0] * (tx - mu) / sig + tp[1]
        raise KeyError(name)

    def fwd_only() -> None:
        """The forward without autograd."""
        with torch.no_grad():
            fwd()

    def step() -> None:
        """Forward and backward through autograd."""
        tx.grad = None
        for p in tp:
            p.grad = None
        fwd().backward(tdy)

    return fwd_only, step


def fused_torch_step(
    name: str,
    x: np.ndarray,
    tensors: list[np.ndarray],
    params: list[np.ndarray],
    dy: np.ndarray,
    cots: dict,
    kw: dict,
    threads: int,
    compiled: bool,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """What a user writes instead of a fused layer, in PyTorch on the same arrays: eager, or the
    same function through ``torch.compile`` (forward without autograd, forward + backward)."""
    import torch  # optional dependency: only when it is installed
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    tx = torch.from_numpy(x).requires_grad_(True)
    tt = [torch.from_numpy(t).requires_grad_(True) for t in tensors]
    tp = [torch.from_numpy(p).requires_grad_(True) for p in params]
    tdy, tcots = torch.from_numpy(dy), [torch.from_numpy(c) for c in cots.values()]
    eps = kw.get("eps", 1e-6 if name == "add_rmsnorm" else 1e-5)
    d = x.shape[-1]

    def fn(x, t, w):
        if name == "add_rmsnorm":  # vLLM / Liger: h = x + residual, y = rms_norm(h) * w; (y, h)
            h = x + t
            return F.rms_norm(h, (d,), w, eps), h
        if name == "rmsnorm_gated":  # Mamba-2, gate after the norm
            return (F.rms_norm(x, (d,), w, eps) * F.silu(t),)
        return (F.rms_norm(x * F.silu(t), (d,), w, eps),)  # rmsnorm_gated_before

    f = torch.compile(fn) if compiled else fn

    def fwd_only() -> None:
        with torch.no_grad():
            f(tx, tt[0], tp[0])

    def step() -> None:
        for v in (tx, *tt, *tp):
            v.grad = None
        outs = f(tx, tt[0], tp[0])
        torch.autograd.backward(outs, [tdy, *tcots])

    return fwd_only, step
