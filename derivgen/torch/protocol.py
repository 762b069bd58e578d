"""What the operator modules use of a layer, as a type: :class:`Layer`.

The one implementation is :class:`derivgen.torch.ops.TorchLayer`. The modules below
it (plans, registration, autograd, second order, closed forms, sync) take it as an
argument; this protocol lets them name its type without importing
:mod:`derivgen.torch.ops`, which imports them.
"""

from __future__ import annotations

from typing import Any, Protocol

from derivgen import runtime as rt
from derivgen.runtime.meta import LayerMeta
from derivgen.torch.schema import ModeSchemas


class Layer(Protocol):
    """One spec's operators and what they share (see :class:`derivgen.torch.ops.TorchLayer`)."""

    spec: Any  # the layer's derivgen.spec.model.Spec
    base: str  # the operators' base name (``derivgen::<base>_<mode>_forward`` ...)
    meta: LayerMeta  # the layer's metadata (the generated modules' ``_META``)
    multi: bool  # tensor inputs beside x or outputs beside y (Spec.multi): derivgen.torch.multi
    params: list[str]
    inputs: list[str]
    buffers: list[str]
    options: list[str]
    modes: dict[str, Any]  # mode -> derivgen.torch.register.ModeOps
    schemas: dict[str, ModeSchemas]  # by mode
    ckernel: Any  # the generated C binding module
    target: Any  # the generated PyTorch module
    libraries: Any  # derivgen.torch.plan.KernelLibraries
    plans: Any  # derivgen.torch.plan.PlanCache
    grads_type: type[tuple]

    def forward(
        self,
        x: Any,
        params: dict,
        inputs: dict,
        options: dict,
        *,
        training: bool = True,
        buffers: dict | None = None,
        num_groups: int = 0,
        stats: bool = True,
        tensors: dict | None = None,
    ) -> tuple:
        """(y, statistics or None) through the operators ((y, outputs...) for y where the
        layer has outputs beside y; its tensor inputs beside x in ``tensors``)."""

    def update_buffers(
        self, stats: dict, buffers: dict, options: dict, group_size: int, reduce_dims: tuple[int, ...] = ()
    ) -> None:
        """Apply the spec's running-buffer updates in place."""

    def views(self, a: dict, L: rt.Layout, mode: str) -> dict:
        """Keyword arguments of the generated PyTorch functions: 4-D views."""
