"""The ``derivgen::`` operators' argument lists, as data derived from a layer's metadata.

For each mode of a layer four operators (see :mod:`derivgen.torch.ops`)::

    <layer>_<mode>_forward(x, params..., inputs..., [buffers...], options..., groups)
        -> (y, statistic...)
    <layer>_<mode>_backward(dy, x, params..., inputs..., [buffers...], statistics..., options..., groups)
        -> (dx, dparam..., dinput...)
    <layer>_<mode>_bb(dy, x, params..., inputs..., [buffers...], statistics..., ddx, ddparams...,
                      ddinputs..., options..., groups) -> (dx, ddy, dparams..., dinputs...)
    <layer>_<mode>_jvp(x, params..., inputs..., [buffers...], statistics..., tx, tparams..., tinputs...,
                       options..., groups) -> ty

Buffers are arguments in eval mode only. Each argument has a schema type, a schema name
(``x``, ``e0``, ``p0``, ``i0``, ``b0``, ``s0``, ``c0``, ``t0``, ``o0``, ``q0``, ``groups``) and
the name the spec gives it (``gamma``, ``eps``, ``num_groups``; the seeds ``c_<name>`` and
``t_<name>``, the cotangents ``d<output>``).

A layer with tensor inputs beside x and outputs beside y (``Spec.multi``) has the forward
and backward operators only (the derived second order of these layers is not there yet)::

    <layer>_<mode>_forward(x, tensors..., params..., inputs..., [buffers...], options..., groups)
        -> (y, outputs..., statistic...)
    <layer>_<mode>_backward(dy, d<output>..., x, tensors..., params..., inputs..., [buffers...],
                            statistics..., options..., groups)
        -> (dx, d<tensor with a gradient>..., dparam..., dinput...)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from derivgen.runtime.abi import reads_buffers
from derivgen.runtime.meta import MetaLike, layer_meta


class OpArg(NamedTuple):
    """One operator argument: schema type (``Tensor``, ``float``, ``int``), schema name, spec name."""

    type: str
    name: str
    spec: str


@dataclass(frozen=True)
class ModeSchemas:
    """The four operators' arguments and output counts of one mode of a layer."""

    mode: str
    forward: tuple[OpArg, ...]
    backward: tuple[OpArg, ...]
    bb: tuple[OpArg, ...]
    jvp: tuple[OpArg, ...]
    forward_outputs: int  # y, the outputs beside y and the statistics
    backward_outputs: int  # dx, the tensor inputs', the parameters' and the inputs' gradients
    outputs: int = 0  # the outputs beside y (a multi layer's; its cotangents follow dy)

    def forward_text(self) -> str:
        """The forward operator's schema (after its name)."""
        return schema_text(self.forward, self.forward_outputs)

    def backward_text(self) -> str:
        """The backward operator's schema (after its name)."""
        return schema_text(self.backward, self.backward_outputs)

    def bb_text(self) -> str:
        """The double backward operator's schema: outputs dx, ddy and the rest of the backward's."""
        return schema_text(self.bb, self.backward_outputs + 1)

    def jvp_text(self) -> str:
        """The forward-mode operator's schema: one output, y's tangent."""
        return "(" + ", ".join(f"{a.type} {a.name}" for a in self.jvp) + ") -> Tensor"


def schema_text(args: Iterable[OpArg], outputs: int) -> str:
    """``(Tensor x, float o0, int groups) -> (Tensor, Tensor)``: arguments and ``outputs`` tensors."""
    return "(" + ", ".join(f"{a.type} {a.name}" for a in args) + ") -> (" + ", ".join(["Tensor"] * outputs) + ")"


def tensor_inputs(meta: MetaLike) -> list[str]:
    """The tensor inputs beside x, in spec order (a multi layer's; none for the others)."""
    meta = layer_meta(meta)
    return list(meta.tensors)


def grad_tensors(meta: MetaLike) -> list[str]:
    """The tensor inputs beside x that have a gradient, in spec order."""
    meta = layer_meta(meta)
    return [t for t, (_, grad, _) in meta.tensors.items() if grad]


def extra_outputs(meta: MetaLike) -> list[str]:
    """The outputs beside y, in spec order."""
    meta = layer_meta(meta)
    return list(meta.outputs)


def is_multi(meta: MetaLike) -> bool:
    """Does the layer take tensor inputs beside x or return outputs beside y (``Spec.multi``)?"""
    meta = layer_meta(meta)
    return bool(meta.tensors or meta.outputs)


def differentiable(meta: MetaLike) -> list[str]:
    """The spec names of what the backward differentiates: x, the tensor inputs with a
    gradient, the parameters, the inputs."""
    meta = layer_meta(meta)
    return ["x", *grad_tensors(meta), *meta.params, *meta.inputs]


def forward_args(meta: MetaLike, mode: str) -> tuple[OpArg, ...]:
    """The forward operator's arguments."""
    meta = layer_meta(meta)
    a = [OpArg("Tensor", "x", "x")]
    a += [OpArg("Tensor", f"e{k}", t) for k, t in enumerate(tensor_inputs(meta))]
    a += [OpArg("Tensor", f"p{k}", p) for k, p in enumerate(meta.params)]
    a += [OpArg("Tensor", f"i{k}", i) for k, i in enumerate(meta.inputs)]
    if reads_buffers(meta, mode):
        a += [OpArg("Tensor", f"b{k}", b) for k, b in enumerate(meta.buffers)]
    a += [OpArg("float", f"o{k}", o) for k, o in enumerate(meta.options)]
    a.append(OpArg("int", "groups", "num_groups"))
    return tuple(a)


def mode_schemas(meta: MetaLike, mode: str) -> ModeSchemas:
    """The argument lists of one mode's four operators (a multi layer's two)."""
    meta = layer_meta(meta)
    fargs = forward_args(meta, mode)
    tensors = [a for a in fargs if a.type == "Tensor"]
    scalars = [a for a in fargs if a.type != "Tensor"]
    stats = [OpArg("Tensor", f"s{k}", s) for k, s in enumerate(meta.stats[mode])]
    diff = differentiable(meta)
    if is_multi(meta):
        outs = extra_outputs(meta)
        cots = [OpArg("Tensor", f"q{k}", "d" + o) for k, o in enumerate(outs)]
        return ModeSchemas(
            mode,
            fargs,
            (OpArg("Tensor", "dy", "dy"), *cots, *tensors, *stats, *scalars),
            (),
            (),
            1 + len(outs) + len(stats),
            len(diff),
            len(outs),
        )
    bb = [
        OpArg("Tensor", "dy", "dy"),
        *tensors,
        *stats,
        *(OpArg("Tensor", f"c{k}", "c_" + n) for k, n in enumerate(diff)),
    ]
    jvp = [*tensors, *stats, *(OpArg("Tensor", f"t{k}", "t_" + n) for k, n in enumerate(diff))]
    return ModeSchemas(
        mode,
        fargs,
        (OpArg("Tensor", "dy", "dy"), *tensors, *stats, *scalars),
        (*bb, *scalars),
        (*jvp, *scalars),
        1 + len(stats),
        len(diff),
    )


def by_spec_name(args: Sequence[OpArg], values: Sequence) -> dict:
    """An operator call's values by spec name."""
    return {a.spec: v for a, v in zip(args, values)}


def tensor_count(args: Sequence[OpArg]) -> int:
    """How many of the arguments are tensors (they come first)."""
    return sum(1 for a in args if a.type == "Tensor")
