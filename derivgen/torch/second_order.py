"""The CPU implementations of the second-order operators (``<layer>_<mode>_bb``, the
double backward, and ``<layer>_<mode>_jvp``, forward mode): float32/float64 tensors run
the derived C kernels (derivgen.derive.second); bfloat16 and channels-last tensors the generated
PyTorch closed form through torch.func (the same derivatives; the layer's
``_generic_bb`` / ``_generic_jvp``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from derivgen import runtime as rt
from derivgen.runtime.cbind import input_pairs
from derivgen.torch.plan import threads
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import OpArg, by_spec_name, differentiable
from derivgen.torch.tensors import SUFFIX, is_channels_last, layout, per_group_input_grad


def runs_in_c(lay: Layer, a: dict) -> bool:
    """Whether the derived C kernels take the call: float32/float64, not channels last."""
    x = a["x"]
    return x.dtype in (torch.float32, torch.float64) and not (lay.meta.layout == "channels" and is_channels_last(x))


def _operands(lay: Layer, kind: str, a: dict, dtype: torch.dtype) -> dict:
    """The call's values in C order, the seeds in x's dtype."""
    c = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    pre = "c_" if kind == "bb" else "t_"
    for n in differentiable(lay.meta):
        if c[pre + n].dtype != dtype:
            c[pre + n] = c[pre + n].to(dtype)
    return c


def _leading_sections(lay: Layer, mode: str, kind: str, c: dict, x: torch.Tensor, L: rt.Layout) -> dict:
    """The kernel's sections up to its outputs: dims, x, parameters, options, inputs,
    statistics and the seeds."""
    pre = "c_" if kind == "bb" else "t_"
    return {
        "dims": (L.O, L.G, L.Cg, L.S),
        "x": (x.data_ptr(),),
        "params": [c[p].data_ptr() for p in lay.params],
        "options": [c[o] for o in lay.options],
        "inputs": input_pairs([c[i] for i in lay.inputs]),
        "stats": [c[s].data_ptr() for s in lay.meta.stats[mode]],
        "seed_x": (c[pre + "x"].data_ptr(),),
        "seed_params": [c[pre + p].data_ptr() for p in lay.params],
        "seed_inputs": input_pairs([c[pre + i] for i in lay.inputs]),
        "nthreads": (threads(lay.ckernel._kernel),),
    }


def c_second(lay: Layer, mode: str, kind: str, a: dict) -> torch.Tensor | tuple:
    """The derived C kernel (``kind`` bb or jvp) on contiguous float32/float64 tensors:
    (dx, ddy, dparams..., dinputs...) or y's tangent."""
    x = a["x"].contiguous()
    L = layout(lay.meta, tuple(x.shape), {p: tuple(a[p].shape) for p in lay.params}, a["num_groups"])
    kernel = lay.libraries.for_call(x.dtype)
    c = _operands(lay, kind, a, x.dtype)
    sections = _leading_sections(lay, mode, kind, c, x, L)
    if kind == "bb":
        outs = [torch.empty_like(x), torch.empty_like(x), *(torch.empty_like(c[p]) for p in lay.params)]
        dis = [torch.empty(L.n_groups, dtype=x.dtype) for _ in lay.inputs]
        sections.update(
            {
                "dy": (c["dy"].data_ptr(),),
                "out_dx": (outs[0].data_ptr(),),
                "out_ddy": (outs[1].data_ptr(),),
                "out_params": [t.data_ptr() for t in outs[2:]],
                "out_inputs": [t.data_ptr() for t in dis],
            }
        )
    else:
        outs, dis = [torch.empty_like(x)], []
        sections["out_ty"] = (outs[0].data_ptr(),)
    fn = kernel.second_cfunc(mode, kind, SUFFIX[x.dtype])
    if fn(*kernel.signatures[(mode, kind)].pack(sections)) != 0:
        raise MemoryError(f"{lay.meta.name}: second-order kernel could not allocate its work buffer")
    if kind != "bb":
        return outs[0].reshape(a["x"].shape)
    return (*outs, *(per_group_input_grad(d, a[i], x.dtype) for i, d in zip(lay.inputs, dis)))


def second_impl(lay: Layer, mode: str, kind: str, args: tuple[OpArg, ...]) -> Callable:
    """The CPU implementation of the ``bb`` or ``jvp`` operator of a mode."""

    def impl(*values):
        a = by_spec_name(args, values)
        if runs_in_c(lay, a):
            return c_second(lay, mode, kind, a)
        return lay._generic_bb(mode, a) if kind == "bb" else lay._generic_jvp(mode, a)

    return impl
