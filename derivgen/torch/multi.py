"""The ``derivgen::`` operators of layers with tensor inputs beside x and outputs beside y
(``Spec.multi``: fused residual adds, gates, modulation, masks, several outputs).

Each mode has two operators (see :mod:`derivgen.torch.schema`)::

    <layer>_<mode>_forward(x, tensors..., params..., inputs..., [buffers...], options..., groups)
        -> (y, outputs..., statistic...)
    <layer>_<mode>_backward(dy, d<output>..., x, tensors..., params..., inputs..., [buffers...],
                            statistics..., options..., groups)
        -> (dx, d<tensor with a gradient>..., dparam..., dinput...)

* **CPU** (float32, float64, bfloat16): the generated C kernels, through a plan per call
  signature (:class:`MultiPlan`, validated on the signature's first call; a mask's 0/1
  values on every call). The ``sample`` tensors (one value per sample and feature, or per
  sample and channel) and the ``position`` ones (one value per sample and position) go to
  the kernels at their own shape (:func:`derivgen.runtime.abi.native`); the backward kernel
  sums the ``sample`` ones' gradients, and a ``position`` one's element gradients, written
  at x's shape, are summed over the channels here (in float64).
  A channel layout's channels-last x runs the channels-last kernels: the tensor inputs,
  dy and the cotangents are read channels last (written out so where they are not), and
  every result of x's shape is channels last.
* **other devices, float16, torch.func transforms, forward-mode AD and**
  :func:`derivgen.torch.portable`: the generated PyTorch closed forms
  (``derivgen.load(spec, "torch")``), which every transform differentiates.
* **autograd**: the forward's is the backward operator (a cotangent autograd leaves out,
  of an output no loss reads, is zeros); the backward's own (a differentiable backward,
  ``create_graph=True``) is torch.func's VJP of the generated PyTorch backward, which
  computes the statistics from x again, so its derivatives include theirs (the derived
  second-order kernels of these layers are not there yet: no ``bb`` and ``jvp`` operators).
* **eager CPU calls** skip the dispatcher (:class:`_Eager`, an autograd.Function over the
  plan's kernels), as :mod:`derivgen.torch.autograd` does for the other layers; the C++
  extension's fast path (:mod:`derivgen.torch.ext`) does not take these layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.autograd.forward_ad as _fwad

from derivgen.torch import closed_form, generic
from derivgen.torch.autograd import _gradients_for, _save_tensor_inputs, _saved_by_name, _scalar_values
from derivgen.torch.multi_plan import (
    LOW,
    as_x_came,
    backward_impl,
    check_call,
    dense_as_x,
    forward_impl,
    forward_tensor_names,
)
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import (
    by_spec_name,
    differentiable,
    extra_outputs,
    grad_tensors,
    tensor_count,
)
from derivgen.torch.tensors import (
    as_tuple,
    check_tensor,
    is_channels_last,
    layout,
    op_result,
    tensor_grad,
    tensor_kind,
    wide,
)

# ------------------------------------------------------------------ the generated PyTorch closed forms


def _back(t4: torch.Tensor, x: torch.Tensor, channels: bool) -> torch.Tensor:
    """An element-level result of the generated functions (4-D) in x's shape, dtype and
    memory format."""
    return as_x_came(t4.reshape(x.shape).to(x.dtype), x, channels)


def forward_values(lay: Layer, mode: str, a: dict, values: bool = True) -> tuple:
    """(y, [outputs beside y], [statistic, ...]) by the generated PyTorch forward, arguments
    by spec name (validated: errors name the argument; a mask's values with ``values``).
    Plain PyTorch operations on x's device: autograd, forward-mode AD and every torch.func
    transform differentiate them. float16/bfloat16 are computed in float32."""
    meta, x = lay.meta, a["x"]
    L = check_call(lay, mode, a, any_device=True, values=values)
    b = generic._upcast(a) if x.dtype in LOW else a
    y4, st, outs = lay.target.FORWARD[mode](b["x"].reshape(L.view4), **closed_form.views(lay, b, L, mode))
    ch = meta.layout == "channels"
    return (
        _back(y4, x, ch),
        [_back(outs[o], x, ch) for o in extra_outputs(meta)],
        [st[s].reshape(L.n_groups) for s in meta.stats[mode]],
    )


def backward_values(lay: Layer, mode: str, a: dict) -> tuple:
    """(dx, d<tensor>..., dparams..., dinputs...) by the generated PyTorch closed form (its
    statistics computed from x again: differentiable), arguments by spec name with dy and
    the cotangents ``d<output>``; in the arguments' dtypes (float16/bfloat16 in float32)."""
    meta, x = lay.meta, a["x"]
    b = generic._upcast(a) if x.dtype in LOW else a
    L = layout(meta, tuple(x.shape), {p: tuple(a[p].shape) for p in lay.params}, a["num_groups"])
    kw = closed_form.views(lay, b, L, mode)
    for o in extra_outputs(meta):
        kw["d" + o] = b["d" + o].reshape(L.view4)
    dx, dp, di, dt = lay.target.BACKWARD[mode](b["dy"].reshape(L.view4), b["x"].reshape(L.view4), **kw)
    ch = meta.layout == "channels"
    out = [_back(dx, x, ch)]
    for t in grad_tensors(meta):
        d = dt[t].reshape(x.shape)
        out.append(_back(d, x, ch) if tensor_kind(meta, t) == "x" else tensor_grad(meta, t, d, L, a[t].shape))
    out += [dp[p].reshape(a[p].shape) for p in lay.params]
    for i in lay.inputs:
        v = di[i]
        out.append(v.sum().reshape(a[i].shape) if a[i].numel() == 1 else v.reshape(a[i].shape))
    return tuple(g.to(a[n].dtype) for g, n in zip(out, differentiable(meta)))


def generic_forward_impl(lay: Layer, mode: str) -> Callable:
    """The forward operator's device-agnostic kernel: statistics float64 (float32 on MPS)."""
    fargs = lay.schemas[mode].forward

    def impl(*args):
        y, outs, st = forward_values(lay, mode, by_spec_name(fargs, args))
        return op_result((y, *outs, *(s.to(wide(y.device)) for s in st)))

    return impl


def generic_backward_impl(lay: Layer, mode: str) -> Callable:
    """The backward operator's device-agnostic kernel."""
    bargs = lay.schemas[mode].backward

    def impl(*args):
        return op_result(backward_values(lay, mode, by_spec_name(bargs, args)))

    return impl


# ------------------------------------------------------------------ registration


def _like_x(lay: Layer, x: torch.Tensor) -> torch.Tensor:
    """A fake output of x's shape (channels last where x is)."""
    return torch.empty_like(x) if lay.meta.layout == "channels" and is_channels_last(x) else x.new_empty(x.shape)


def register(lay: Layer, library: torch.library.Library, mode: str) -> tuple:
    """Define and implement one mode's forward and backward operators in ``library``, with
    fake kernels and autograd; (forward, backward) as ``torch._ops.OpOverload``."""
    s = lay.schemas[mode]
    names = {kind: f"{lay.base}_{mode}_{kind}" for kind in ("forward", "backward")}
    library.define(names["forward"] + s.forward_text())
    library.define(names["backward"] + s.backward_text())
    library.impl(names["forward"], forward_impl(lay, mode), "CPU")
    library.impl(names["backward"], backward_impl(lay, mode), "CPU")
    # every other device: the generated PyTorch closed forms
    library.impl(names["forward"], generic_forward_impl(lay, mode), "CompositeExplicitAutograd")
    library.impl(names["backward"], generic_backward_impl(lay, mode), "CompositeExplicitAutograd")
    fwd = getattr(torch.ops.derivgen, names["forward"]).default
    bwd = getattr(torch.ops.derivgen, names["backward"]).default
    _register_fakes(lay, library, mode, fwd, bwd)
    _register_autograd(lay, library, mode, fwd, bwd)
    return fwd, bwd


def _register_fakes(lay: Layer, library: torch.library.Library, mode: str, fwd, bwd) -> None:
    """The two operators' fake kernels: outputs' shapes, dtypes and memory formats."""
    s, meta = lay.schemas[mode], lay.meta
    nstat, nout = len(meta.stats[mode]), s.outputs

    def forward_fake(*args):
        a = by_spec_name(s.forward, args)
        x = a["x"]
        L = layout(meta, x.shape, {p: a[p].shape for p in lay.params}, a["num_groups"])
        like = [_like_x(lay, x) for _ in range(1 + nout)]
        return (*like, *(x.new_empty((L.n_groups,), dtype=torch.float64) for _ in range(nstat)))

    def backward_fake(*args):
        a = by_spec_name(s.backward, args)
        x = a["x"]
        dts = [_like_x(lay, x) if tensor_kind(meta, t) == "x" else x.new_empty(a[t].shape) for t in grad_tensors(meta)]
        return op_result(
            (
                _like_x(lay, x),
                *dts,
                *(x.new_empty(a[p].shape) for p in lay.params),
                *(x.new_empty(a[i].shape) for i in lay.inputs),
            )
        )

    torch.library.register_fake(fwd, forward_fake, lib=library)
    torch.library.register_fake(bwd, backward_fake, lib=library)


def _register_autograd(lay: Layer, library: torch.library.Library, mode: str, fwd, bwd) -> None:
    """The forward's autograd (the backward operator) and the backward's (torch.func's VJP
    of the generated PyTorch backward: a differentiable backward, create_graph=True)."""
    s, meta = lay.schemas[mode], lay.meta
    fargs, bargs, diff = s.forward, s.backward, differentiable(meta)
    nout, ntens = s.outputs, tensor_count(s.forward)
    cot_names = ["d" + o for o in extra_outputs(meta)]
    ch = meta.layout == "channels"

    def setup_forward(ctx, inputs, output):
        ctx.inputs = inputs
        stats = as_tuple(output)[1 + nout :]
        ctx.save_for_backward(*[v for a, v in zip(fargs, inputs) if a.type == "Tensor"], *stats)
        if stats:
            ctx.mark_non_differentiable(*stats)

    def backward_of_forward(ctx, dy, *rest):
        saved = ctx.saved_tensors
        tensors, stats = saved[:ntens], saved[ntens:]
        x = tensors[0]
        cots = [torch.zeros_like(x) if c is None else dense_as_x(c, x, ch) for c in (dy, *rest[:nout])]
        grads = as_tuple(bwd(*cots, *tensors, *stats, *_scalar_values(fargs, ctx.inputs)))
        return _gradients_for(fargs, dict(zip(diff, grads)))

    def backward_of_backward(ctx, *cotangents):
        a = _saved_by_name(bargs, ctx)
        wrt = ["dy", *cot_names, *diff]
        outs = backward_values(lay, mode, a)
        cot = tuple(torch.zeros_like(o) if c is None else c for c, o in zip(cotangents, outs))
        _, vjp = torch.func.vjp(lambda *p: backward_values(lay, mode, {**a, **dict(zip(wrt, p))}), *(a[w] for w in wrt))
        return _gradients_for(bargs, dict(zip(wrt, vjp(cot))))

    torch.library.register_autograd(fwd, backward_of_forward, setup_context=setup_forward, lib=library)
    torch.library.register_autograd(bwd, backward_of_backward, setup_context=_save_tensor_inputs(bargs), lib=library)


# ------------------------------------------------------------------ calls


class _Eager(torch.autograd.Function):
    """Eager calls on CPU tensors, without the dispatcher: the plan's forward kernel, and
    its backward kernel on the saved tensors (the backward operator when the backward must
    be differentiable, create_graph=True). The statistics are one (statistics, groups)
    tensor kept on the context and handed to the caller through ``box``."""

    @staticmethod
    def forward(ctx, plan, opts, box, *tens):
        """y and the outputs beside y by the forward kernel."""
        y, outs, st = plan.forward(tens, opts, blob=True)
        ctx.plan, ctx.opts, ctx.st = plan, opts, st
        ctx.save_for_backward(*tens)
        box.append(st)
        return (y, *outs)

    @staticmethod
    def backward(ctx, dy, *douts):
        """The gradients of the tensors (None for masks and what has none)."""
        plan, st, tens = ctx.plan, ctx.st, ctx.saved_tensors
        x = tens[0]
        cots = [torch.zeros_like(x) if d is None else d for d in (dy, *douts)]
        if torch.is_grad_enabled():
            op = plan.lay.modes[plan.mode].backward
            cots = [dense_as_x(c, x, plan.channels) for c in cots]
            grads = as_tuple(op(*cots, *tens, *st.unbind(0), *ctx.opts, plan.groups))
        else:
            base = st.data_ptr()
            grads = plan.backward(cots[0], cots[1:], tens, [base + o for o in plan.stat_offsets], ctx.opts)
        return (None, None, None, *plan.grads_by_tensor(grads))


# _Eager.apply without torch.autograd.Function.apply's Python wrapper (see
# derivgen.torch.autograd): only reached with no torch.func transform active
_eager_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Eager)


class _Portable(torch.autograd.Function):
    """The device-agnostic operators' arithmetic on any tensors (within
    :func:`derivgen.torch.portable`, and float16 on the CPU): the generated forward, and
    in reverse mode the generated closed-form backward (recorded when the backward must be
    differentiable)."""

    @staticmethod
    def forward(ctx, lay, mode, opts, groups, *tens):
        """y, the outputs beside y and the statistics (not differentiable)."""
        a = by_spec_name(lay.schemas[mode].forward, [*tens, *opts, groups])
        y, outs, st = forward_values(lay, mode, a)
        ctx.lay, ctx.mode, ctx.opts, ctx.groups, ctx.nout = lay, mode, opts, groups, len(outs)
        ctx.save_for_backward(*tens)
        if st:
            ctx.mark_non_differentiable(*st)
        return (y, *outs, *st)

    @staticmethod
    def backward(ctx, dy, *rest):
        """The closed-form backward (plain PyTorch operations)."""
        lay, mode, tens = ctx.lay, ctx.mode, ctx.saved_tensors
        a = by_spec_name(lay.schemas[mode].forward, [*tens, *ctx.opts, ctx.groups])
        x = tens[0]
        a["dy"] = torch.zeros_like(x) if dy is None else dy
        for o, c in zip(extra_outputs(lay.meta), rest[: ctx.nout]):
            a["d" + o] = torch.zeros_like(x) if c is None else c
        by = dict(zip(differentiable(lay.meta), backward_values(lay, mode, a)))
        return (None, None, None, None, *(by.get(n) for n in forward_tensor_names(lay, mode)))


def _functorch() -> bool:
    return torch._C._are_functorch_transforms_active()


def call_forward(
    lay: Layer, mode: str, tens: list, opts: tuple, groups: int, stats: bool = True
) -> tuple[tuple, dict[str, torch.Tensor] | None]:
    """((y, outputs beside y...), {statistic: tensor}) of a forward call in operator order
    (statistics None with ``stats=False`` on the eager path). Under torch.func transforms
    and forward-mode AD the generated PyTorch forward (plain operations); eager CPU calls
    the plan's kernels (:class:`_Eager` when autograd needs them), or within
    :func:`derivgen.torch.portable` and for float16 the closed forms (:class:`_Portable`);
    anything else (torch.compile, other devices) the registered operators."""
    names, nout = lay.meta.stats[mode], len(extra_outputs(lay.meta))
    x = tens[0]
    if _functorch() or _fwad._current_level >= 0:
        a = by_spec_name(lay.schemas[mode].forward, [*tens, *opts, groups])
        y, outs, st = forward_values(lay, mode, a, values=not _functorch())
        return (y, *outs), dict(zip(names, st))
    if isinstance(x, torch.Tensor) and x.is_cpu and not torch.compiler.is_compiling():
        if generic.ON or x.dtype == torch.float16:
            out = _Portable.apply(lay, mode, opts, groups, *tens)
            return tuple(out[: 1 + nout]), dict(zip(names, out[1 + nout :]))
        plan = lay.plans.forward(mode, tens, opts, groups)
        if torch.is_grad_enabled() and any([isinstance(t, torch.Tensor) and t.requires_grad for t in tens]):  # noqa: C419
            box: list = []
            out = _eager_apply(plan, opts, box, *tens)
            st = box[0]
        else:
            y, outs, st = plan.forward(tens, opts, blob=True)
            out = (y, *outs)
        return tuple(out), (dict(zip(names, st.unbind(0))) if stats else None)
    for k, t in zip(forward_tensor_names(lay, mode), tens):
        check_tensor(lay.meta.name, k, t, any_device=True)  # a wrong dtype: an error naming it
    out = as_tuple(lay.modes[mode].forward(*tens, *opts, groups))
    return tuple(out[: 1 + nout]), dict(zip(names, out[1 + nout :]))
