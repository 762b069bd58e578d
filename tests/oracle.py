"""PyTorch reference implementations (autograd) for every catalogue layer.

Each case builds random inputs, runs the layer in torch float64 under autograd
and returns (y, grads, buffers-after) for comparison. online_layernorm is not
in PyTorch: it is written here with torch operations from its definition.
"""

from __future__ import annotations

import numpy as np


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
        D = x.shape[-1]
        mu = alpha * tx.mean(-1) + (1 - alpha) * pm
        s = torch.sqrt(((tx - mu[..., None]) ** 2).sum(-1) / (D - 1) + eps)
        sigma = alpha * s + (1 - alpha) * ps
        y = t["gamma"] * (tx - mu[..., None]) / sigma[..., None] + t["beta"]
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


# (layer, x shape, param shape, keyword options)
CASES = [
    ("layernorm", (4, 7), (7,), {}),
    ("layernorm", (3, 5, 6), (5, 6), {"eps": 1e-3}),
    ("layernorm", (13,), (13,), {}),
    ("layernorm", (2, 1, 1), (1,), {}),
    ("layernorm", (1, 257), (257,), {}),
    ("rmsnorm", (4, 7), (7,), {}),
    ("rmsnorm", (2, 3, 1), (3, 1), {"eps": 1e-4}),
    ("rmsnorm", (5, 129), (129,), {}),
    ("batchnorm", (8, 3), (3,), {}),
    ("batchnorm", (4, 5, 7), (5,), {"momentum": 0.3}),
    ("batchnorm", (2, 3, 4, 5), (3,), {"eps": 1e-3}),
    ("batchnorm", (1, 2, 3, 1), (2,), {}),
    ("batchnorm", (5, 1), (1,), {}),
    ("batchnorm", (3, 4, 2, 3), (4,), {"training": False}),
    ("instancenorm", (2, 3, 5), (3,), {}),
    ("instancenorm", (1, 1, 4, 3), (1,), {}),
    ("instancenorm", (3, 2, 1, 7), (2,), {"eps": 1e-3}),
    ("groupnorm", (2, 6, 5), (6,), {"num_groups": 3}),
    ("groupnorm", (1, 4, 3, 3), (4,), {"num_groups": 1}),
    ("groupnorm", (3, 4, 2, 2), (4,), {"num_groups": 4}),
    ("groupnorm", (2, 6), (6,), {"num_groups": 2}),
    ("online_layernorm", (4, 9), (9,), {"alpha": 0.3, "prev_mean": 0.2, "prev_std": 1.4}),
    ("online_layernorm", (3, 5, 8), (8,), {"alpha": 0.7, "eps": 1e-3, "prev_mean": "rows", "prev_std": "rows"}),
    ("online_layernorm", (6, 2), (2,), {"alpha": 1.0, "prev_mean": 0.0, "prev_std": 1.0}),
    ("online_layernorm", (2, 11), (11,), {"alpha": 0.0, "prev_mean": -0.3, "prev_std": 0.8}),
]


def make_inputs(case, dtype, seed=0):
    name, xs, ps, kw = case
    rng = np.random.default_rng(seed)
    x = rng.normal(0.5, 1.5, xs).astype(dtype)
    dy = rng.normal(size=xs).astype(dtype)
    params = {"gamma": rng.normal(1.0, 0.3, ps).astype(dtype)}
    if name != "rmsnorm":
        params["beta"] = rng.normal(0.0, 0.3, ps).astype(dtype)
    kw = dict(kw)
    for k in ("prev_mean", "prev_std"):
        if kw.get(k) == "rows":
            lo = 0.5 if k == "prev_std" else -0.5
            kw[k] = rng.uniform(lo, lo + 1.0, xs[:-1]).astype(dtype)
    if name == "batchnorm":
        kw["running_mean"] = rng.normal(size=ps).astype(dtype)
        kw["running_var"] = rng.uniform(0.5, 2.0, ps).astype(dtype)
    return x, params, kw, dy
