"""Arguments for a derivgen layer's PyTorch operators, built from its metadata alone
(so that every catalogue layer, example spec and fuzzed spec gets the same tests)."""

from __future__ import annotations

import torch

from derivgen.runtime.meta import LayerMeta, layer_meta


def x_shape(meta: LayerMeta) -> tuple:
    if meta.layout == "trailing":
        spanning = [p for p in meta.params if p not in meta.scalar_params]
        return (3, 5) if spanning else (3, 2, 5)[-(meta.axes + 1) :]
    return {"batch": (4, 4, 3), "instance": (2, 4, 3), "group": (2, 4, 3), "position": (2, 4, 3)}[meta.reduce]


def arguments(lay, mode: str, dtype=torch.float64, seed: int = 0, requires_grad: bool = True):
    """(x, params, inputs, options, buffers, num_groups) for ``lay`` (a TorchLayer)."""
    meta = layer_meta(lay.meta)  # a LayerMeta, or a generated module's META dict
    g = torch.Generator().manual_seed(seed)
    shape = x_shape(meta)
    x = torch.randn(shape, generator=g, dtype=dtype) * 1.3 + 0.3
    size = shape[-1:] if meta.layout == "trailing" else (shape[1],)
    params = {}
    for p in meta.params:
        ps = () if p in meta.scalar_params else size
        params[p] = torch.rand(ps, generator=g, dtype=dtype) + 0.5
    groups = 2 if meta.reduce == "group" else 0
    if meta.layout == "trailing":
        spanning = [p for p in meta.params if p not in meta.scalar_params]
        gshape = shape[:-1] if spanning else shape[: len(shape) - meta.axes]
    else:
        gshape = {
            "batch": (shape[1],),
            "instance": shape[:2],
            "group": (shape[0], groups),
            "position": (shape[0], *shape[2:]),
        }[meta.reduce]
    inputs = {i: torch.rand(gshape, generator=g, dtype=dtype) + 0.5 for i in meta.inputs}
    options = {}
    for o, (default, lo, hi) in meta.options.items():
        if o == "eps":
            options[o] = 1e-3
        elif default is not None:
            options[o] = default
        else:
            options[o] = 0.3 if hi is not None and hi <= 1 else 1.0
    buffers = {}
    if mode == "eval":
        for b in meta.buffers:
            buffers[b] = torch.rand(gshape, generator=g, dtype=dtype) + 0.5
    if requires_grad:
        for t in [x, *params.values(), *inputs.values()]:
            t.requires_grad_(True)
    return x, params, inputs, options, buffers, groups
