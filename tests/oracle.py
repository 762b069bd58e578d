"""Test cases for the backends; the torch reference lives in derivgen.tools.torch_ref."""

from __future__ import annotations

import numpy as np

from derivgen.tools.torch_ref import torch_reference  # noqa: F401  (re-exported for the tests)

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
