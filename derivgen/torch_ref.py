"""PyTorch autograd references for the catalogue layers (an optional oracle).

Each reference runs the layer in torch float64 under autograd. PyTorch has no
online layer norm: it is written here with torch operations from its
definition, independently of derivgen's derivation.
"""

from __future__ import annotations

import numpy as np

HAS_REFERENCE = ("layernorm", "rmsnorm", "batchnorm", "instancenorm", "groupnorm", "online_layernorm")


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_reference(name, x, params, kw, dy):
    import torch
    import torch.nn.functional as F

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    extra_in = {}
    buffers = {}
    if name == "layernorm":
        y = F.layer_norm(tx, tuple(params["gamma"].shape), t["gamma"], t["beta"], kw.get("eps", 1e-5))
    elif name == "rmsnorm":
        y = F.rms_norm(tx, tuple(params["gamma"].shape), t["gamma"], kw.get("eps", 1e-6))
    elif name == "batchnorm":
        rm = torch.tensor(kw["running_mean"], dtype=torch.float64) if kw.get("running_mean") is not None else None
        rv = torch.tensor(kw["running_var"], dtype=torch.float64) if kw.get("running_var") is not None else None
        y = F.batch_norm(tx, rm, rv, t["gamma"], t["beta"], kw.get("training", True),
                         kw.get("momentum", 0.1), kw.get("eps", 1e-5))
        buffers = {"running_mean": rm, "running_var": rv}
    elif name == "instancenorm":
        y = F.instance_norm(tx, weight=t["gamma"], bias=t["beta"], eps=kw.get("eps", 1e-5))
    elif name == "groupnorm":
        y = F.group_norm(tx, kw["num_groups"], t["gamma"], t["beta"], kw.get("eps", 1e-5))
    elif name == "online_layernorm":
        alpha, eps = kw["alpha"], kw.get("eps", 0.0)
        pm = torch.tensor(np.asarray(kw["prev_mean"], dtype=np.float64), requires_grad=True)
        ps = torch.tensor(np.asarray(kw["prev_std"], dtype=np.float64), requires_grad=True)
        extra_in = {"prev_mean": pm, "prev_std": ps}
        k = params["gamma"].ndim
        axes = tuple(range(x.ndim - k, x.ndim))
        D = int(np.prod(x.shape[x.ndim - k:]))
        expand = (...,) + (None,) * k
        mu = alpha * tx.mean(axes) + (1 - alpha) * pm
        s = torch.sqrt(((tx - mu[expand]) ** 2).sum(axes) / (D - 1) + eps)
        sigma = alpha * s + (1 - alpha) * ps
        y = t["gamma"] * (tx - mu[expand]) / sigma[expand] + t["beta"]
    else:
        raise KeyError(name)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    grads = {"dx": tx.grad.numpy()}
    for k, v in t.items():
        grads["d" + k] = v.grad.numpy()
    for k, v in extra_in.items():
        grads["d" + k] = v.grad.numpy()
    bufs = {k: (v.numpy() if v is not None else None) for k, v in buffers.items()}
    return y.detach().numpy(), grads, bufs
