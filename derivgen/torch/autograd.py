"""Autograd and forward-mode glue of the ``derivgen::`` operators.

* the forward operator's ``register_autograd`` calls the backward operator;
* the backward operator's own is the derived double backward (the ``bb`` operator);
* the ``bb`` and ``jvp`` operators' are the generated PyTorch closed form differentiated
  by torch.func (third order; reverse over forward);
* eager calls on CPU tensors skip the dispatcher: through the C++ extension
  (:mod:`derivgen.torch.ext`: the kernels and their autograd node, no Python per call)
  where a plan allows it and the extension is built, else :class:`_Eager`; calls under a single
  torch.func jvp level go through :class:`_Functional` (the operators), and under
  grad, vjp, vmap or nested transforms run the generated PyTorch forward
  (:mod:`derivgen.torch.generic`): :func:`call_forward` picks.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.autograd.forward_ad as _fwad
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from derivgen.torch import generic
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import OpArg, by_spec_name, differentiable
from derivgen.torch.tensors import as_tuple, check_tensor


def _tensor_values(args: tuple[OpArg, ...], values) -> list:
    return [v for a, v in zip(args, values) if a.type == "Tensor"]


def _scalar_values(args: tuple[OpArg, ...], values) -> list:
    return [v for a, v in zip(args, values) if a.type != "Tensor"]


def _saved_by_name(args: tuple[OpArg, ...], ctx) -> dict:
    """A context's saved tensors and its scalar inputs, by spec name."""
    a = dict(zip([s.spec for s in args if s.type == "Tensor"], ctx.saved_tensors))
    a.update({s.spec: v for s, v in zip(args, ctx.inputs) if s.type != "Tensor"})
    return a


def _gradients_for(args: tuple[OpArg, ...], grads: dict) -> tuple:
    """One gradient per operator argument (None for scalars and what has none)."""
    return tuple(grads.get(a.spec) if a.type == "Tensor" else None for a in args)


def _save_tensor_inputs(args: tuple[OpArg, ...]):
    """A ``setup_context`` that keeps the inputs and saves the tensor ones."""

    def setup(ctx, inputs, output):
        ctx.inputs = inputs
        ctx.save_for_backward(*_tensor_values(args, inputs))

    return setup


def register_first_order(lay: Layer, lib: torch.library.Library, mode: str, ops: Any) -> None:
    """The forward operator's autograd (the backward operator) and the backward
    operator's (the derived double backward, one ``bb`` call); ``ops`` is the mode's
    :class:`~derivgen.torch.register.ModeOps`."""
    s = lay.schemas[mode]
    fargs, bargs, diff = s.forward, s.backward, differentiable(lay.meta)
    n_tensors = len(_tensor_values(fargs, fargs))

    def setup_forward(ctx, inputs, output):
        ctx.inputs = inputs
        output = as_tuple(output)
        ctx.save_for_backward(*_tensor_values(fargs, inputs), *output[1:])
        if len(output) > 1:
            ctx.mark_non_differentiable(*output[1:])

    def backward_of_forward(ctx, dy, *dstats):
        saved = ctx.saved_tensors
        tensors, stats = saved[:n_tensors], saved[n_tensors:]
        grads = as_tuple(ops.backward(dy.contiguous(), *tensors, *stats, *_scalar_values(fargs, ctx.inputs)))
        return _gradients_for(fargs, dict(zip(diff, grads)))

    def backward_of_backward(ctx, *cotangents):
        tensors = ctx.saved_tensors
        a = dict(zip([t.spec for t in bargs if t.type == "Tensor"], tensors))
        outs = [a[n] for n in diff]
        cot = [torch.zeros_like(o) if c is None else c for c, o in zip(cotangents, outs)]
        got = as_tuple(ops.bb(*tensors, *cot, *_scalar_values(bargs, ctx.inputs)))
        return _gradients_for(bargs, dict(zip(["x", "dy", *diff[1:]], got)))

    torch.library.register_autograd(ops.forward, backward_of_forward, setup_context=setup_forward, lib=lib)
    torch.library.register_autograd(
        ops.backward, backward_of_backward, setup_context=_save_tensor_inputs(bargs), lib=lib
    )


def register_second_order(lay: Layer, lib: torch.library.Library, mode: str, ops: Any) -> None:
    """The ``bb`` and ``jvp`` operators' autograd: the generated PyTorch closed form,
    differentiated by torch.func (third order; jacrev of jacfwd, a loss on a tangent)."""
    s = lay.schemas[mode]
    diff = differentiable(lay.meta)

    def backward_of_bb(ctx, *cots):
        a = _saved_by_name(s.bb, ctx)
        wrt = ["dy", *diff, *("c_" + n for n in diff)]
        outs = lay._generic_bb(mode, a)
        cot = tuple(torch.zeros_like(o) if c is None else c for c, o in zip(cots, outs))
        _, vjp = torch.func.vjp(lambda *p: lay._generic_bb(mode, {**a, **dict(zip(wrt, p))}), *(a[w] for w in wrt))
        return _gradients_for(s.bb, dict(zip(wrt, vjp(cot))))

    def backward_of_jvp(ctx, cot):
        a = _saved_by_name(s.jvp, ctx)
        wrt = [*diff, *("t_" + n for n in diff)]
        _, vjp = torch.func.vjp(lambda *p: lay._generic_jvp(mode, {**a, **dict(zip(wrt, p))}), *(a[w] for w in wrt))
        return _gradients_for(s.jvp, dict(zip(wrt, vjp(cot))))

    torch.library.register_autograd(ops.bb, backward_of_bb, setup_context=_save_tensor_inputs(s.bb), lib=lib)
    torch.library.register_autograd(ops.jvp, backward_of_jvp, setup_context=_save_tensor_inputs(s.jvp), lib=lib)


class _Eager(torch.autograd.Function):
    """Eager calls on CPU tensors skip the dispatcher: a validated plan's kernels under a
    plain autograd.Function (the dispatcher's Python autograd wrapper costs more than
    the 8x1024 layer norm kernels themselves). The same kernels, the same numbers;
    torch.compile, non-CPU tensors and a single torch.func jvp level go through the
    registered operators, other torch.func transforms through the generated PyTorch forward. The statistics are one (statistics, groups) tensor, kept on the context
    (not an output: autograd has nothing to track for them) and handed to the caller
    through ``box``. The backward reuses the forward's plan: autograd hands it a
    gradient of y's shape and dtype, and the saved tensors are the validated ones
    (version counters catch in-place changes). A backward that must be differentiable
    (create_graph=True) calls the backward operator, whose registered autograd
    differentiates the generated PyTorch target."""

    @staticmethod
    def forward(ctx, plan, opts, box, *tens):
        """Run the forward kernels; keep the statistics and inputs for backward and jvp."""
        y, st = plan.forward(tens, opts, blob=True)
        ctx.plan, ctx.opts, ctx.st = plan, opts, st
        ctx.save_for_backward(*tens)
        if _fwad._current_level >= 0:  # jvp() reads them only under forward AD
            ctx.save_for_forward(*tens)
        box.append(st)
        return y

    @staticmethod
    def jvp(ctx, _plan, _opts, _box, *tangents):
        """Forward mode (torch.autograd.forward_ad): the derived JVP kernel."""
        plan, tens = ctx.plan, ctx.saved_tensors
        t = [torch.zeros_like(v) if d is None else d for d, v in zip(tangents, tens)]
        n = 1 + len(plan.lay.params) + len(plan.lay.inputs)
        return plan.lay.modes[plan.mode].jvp(*tens, *ctx.st.unbind(0), *t[:n], *ctx.opts, plan.groups)

    @staticmethod
    def backward(ctx, dy):
        """dx and the parameter/input gradients: the backward kernel, or the backward operator
        when the graph must be differentiable."""
        plan, st = ctx.plan, ctx.st
        tens = ctx.saved_tensors
        if torch.is_grad_enabled():
            grads = as_tuple(
                plan.lay.modes[plan.mode].backward(dy.contiguous(), *tens, *st.unbind(0), *ctx.opts, plan.groups)
            )
        else:
            base = st.data_ptr()
            grads = plan.backward(dy, tens, [base + o for o in plan.stat_offsets], ctx.opts)
        return (None, None, None, *grads, *([None] * (len(tens) - len(grads))))


class _Functional(torch.autograd.Function):
    """The operators under a single ``torch.func.jvp`` level: the JVP operator (the derived
    JVP kernel, derivgen.derive.second) for forward mode, and the backward operator for
    reverse mode outside it. torch.func runs the forward on the unwrapped tensors, so the
    operators' CPU kernels validate and compute as in eager mode."""

    @staticmethod
    def forward(lay: Layer, mode, opts, groups, *tens):
        """The forward operator (y and the statistics)."""
        return as_tuple(lay.modes[mode].forward(*tens, *opts, groups))

    @staticmethod
    def setup_context(ctx, inputs, output):
        """Save the inputs and statistics; the statistics are not differentiable."""
        lay, mode, opts, groups, *tens = inputs
        ctx.lay, ctx.mode, ctx.opts, ctx.groups, ctx.ntens = lay, mode, opts, groups, len(tens)
        ctx.save_for_backward(*tens, *output[1:])
        ctx.save_for_forward(*tens, *output[1:])
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, dy, *dstats):
        """Reverse mode through the backward operator (autograd outside the jvp level)."""
        lay, saved = ctx.lay, ctx.saved_tensors
        tens, st = saved[: ctx.ntens], saved[ctx.ntens :]
        grads = as_tuple(lay.modes[ctx.mode].backward(dy.contiguous(), *tens, *st, *ctx.opts, ctx.groups))
        return (None, None, None, None, *grads, *([None] * (ctx.ntens - len(grads))))

    @staticmethod
    def jvp(ctx, _lay, _mode, _opts, _groups, *tangents):
        """Forward mode through the JVP operator."""
        lay, saved = ctx.lay, ctx.saved_tensors
        tens, st = saved[: ctx.ntens], saved[ctx.ntens :]
        n = 1 + len(lay.params) + len(lay.inputs)
        t = [torch.zeros_like(v) if d is None else d for d, v in zip(tangents[:n], tens)]
        ty = lay.modes[ctx.mode].jvp(*tens, *st, *t, *ctx.opts, ctx.groups)
        return (ty, *(None for _ in st))


def _one_jvp_level() -> bool:
    """Whether the active torch.func transforms are a single ``jvp`` level: the operators
    (the derived JVP kernel) take it. grad/vjp levels cannot (the operators' registered
    autograd has no setup_context, which torch.func requires), nor can vmap (no batching
    rule): those, and nested levels, take the generated PyTorch forward."""
    levels = retrieve_all_functorch_interpreters()
    return len(levels) == 1 and levels[0].key() == TransformType.Jvp


# _Eager.apply without torch.autograd.Function.apply's Python wrapper (default-argument
# binding and the functorch branch), which is not needed here: only reached with no
# functorch transform active (call_forward sends those to the generated PyTorch forward)
_eager_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Eager)


def _compiled_autograd() -> bool:
    """Is compiled autograd on (``torch._dynamo.config.compiled_autograd``, or its context)?
    Its graphs need what a Python ``autograd.Function`` gives a node (``compiled_args``),
    which the C++ extension's node has not: such a call takes the Python path."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is None:
        return False
    cfg = sys.modules.get("torch._dynamo.config")
    return bool(ca.compiled_autograd_enabled or (cfg is not None and cfg.compiled_autograd))


def call_forward(
    lay: Layer, mode: str, tens: list, opts: tuple, groups: int, stats: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """(y, {statistic: tensor}) of a forward call in operator order ((y, None) with
    ``stats=False`` on the eager path). First the C++ plan of the mode's last eager call
    (:mod:`derivgen.torch.ext`), which runs the call when its tensors, options and groups
    fit and no torch.func transform, forward AD or compilation is active. Else: under a
    single torch.func ``jvp`` level the operators (:class:`_Functional`); under any other
    torch.func transforms (grad, vjp, vmap, nested levels) the generated PyTorch forward
    (:mod:`derivgen.torch.generic`: every transform differentiates and batches it); eager
    CPU calls a plan's kernels (through its C++ extension where it has one, else under
    :class:`_Eager` when autograd or forward AD needs it), or within
    :func:`derivgen.torch.portable` the device-agnostic path; anything else
    (torch.compile, other devices) the registered operators."""
    if not (
        torch.compiler.is_compiling()
        or _fwad._current_level >= 0
        or generic.ON
        or torch._C._are_functorch_transforms_active()
        or _compiled_autograd()
    ):
        fast = lay.plans.last_ext.get(mode)
        out = None if fast is None else fast(tens, opts, groups)
        if out is not None:  # the tensors, options and groups of the last plan's call (the C++ extension)
            return out[0], (dict(zip(lay.meta.stats[mode], out[1].unbind(0))) if stats else None)
    x = tens[0]
    names = lay.meta.stats[mode]
    if torch._C._are_functorch_transforms_active():
        if x.is_cpu and not generic.ON and not torch.compiler.is_compiling() and _one_jvp_level():
            out = _Functional.apply(lay, mode, opts, groups, *tens)
            return out[0], dict(zip(names, out[1:]))
        y, st = generic.forward_values(lay, mode, by_spec_name(lay.schemas[mode].forward, [*tens, *opts, groups]))
        return y, dict(zip(names, st))
    if isinstance(x, torch.Tensor) and x.is_cpu and not torch.compiler.is_compiling():
        if generic.ON or x.dtype == torch.float16:  # float16: no C kernels, the closed forms
            out = generic.Portable.apply(lay, mode, opts, groups, *tens)
            return out[0], dict(zip(names, out[1:]))
        plan = lay.plans.forward(mode, tens, opts, groups)
        use_ext = plan.ext is not None and _fwad._current_level < 0 and not _compiled_autograd()
        out = plan.ext(tens, opts, groups) if use_ext else None
        if out is not None:
            lay.plans.last_ext[mode] = plan.ext  # the next call with this signature skips the lookup
            return out[0], (dict(zip(names, out[1].unbind(0))) if stats else None)
        # a list, not a generator: faster for a few tensors on this per-call path
        if (torch.is_grad_enabled() and any([t.requires_grad for t in tens])) or _fwad._current_level >= 0:  # noqa: C419
            box = []
            y = _eager_apply(plan, opts, box, *tens)
            st = box[0]
        else:
            y, st = plan.forward(tens, opts, blob=True)
        return y, (dict(zip(names, st.unbind(0))) if stats else None)
    for k, t in zip(differentiable(lay.meta), tens):
        check_tensor(lay.meta.name, k, t, any_device=True)  # a wrong dtype: an error naming it
    out = as_tuple(lay.modes[mode].forward(*tens, *opts, groups))
    return out[0], dict(zip(names, out[1:]))
