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
(``x``, ``p0``, ``i0``, ``b0``, ``s0``, ``c0``, ``t0``, ``o0``, ``groups``) and the name the
spec gives it (``gamma``, ``eps``, ``num_groups``; the seeds ``c_<name>`` and ``t_<name>``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from derivgen.runtime.abi import reads_buffers


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
    forward_outputs: int  # y and the statistics
    backward_outputs: int  # dx, the parameters' and the inputs' gradients

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


def differentiable(meta: dict) -> list[str]:
    """The spec names of what the backward differentiates: x, the parameters, the inputs."""
    return ["x", *meta["params"], *meta["inputs"]]


def forward_args(meta: dict, mode: str) -> tuple[OpArg, ...]:
    """The forward operator's arguments."""
    a = [OpArg("Tensor", "x", "x")]
    a += [OpArg("Tensor", f"p{k}", p) for k, p in enumerate(meta["params"])]
    a += [OpArg("Tensor", f"i{k}", i) for k, i in enumerate(meta["inputs"])]
    if reads_buffers(meta, mode):
        a += [OpArg("Tensor", f"b{k}", b) for k, b in enumerate(meta["buffers"])]
    a += [OpArg("float", f"o{k}", o) for k, o in enumerate(meta["options"])]
    a.append(OpArg("int", "groups", "num_groups"))
    return tuple(a)


def mode_schemas(meta: dict, mode: str) -> ModeSchemas:
    """The argument lists of one mode's four operators."""
    fargs = forward_args(meta, mode)
    tensors = [a for a in fargs if a.type == "Tensor"]
    scalars = [a for a in fargs if a.type != "Tensor"]
    stats = [OpArg("Tensor", f"s{k}", s) for k, s in enumerate(meta["stats"][mode])]
    diff = differentiable(meta)
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
