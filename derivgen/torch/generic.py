"""The device-agnostic path: the generated PyTorch closed forms (``derivgen.load(spec,
"torch")``) as the operators' implementation wherever the C kernels cannot run.

* tensors on a device without compiled kernels (CUDA, MPS, XPU ...): the operators'
  ``CompositeExplicitAutograd`` kernels (registered by :mod:`derivgen.torch.register`):
  the forward by the generated forward, the backward by the generated closed form, the
  double backward and forward mode by torch.func over them;
* under torch.func transforms (``grad``, ``vjp``, ``jvp``, ``vmap``, ``jacrev``,
  ``jacfwd``, ``hessian``): the generated forward as plain PyTorch operations, which
  every transform differentiates and batches (:func:`forward_values`);
* on CPU tensors when asked (:func:`derivgen.torch.portable`): the same operators'
  arithmetic through :class:`Portable`, an autograd.Function, so the path can be
  checked where there is no other device.

float16 and bfloat16 inputs are computed in float32 (statistics and sums) and the
output is cast back to the input's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from derivgen.torch import closed_form
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import by_spec_name, differentiable
from derivgen.torch.tensors import channels_last_format, is_channels_last, wide
from derivgen.torch.validate import check_on_tensors

LOW = (torch.float16, torch.bfloat16)

ON = False  # within portable(): read on every eager call, so a plain module global


@contextmanager
def portable(enabled: bool = True) -> Iterator[None]:
    """Within the block, derivgen.torch's layers run the device-agnostic path on CPU
    tensors too: the generated PyTorch closed forms instead of the C kernels (the path
    every device without compiled kernels takes). The setting is the process's (every
    thread's), restored on leaving the block."""
    global ON
    old, ON = ON, bool(enabled)
    try:
        yield
    finally:
        ON = old


def forced() -> bool:
    """Whether :func:`portable` is in effect."""
    return ON


def _upcast(a: dict) -> dict:
    """float16/bfloat16 tensors of a call as float32 (statistics and sums in float32)."""
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype in LOW else v) for k, v in a.items()}


def forward_values(lay: Layer, mode: str, a: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(y, [statistic, ...]) of a forward call by the generated PyTorch forward, arguments
    by spec name (validated: errors name the argument). Plain PyTorch operations on x's
    device: autograd and every torch.func transform differentiate them. Statistics are
    one value per group, in x's dtype (float32 for float16/bfloat16 inputs)."""
    x = a["x"]
    L = check_on_tensors(lay.meta, mode, a, any_device=True)
    b = _upcast(a) if x.dtype in LOW else a
    y4, st = lay.target.FORWARD[mode](b["x"].reshape(L.view4), **closed_form.views(lay, b, L, mode))
    y = y4.reshape(x.shape).to(x.dtype)
    if lay.meta.layout == "channels" and is_channels_last(x):
        y = y.contiguous(memory_format=channels_last_format(x))
    return y, [st[s].reshape(L.n_groups) for s in lay.meta.stats[mode]]


def forward_impl(lay: Layer, mode: str):
    """The forward operator's device-agnostic kernel: (y, statistics...), the statistics
    float64 (float32 on MPS, which has no float64)."""
    fargs = lay.schemas[mode].forward

    def impl(*args):
        y, st = forward_values(lay, mode, by_spec_name(fargs, args))
        return (y, *(s.to(wide(y.device)) for s in st)) if st else y

    return impl


def backward_values(lay: Layer, mode: str, a: dict) -> tuple:
    """(dx, dparams..., dinputs...) by the generated closed form, in the arguments'
    dtypes (float16/bfloat16 computed in float32)."""
    if a["x"].dtype not in LOW:
        return closed_form.target_backward(lay, mode, a)
    got = closed_form.target_backward(lay, mode, _upcast(a))
    return tuple(g.to(a[n].dtype) for g, n in zip(got, differentiable(lay.meta)))


def backward_impl(lay: Layer, mode: str):
    """The backward operator's device-agnostic kernel."""
    bargs = lay.schemas[mode].backward

    def impl(*args):
        out = backward_values(lay, mode, by_spec_name(bargs, args))
        return out[0] if len(out) == 1 else out

    return impl


def second_impl(lay: Layer, mode: str, kind: str):
    """The ``bb`` or ``jvp`` operator's device-agnostic kernel (torch.func over the closed forms)."""
    args = lay.schemas[mode].bb if kind == "bb" else lay.schemas[mode].jvp

    def impl(*values):
        a = by_spec_name(args, values)
        return lay._generic_bb(mode, a) if kind == "bb" else lay._generic_jvp(mode, a)

    return impl


class Portable(torch.autograd.Function):
    """The device-agnostic operators' arithmetic on any tensors (:func:`portable`): the
    generated forward; reverse mode by the generated closed-form backward (its operations
    are recorded when the backward must be differentiable); forward mode by the JVP of
    the generated forward."""

    @staticmethod
    def forward(ctx, lay, mode, opts, groups, *tens):
        """y and the statistics (not differentiable)."""
        fargs = lay.schemas[mode].forward
        a = by_spec_name(fargs, [*tens, *opts, groups])
        y, st = forward_values(lay, mode, a)
        ctx.lay, ctx.mode, ctx.opts, ctx.groups, ctx.ntens = lay, mode, opts, groups, len(tens)
        ctx.save_for_backward(*tens)
        ctx.save_for_forward(*tens)
        ctx.mark_non_differentiable(*st)
        return (y, *st)

    @staticmethod
    def _args(ctx, tens) -> dict:
        fargs = ctx.lay.schemas[ctx.mode].forward
        return by_spec_name(fargs, [*tens, *ctx.opts, ctx.groups])

    @staticmethod
    def backward(ctx, dy, *dstats):
        """The closed-form backward (differentiable: plain PyTorch operations)."""
        tens = ctx.saved_tensors
        a = Portable._args(ctx, tens)
        a["dy"] = dy
        grads = backward_values(ctx.lay, ctx.mode, a)
        return (None, None, None, None, *grads, *([None] * (ctx.ntens - len(grads))))

    @staticmethod
    def jvp(ctx, _lay, _mode, _opts, _groups, *tangents):
        """y's tangent by the JVP of the generated forward."""
        tens = ctx.saved_tensors
        ty = jvp_values(ctx.lay, ctx.mode, Portable._args(ctx, tens), tangents)
        return (ty, *(None for _ in ctx.lay.meta.stats[ctx.mode]))


def jvp_values(lay: Layer, mode: str, a: dict, tangents) -> torch.Tensor:
    """y's tangent along ``tangents`` (one per differentiable argument, None for zero) as
    the derivative of a VJP of the generated forward in its cotangent (reverse over
    reverse: forward-mode AD cannot nest inside a forward-mode rule)."""
    diff = differentiable(lay.meta)
    with torch.enable_grad():
        prim = [a[n].detach().requires_grad_(True) for n in diff]
        y, _ = forward_values(lay, mode, {**a, **dict(zip(diff, prim))})
        u = torch.zeros_like(y, requires_grad=True)
        g = torch.autograd.grad(y, prim, u, create_graph=True, allow_unused=True)
        pairs = [(gi, t) for gi, t in zip(g, tangents) if gi is not None and t is not None]
        if not pairs:
            return torch.zeros_like(y)
        got = torch.autograd.grad([p for p, _ in pairs], u, [t for _, t in pairs], allow_unused=True)[0]
    return torch.zeros_like(y) if got is None else got.detach()
