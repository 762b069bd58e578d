"""The generated PyTorch target (``derivgen.load(spec, "torch")``) behind the operators:
the running-buffer update, and the derivatives the C kernels do not cover (bfloat16,
channels last, third order), by torch.func over the generated closed forms: exact at
any order.

Arguments are dicts by spec name, as :func:`derivgen.torch.schema.by_spec_name` gives
them (the seeds of the second order as ``c_<name>`` and tangents as ``t_<name>``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from derivgen import runtime as rt
from derivgen.runtime.abi import reads_buffers
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import differentiable, tensor_inputs
from derivgen.torch.tensors import full_tensor, layout, wide


def views(lay: Layer, a: dict, L: rt.Layout, mode: str) -> dict:
    """Keyword arguments of the generated PyTorch functions: 4-D views."""
    kw = {"_L": L}
    for t in tensor_inputs(lay.meta):  # a multi layer's tensor inputs, at x's shape
        kw[t] = full_tensor(lay.meta, t, a[t], L).reshape(L.view4)
    for p in lay.params:
        kw[p] = a[p].reshape((1, 1, 1, 1) if p in lay.meta.scalar_params else L.param4)
    for i in lay.inputs:
        kw[i] = a[i].reshape((1, 1, 1, 1) if a[i].numel() == 1 else L.stat4)
    for b in lay.buffers:
        v = a.get(b) if reads_buffers(lay.meta, mode) else None
        kw[b] = None if v is None else v.reshape(L.stat4)
    for o in lay.options:
        kw[o] = a[o]
    return kw


def _layout_of(lay: Layer, a: dict) -> rt.Layout:
    """The layout of a call's arguments by spec name."""
    return layout(lay.meta, a["x"].shape, {p: a[p].shape for p in lay.params}, a["num_groups"])


def target_backward(lay: Layer, mode: str, a: dict) -> tuple:
    """(dx, dparams..., dinputs...) by the generated PyTorch closed form, shaped as
    the backward operator returns them."""
    x = a["x"]
    L = _layout_of(lay, a)
    dx, dp, di = lay.target.BACKWARD[mode](a["dy"].reshape(L.view4), x.reshape(L.view4), **views(lay, a, L, mode))
    out = [dx.reshape(x.shape)]
    out += [dp[p].reshape(a[p].shape) for p in lay.params]
    for i in lay.inputs:
        v = di[i]
        out.append(v.sum().reshape(a[i].shape) if a[i].numel() == 1 else v.reshape(a[i].shape))
    return tuple(out)


def with_primals(fn: Callable[[dict], object], a: dict, names: list[str]) -> Callable:
    """``fn`` of the arguments ``a`` as a function of the entries ``names`` (positionally),
    for torch.func."""

    def of_primals(*primals):
        b = dict(a)
        b.update(zip(names, primals))
        return fn(b)

    return of_primals


def generic_bb(lay: Layer, mode: str, a: dict) -> tuple:
    """The double backward as torch.func's VJP of the generated PyTorch backward
    (bfloat16, channels last, third order): (dx, ddy, dparams..., dinputs...)."""
    diff = differentiable(lay.meta)
    wrt = ["dy", *diff]
    f = with_primals(lambda b: target_backward(lay, mode, b), a, wrt)
    _, vjp = torch.func.vjp(f, *(a[w] for w in wrt))
    by = dict(zip(wrt, vjp(tuple(a["c_" + n] for n in diff))))
    return (by["x"], by["dy"], *(by[p] for p in lay.params), *(by[i] for i in lay.inputs))


def _target_forward(lay: Layer, mode: str, b: dict) -> torch.Tensor:
    """y by the generated PyTorch forward, in x's shape."""
    L = _layout_of(lay, b)
    return lay.target.FORWARD[mode](b["x"].reshape(L.view4), **views(lay, b, L, mode))[0].reshape(b["x"].shape)


def generic_jvp(lay: Layer, mode: str, a: dict) -> torch.Tensor:
    """y's tangent as torch.func's JVP of the generated PyTorch forward."""
    diff = differentiable(lay.meta)
    f = with_primals(lambda b: _target_forward(lay, mode, b), a, diff)
    return torch.func.jvp(f, tuple(a[n] for n in diff), tuple(a["t_" + n] for n in diff))[1]


def update_buffers(
    lay: Layer, stats: dict, buffers: dict, options: dict, group_size: int, reduce_dims: tuple[int, ...] = ()
) -> None:
    """Apply the spec's running-buffer updates in place (no autograd). Statistics are
    per-group float64 tensors shaped like the buffers, or with extra leading
    ``reduce_dims`` to average over (instance norm's per-sample statistics). An empty
    batch (``group_size`` 0, or a 0 in ``reduce_dims``) leaves them as they are, as torch.nn does."""
    if group_size == 0 or 0 in reduce_dims:
        return
    with torch.no_grad():
        shape = next(iter(buffers.values())).shape
        vals = {s: t.reshape(*reduce_dims, *shape) for s, t in stats.items()}
        dt = wide(next(iter(buffers.values())).device)  # float64 (float32 on MPS)
        bufs64 = {b: v.to(dt) for b, v in buffers.items()}
        vals = {s: t.to(dt) for s, t in vals.items()}
        opts = {o: (v.to(dt) if isinstance(v, torch.Tensor) else v) for o, v in options.items()}
        new = lay.target.update_buffers(**vals, **bufs64, **opts, N=group_size)
        for b, v in new.items():
            if reduce_dims:
                v = v.mean(dim=tuple(range(len(reduce_dims))))
            buffers[b].copy_(v)
