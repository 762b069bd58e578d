"""Every derived layer as PyTorch operators in the ``derivgen`` namespace.

For each mode of a layer (``train``; ``eval`` where the spec has one) two
operators, defined with explicit schemas and no mutation::

    derivgen::<layer>_<mode>_forward(x, params..., inputs..., [buffers...], options..., groups)
        -> (y, statistic...)
    derivgen::<layer>_<mode>_backward(dy, x, params..., inputs..., [buffers...], statistics...,
                                      options..., groups)
        -> (dx, dparam..., dinput...)

Their CPU kernels are the generated C (``derivgen.load(spec, "c")``), called
on the tensors' own memory: a contiguous float32/float64 tensor is passed
without a copy, and the kernels run without the GIL. Statistics are float64,
one value per normalization group, and are not differentiable (they are what
the backward needs; a loss that uses them gets an error, not a silent zero).

* ``register_fake`` gives shapes and dtypes, so ``torch.compile`` traces a
  model through the operators without graph breaks;
* the forward's ``register_autograd`` calls the backward operator;
* the backward operator's own ``register_autograd`` is the derived double
  backward (derivgen.derive.second): a third operator per mode,
  ``derivgen::<layer>_<mode>_bb``, over the generated C kernels; a fourth,
  ``derivgen::<layer>_<mode>_jvp``, is forward mode (``torch.func.jvp``,
  ``torch.autograd.forward_ad``). bfloat16, channels last and third order
  differentiate the generated PyTorch target (``derivgen.load(spec, "torch")``)
  under torch.func instead: exact at any order.

Running buffers are not touched by the operators: :mod:`derivgen.torch.nn`
updates them with the spec's update rule (``update_buffers`` of the torch
target), so the operators stay functional.

This module is the face; the work is done, in the order of a call, by
:mod:`~derivgen.torch.schema` (the operators' argument lists, as data),
:mod:`~derivgen.torch.register` (torch.library definitions, CPU and fake kernels),
:mod:`~derivgen.torch.autograd` (autograd, forward mode, the eager and torch.func paths),
:mod:`~derivgen.torch.plan` (per-call kernel plans on data pointers),
:mod:`~derivgen.torch.validate` (the argument contract on tensors),
:mod:`~derivgen.torch.second_order` (the bb and jvp kernels) and
:mod:`~derivgen.torch.closed_form` (the generated PyTorch target under torch.func).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from derivgen import runtime as rt
from derivgen.api import load, load_spec, materialize
from derivgen.runtime.abi import reads_buffers
from derivgen.runtime.cbind import input_pairs
from derivgen.runtime.meta import layer_meta
from derivgen.spec import Spec, catalogue_names, load_catalogue
from derivgen.torch import closed_form, multi, multi_plan
from derivgen.torch.autograd import call_forward
from derivgen.torch.plan import KernelLibraries, PlanCache, threads
from derivgen.torch.register import LIBRARY, ModeOps, register_mode
from derivgen.torch.schema import mode_schemas, tensor_inputs
from derivgen.torch.tensors import layout

# re-exported beside this module's own names: the operators' per-group input convention
# (input_pairs), their thread count (threads), the registered library and mode record, the layout
__all__ = ["LIBRARY", "ModeOps", "TorchLayer", "input_pairs", "layer", "layout", "op_base", "threads"]

_LOCK = threading.RLock()
_LAYERS: dict[str, TorchLayer] = {}


def layer(spec_or_name: Spec | str | Path) -> TorchLayer:
    """The operators of a catalogue layer (by name), a spec file or a Spec,
    registered on first use."""
    spec = spec_or_name if isinstance(spec_or_name, Spec) else load_spec(spec_or_name)
    base = op_base(spec)
    with _LOCK:
        if base not in _LAYERS:
            _LAYERS[base] = TorchLayer(spec, base)
        return _LAYERS[base]


def op_base(spec: Spec) -> str:
    """A catalogue layer's operators are named after it; any other spec's carry the
    digest of its generated code too, so two specs with one name never collide."""
    if spec.name in catalogue_names() and load_catalogue(spec.name) == spec:
        return spec.name
    return f"{spec.name}_{materialize(spec, 'c')[1][:12]}"


class TorchLayer:
    """One spec's operators (``modes``: a :class:`ModeOps` per mode), the generated C and
    PyTorch modules behind them, and what the operator modules share: the operator
    schemas, the C libraries and the per-call plans."""

    def __init__(self, spec: Spec, base: str) -> None:
        self.spec, self.base = spec, base
        self.ckernel = load(spec, "c")
        self.multi = spec.multi
        # a multi layer's generated PyTorch target is loaded on first use (other devices,
        # torch.func, portable()): its CPU operators need only the C kernels
        self._target = None if self.multi else load(spec, "torch")
        self.meta = m = layer_meta(self.ckernel._META)
        self.params, self.inputs, self.buffers = list(m.params), list(m.inputs), list(m.buffers)
        self.options = list(m.options)
        self.grads_type = rt.grads_type(spec.name, rt.grad_fields(m))
        self.schemas = {mode: mode_schemas(m, mode) for mode in m.modes}
        self.libraries = KernelLibraries(self.ckernel._kernel)
        self.plans = multi_plan.MultiPlans(self) if self.multi else PlanCache(self)
        self._csplit: dict = {}  # dtype -> derivgen.torch.sync._CSplit
        self.modes = {mode: register_mode(self, mode) for mode in m.modes}

    @property
    def target(self):
        """The layer's generated PyTorch module (``derivgen.load(spec, "torch")``)."""
        if self._target is None:
            self._target = load(self.spec, "torch")
        return self._target

    # one object per spec and process: copies of a module share it, a pickle names the spec
    def __copy__(self) -> TorchLayer:
        return self

    def __deepcopy__(self, memo: dict) -> TorchLayer:
        return self

    def __reduce__(self) -> tuple:
        return (layer, (self.spec,))

    def forward(
        self,
        x: torch.Tensor,
        params: dict,
        inputs: dict,
        options: dict,
        *,
        training: bool = True,
        buffers: dict | None = None,
        num_groups: int = 0,
        stats: bool = True,
        tensors: dict | None = None,
    ) -> tuple[torch.Tensor | tuple, dict[str, torch.Tensor] | None]:
        """(y, {statistic: float64 per-group tensor}) through the operators (autograd-aware);
        (y, None) with ``stats=False``. A layer with tensor inputs beside x takes them in
        ``tensors`` (by name); one with outputs beside y gives ``(y, outputs...)`` for y."""
        mode = "train" if training or "eval" not in self.modes else "eval"
        tens = [x, *[(tensors or {}).get(t) for t in tensor_inputs(self.meta)]]
        tens += [*[params[p] for p in self.params], *[inputs[i] for i in self.inputs]]
        if reads_buffers(self.meta, mode):  # read, never updated here (a training kernel gets copies)
            tens += [buffers[b] if mode == "eval" else buffers[b].clone() for b in self.buffers]
        return self.call(mode, tens, tuple([float(options[o]) for o in self.options]), int(num_groups or 0), stats)

    def call(
        self, mode: str, tens: list, opts: tuple, groups: int, stats: bool = True
    ) -> tuple[torch.Tensor | tuple, dict[str, torch.Tensor] | None]:
        """:meth:`forward` with the arguments in operator order: tensors (x, the tensor
        inputs beside x, parameters, inputs, and in eval mode buffers), options (floats),
        groups (0 without groups)."""
        if self.multi:
            out, st = multi.call_forward(self, mode, tens, opts, groups, stats)
            return (out if self.meta.outputs else out[0]), st
        return call_forward(self, mode, tens, opts, groups, stats)

    def update_buffers(
        self, stats: dict, buffers: dict, options: dict, group_size: int, reduce_dims: tuple[int, ...] = ()
    ) -> None:
        """Apply the spec's running-buffer updates in place (see :func:`closed_form.update_buffers`)."""
        closed_form.update_buffers(self, stats, buffers, options, group_size, reduce_dims)

    def views(self, a: dict, L: rt.Layout, mode: str) -> dict:
        """Keyword arguments of the generated PyTorch functions: 4-D views."""
        return closed_form.views(self, a, L, mode)

    def target_backward(self, mode: str, a: dict) -> tuple:
        """(dx, dparams..., dinputs...) by the generated PyTorch closed form."""
        return closed_form.target_backward(self, mode, a)

    # the second order without the C kernels (bfloat16, channels last, third order); methods
    # so that a test can refuse them
    def _generic_bb(self, mode: str, a: dict) -> tuple:
        return closed_form.generic_bb(self, mode, a)

    def _generic_jvp(self, mode: str, a: dict) -> torch.Tensor:
        return closed_form.generic_jvp(self, mode, a)
