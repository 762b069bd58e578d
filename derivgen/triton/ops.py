"""The CUDA implementation of the ``derivgen::`` operators: a layer's generated Triton
kernels behind the forward and backward operators (registered by
:mod:`derivgen.torch.register` for the ``CUDA`` dispatch key where Triton is installed).

The operators' arguments come by position; :func:`forward_impl` and :func:`backward_impl`
take their spec names (the schema's, as plain data) and return the operators' results:
(y, statistics as float64) and (dx, parameter gradients, input gradients). float64
tensors, which the kernels do not take, go to the device-agnostic implementation
(``fallback``: the generated PyTorch closed forms). The double backward and forward mode
keep that implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from derivgen.api import load
from derivgen.spec.model import Spec
from derivgen.triton import calls, launch


def _layer(spec: Spec) -> calls.Layer:
    """The generated Triton module's kernels for ``spec``."""
    return load(spec, "triton").LAYER


def forward_impl(spec: Spec, mode: str, names: Sequence[str], fallback: Callable) -> Callable:
    """The forward operator on CUDA tensors: (y, statistic...) by the Triton kernels."""

    def impl(*args: Any) -> Any:
        a = dict(zip(names, args))
        if a["x"].dtype == torch.float64:
            return fallback(*args)
        layer = _layer(spec)
        L = calls.check_call(layer.meta, mode, a)
        y, st = launch.run_forward(layer, mode, a, L, update=False)
        stats = [st[s].to(torch.float64) for s in layer.meta.stats[mode]]
        return (y, *stats) if stats else y

    return impl


def backward_impl(spec: Spec, mode: str, names: Sequence[str], fallback: Callable) -> Callable:
    """The backward operator on CUDA tensors: (dx, d<param>..., d<input>...) by the Triton kernels."""

    def impl(*args: Any) -> Any:
        a = dict(zip(names, args))
        if a["x"].dtype == torch.float64:
            return fallback(*args)
        layer = _layer(spec)
        meta = layer.meta
        L = calls.check_call(meta, mode, a)
        dx, dparams, dins = launch.run_backward(layer, mode, a, L)  # dx: x's memory format
        out = [dx, *(dparams[p] for p in meta.params)]
        for i in meta.inputs:
            d, given = dins[i], a[i]
            out.append((d.double().sum() if given.numel() == 1 else d).to(given.dtype).reshape(given.shape))
        return out[0] if len(out) == 1 else tuple(out)

    return impl
