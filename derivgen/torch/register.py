"""torch.library registration of a layer's ``derivgen::`` operators: their schemas
(:mod:`derivgen.torch.schema`), CPU implementations (the plans of
:mod:`derivgen.torch.plan`, the second order of :mod:`derivgen.torch.second_order`),
implementations for every other device (``CompositeExplicitAutograd``: the generated
PyTorch closed forms, :mod:`derivgen.torch.generic`), CUDA implementations of the forward
and backward by the generated Triton kernels where Triton is installed
(:mod:`derivgen.triton.ops`), fake
(meta) kernels giving shapes and dtypes, so that ``torch.compile`` traces a model
through the operators without graph breaks, and autograd (:mod:`derivgen.torch.autograd`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from derivgen.codegen import targets
from derivgen.torch import generic, multi
from derivgen.torch.autograd import register_first_order, register_second_order
from derivgen.torch.plan import call_key
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import by_spec_name, is_multi, tensor_count
from derivgen.torch.second_order import second_impl
from derivgen.torch.tensors import is_channels_last, layout, op_result
from derivgen.torch.validate import check_backward_extras

LIBRARY = torch.library.Library("derivgen", "FRAGMENT")


@dataclass(frozen=True)
class ModeOps:
    """The registered operators of one mode (``torch._ops.OpOverload`` each)."""

    mode: str
    forward: object
    backward: object
    bb: object = None  # the double backward (derived kernels)
    jvp: object = None  # the forward-mode derivative (derived kernels)


def forward_impl(lay: Layer, mode: str) -> Callable:
    """The forward operator's CPU implementation: the plan of the call's signature."""
    fargs = lay.schemas[mode].forward
    ntens, nopt = tensor_count(fargs), len(lay.options)

    def impl(*args):
        tens, opts = args[:ntens], args[ntens : ntens + nopt]
        y, st = lay.plans.forward(mode, tens, opts, args[-1]).forward(tens, opts, blob=False)
        return op_result((y, *st))

    return impl


def backward_impl(lay: Layer, mode: str) -> Callable:
    """The backward operator's CPU implementation: the plan of the forward's signature,
    validated with dy and the statistics on a signature's first call."""
    bargs = lay.schemas[mode].backward
    stats = lay.meta.stats[mode]
    ntens, nstat, nopt = tensor_count(bargs), len(stats), len(lay.options)
    plans: dict = {}

    def impl(*args):
        tens, opts = args[:ntens], args[ntens : ntens + nopt]
        key, nhwc = call_key(tens, 1, args[-1], lay.plans.channel_layout)
        plan = plans.get(key)
        if plan is None or not lay.plans.options_ok(opts):
            a = by_spec_name(bargs, args)
            fvalues = [v for arg, v in zip(bargs, args) if arg.spec != "dy" and arg.spec not in stats]
            fkey = call_key(fvalues[: ntens - 1 - nstat], 0, args[-1], lay.plans.channel_layout)[0]
            plan = lay.plans.validated(mode, fvalues, fkey, nhwc)
            check_backward_extras(lay.meta, mode, a, plan.n_groups)
            plans[key] = plan
        st = [t.contiguous() for t in tens[ntens - nstat :]]
        return op_result(plan.backward(tens[0], tens[1 : ntens - nstat], [t.data_ptr() for t in st], opts))

    return impl


def _like_x(lay: Layer, x: torch.Tensor) -> torch.Tensor:
    """A fake output of x's shape (channels last where x is)."""
    return torch.empty_like(x) if lay.meta.layout == "channels" and is_channels_last(x) else x.new_empty(x.shape)


def register_fakes(lay: Layer, mode: str, ops: ModeOps) -> None:
    """The four operators' fake kernels: outputs' shapes and dtypes."""
    s, stats = lay.schemas[mode], lay.meta.stats[mode]

    def forward_fake(*args):
        a = by_spec_name(s.forward, args)
        x = a["x"]
        L = layout(lay.meta, x.shape, {p: a[p].shape for p in lay.params}, a["num_groups"])
        return op_result((_like_x(lay, x), *(x.new_empty((L.n_groups,), dtype=torch.float64) for _ in stats)))

    def backward_fake(*args):
        a = by_spec_name(s.backward, args)
        x = a["x"]
        return op_result(
            (
                _like_x(lay, x),
                *(x.new_empty(a[p].shape) for p in lay.params),
                *(x.new_empty(a[i].shape) for i in lay.inputs),
            )
        )

    def bb_fake(*args):
        a = by_spec_name(s.bb, args)
        x = a["x"]
        return (
            torch.empty_like(x),
            torch.empty_like(x),
            *(torch.empty_like(a[p]) for p in lay.params),
            *(torch.empty_like(a[i]) for i in lay.inputs),
        )

    def jvp_fake(*args):
        return torch.empty_like(by_spec_name(s.jvp, args)["x"])

    for op, fake in (
        (ops.forward, forward_fake),
        (ops.backward, backward_fake),
        (ops.bb, bb_fake),
        (ops.jvp, jvp_fake),
    ):
        torch.library.register_fake(op, fake, lib=LIBRARY)


def device_impls(lay: Layer, mode: str, portable: dict[str, Callable]) -> dict[str, dict[str, Callable]]:
    """The forward and backward operators' kernels of every code-generation target that
    names a dispatch key (:mod:`derivgen.codegen.targets`: Triton's for CUDA tensors,
    :mod:`derivgen.triton.ops`), where the target's package is installed: dispatch key ->
    kind -> implementation. Its ``ops`` module is imported on the first call, so registering
    imports none of them."""
    s = lay.schemas[mode]
    found: dict[str, dict[str, Callable]] = {}
    for target in targets.TARGETS.values():
        if target.dispatch is None or (target.requires and importlib.util.find_spec(target.requires) is None):
            continue

        def lazy(kind: str, names: list[str], runtime: str = target.runtime) -> Callable:
            def impl(*args):
                ops = importlib.import_module(f"{runtime}.ops")
                make = ops.forward_impl if kind == "forward" else ops.backward_impl
                return make(lay.spec, mode, names, portable[kind])(*args)

            return impl

        found[target.dispatch] = {
            "forward": lazy("forward", [a.spec for a in s.forward]),
            "backward": lazy("backward", [a.spec for a in s.backward]),
        }
    return found


def register_mode(lay: Layer, mode: str) -> ModeOps:
    """Define and implement one mode's four operators, with fake kernels and autograd (a
    layer with tensor inputs beside x or outputs beside y: its two, :mod:`derivgen.torch.multi`)."""
    if is_multi(lay.meta):
        return ModeOps(mode, *multi.register(lay, LIBRARY, mode))
    s = lay.schemas[mode]
    names = {kind: f"{lay.base}_{mode}_{kind}" for kind in ("forward", "backward", "bb", "jvp")}
    for kind, text in (
        ("forward", s.forward_text()),
        ("backward", s.backward_text()),
        ("bb", s.bb_text()),
        ("jvp", s.jvp_text()),
    ):
        LIBRARY.define(names[kind] + text)
    impls = {
        "forward": forward_impl(lay, mode),
        "backward": backward_impl(lay, mode),
        "bb": second_impl(lay, mode, "bb", s.bb),
        "jvp": second_impl(lay, mode, "jvp", s.jvp),
    }
    for kind, impl in impls.items():
        LIBRARY.impl(names[kind], impl, "CPU")
    # every other device: the generated PyTorch closed forms (derivgen.torch.generic)
    portable = {
        "forward": generic.forward_impl(lay, mode),
        "backward": generic.backward_impl(lay, mode),
        "bb": generic.second_impl(lay, mode, "bb"),
        "jvp": generic.second_impl(lay, mode, "jvp"),
    }
    for kind, impl in portable.items():
        LIBRARY.impl(names[kind], impl, "CompositeExplicitAutograd")
    for key, impls in device_impls(lay, mode, portable).items():  # CUDA tensors: the Triton kernels
        for kind, impl in impls.items():
            LIBRARY.impl(names[kind], impl, key)
    ops = ModeOps(
        mode, *(getattr(torch.ops.derivgen, names[kind]).default for kind in ("forward", "backward", "bb", "jvp"))
    )
    register_fakes(lay, mode, ops)
    register_second_order(lay, LIBRARY, mode, ops)
    register_first_order(lay, LIBRARY, mode, ops)
    return ops
