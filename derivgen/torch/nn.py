"""Drop-in ``torch.nn`` normalization modules over derivgen's operators.

Each class *is* its torch.nn namesake (a subclass): the same constructor
arguments and defaults, attributes, ``reset_parameters``, ``extra_repr`` and
``state_dict`` keys, and ``isinstance(m, torch.nn.LayerNorm)`` holds. Only the
arithmetic is replaced: the forward and backward run derivgen's generated C
kernels (see :mod:`derivgen.torch.ops`), and running buffers are updated
with the spec's own update rule.

``convert(model)`` swaps every supported torch.nn norm in a model for its
twin, keeping parameters, buffers, device, dtype and training mode.
:class:`Module` makes any spec (a catalogue name or a spec file) a module.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch import nn

from derivgen.torch import sync
from derivgen.torch.imported import ConvertReport, convert_imported
from derivgen.torch.module import Module, OnlineLayerNorm, function
from derivgen.torch.ops import layer
from derivgen.torch.tensors import wide

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "ConvertReport",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "Module",
    "OnlineLayerNorm",
    "RMSNorm",
    "SyncBatchNorm",
    "convert",
    "function",
]


def _param(p, like, shape, fill):
    """A parameter, or the constant a torch.nn module uses when it has none
    (affine=False, bias=False): ones for a scale, zeros for a shift."""
    if p is not None:
        return p
    return like.new_full(tuple(shape), fill)


def _own(m: nn.Module, name: str):
    """``m.<name>``: from the module's parameter dict without Module.__getattr__ (the
    per-call path), else by attribute (a parametrized weight lives elsewhere)."""
    try:
        return m._parameters[name]
    except KeyError:
        return getattr(m, name)


_SPEC_TO_NN = ((re.compile(r"\bgamma\b"), "weight"), (re.compile(r"\bbeta\b"), "bias"))


def _nn_names(e: Exception) -> Exception:
    """``e`` with the catalogue's parameter names as torch.nn's modules call them (gamma:
    weight, beta: bias): what a twin's user knows. ``e`` itself where nothing changes."""
    msg = str(e)
    new = msg
    for pattern, name in _SPEC_TO_NN:
        new = pattern.sub(name, new)
    if new == msg or e.args != (msg,):
        return e
    return type(e)(new)


class _Twin:
    """Binds the derivgen layers a twin uses when it is made (by its constructor or by
    :func:`convert`), so that the forward is plain attribute access: nothing for
    torch.compile to trace but the operators."""

    _DG_LAYERS: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dg_bind()

    def _dg_bind(self):
        self._dg = {n: layer(n) for n in self._DG_LAYERS}


class LayerNorm(_Twin, nn.LayerNorm):
    """torch.nn.LayerNorm, computed by derivgen's layer ``layernorm``."""

    _DG_LAYERS = ("layernorm",)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """y = (x - mean) * rstd * weight + bias over the trailing ``normalized_shape`` axes."""
        w, b = _own(self, "weight"), _own(self, "bias")
        if w is None or b is None:
            shape = self.normalized_shape
            w, b = _param(w, input, shape, 1.0), _param(b, input, shape, 0.0)
        try:
            return self._dg["layernorm"].call("train", [input, w, b], (float(self.eps),), 0, stats=False)[0]
        except (TypeError, ValueError) as e:
            raise _nn_names(e) from None


class RMSNorm(_Twin, nn.RMSNorm):
    """torch.nn.RMSNorm, computed by derivgen's layer ``rmsnorm`` (eps=None is the
    machine epsilon of the input's dtype, as in torch)."""

    _DG_LAYERS = ("rmsnorm",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x / sqrt(mean(x**2) + eps) * weight over the trailing ``normalized_shape`` axes."""
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        w = _own(self, "weight")
        try:
            return self._dg["rmsnorm"].call(
                "train", [x, _param(w, x, self.normalized_shape, 1.0)], (float(eps),), 0, stats=False
            )[0]
        except (TypeError, ValueError) as e:
            raise _nn_names(e) from None


class _BatchNormMixin(_Twin):
    """The forward of torch.nn's _BatchNorm with derivgen's ``batchnorm`` layer."""

    _DG_LAYERS = ("batchnorm",)

    def forward(self, input):
        """Normalize ``input`` as the torch.nn module does (batch or running statistics)."""
        self._check_input_dim(input)
        try:
            return self._bn_forward(input)
        except (TypeError, ValueError) as e:
            raise _nn_names(e) from None

    def _bn_forward(self, input):
        lay = self._dg["batchnorm"]
        momentum = self.momentum if self.momentum is not None else 0.0
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as a tensor (no graph break)
                momentum = self.num_batches_tracked.to(wide(input.device)).reciprocal()
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        c = input.shape[1]
        params = {"gamma": _param(self.weight, input, (c,), 1.0), "beta": _param(self.bias, input, (c,), 0.0)}
        options = {"eps": self.eps, "momentum": momentum if isinstance(momentum, float) else 0.0}
        if use_batch:
            y, stats, n = self._batch_forward(lay, input, params, options)
            if self.training and self.track_running_stats:
                lay.update_buffers(
                    stats,
                    {"running_mean": self.running_mean, "running_var": self.running_var},
                    {"eps": self.eps, "momentum": momentum},
                    n,
                )
            return y
        y, _ = lay.forward(
            input,
            params,
            {},
            options,
            training=False,
            stats=False,
            buffers={"running_mean": self.running_mean, "running_var": self.running_var},
        )
        return y

    def _batch_forward(self, lay, input, params, options):
        """y, the batch statistics and the number of values per channel they are over."""
        y, stats = lay.forward(input, params, {}, options, training=True)
        return y, stats, input.numel() // input.shape[1]


class BatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    """torch.nn.BatchNorm1d, computed by derivgen's layer ``batchnorm``."""


class BatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    """torch.nn.BatchNorm2d, computed by derivgen's layer ``batchnorm``."""


class BatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    """torch.nn.BatchNorm3d, computed by derivgen's layer ``batchnorm``."""


class SyncBatchNorm(_BatchNormMixin, nn.modules.batchnorm._BatchNorm):
    """torch.nn.SyncBatchNorm on the CPU: the statistics of the batch that the processes
    of ``process_group`` (default: the whole world) hold together, by derivgen's split
    reduction (:mod:`derivgen.torch.sync`: one all_reduce per statistics level in the
    forward, one in the backward, one small all_gather that checks the parts fit). Any
    process's part may be empty. With one process, outside training, or without an
    initialized torch.distributed, it is :class:`BatchNorm2d` (any input dimension).

    torch.nn.SyncBatchNorm's constructor, attributes, state_dict keys and
    ``convert_sync_batchnorm``; deliberately not a subclass of it, because
    DistributedDataParallel refuses torch.nn.SyncBatchNorm layers on the CPU."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _batch_forward(self, lay, input, params, options):
        pg = sync.sync_group(self.process_group, self.training)
        if pg is not None:
            return sync.sync_forward(lay, pg, input, params, options)
        return super()._batch_forward(lay, input, params, options)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:  # torch.nn.SyncBatchNorm's own checks and messages
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """Every torch.nn BatchNorm1d/2d/3d (and derivgen's) in ``module`` replaced by a
        derivgen SyncBatchNorm sharing its parameters and buffers, as
        torch.nn.SyncBatchNorm.convert_sync_batchnorm does; returns the module."""
        out = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, cls)):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
            )
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        del module
        return out


class _InstanceNormMixin(_Twin):
    """torch.nn's _InstanceNorm with derivgen's ``instancenorm`` layer; with
    track_running_stats, the running statistics are the batch means of the
    per-instance ones (as torch.nn does), and eval mode normalizes with them
    through derivgen's ``batchnorm`` eval operator (the same arithmetic)."""

    _DG_LAYERS = ("instancenorm", "batchnorm")

    def _apply_instance_norm(self, input):
        try:
            return self._in_forward(input)
        except (TypeError, ValueError) as e:
            raise _nn_names(e) from None

    def _in_forward(self, input):
        c = input.shape[1]
        params = {"gamma": _param(self.weight, input, (c,), 1.0), "beta": _param(self.bias, input, (c,), 0.0)}
        if self.training or not self.track_running_stats:
            y, stats = self._dg["instancenorm"].forward(input, params, {}, {"eps": self.eps})
            if self.training and self.running_mean is not None:
                S = math.prod(input.shape[2:])
                self._dg["batchnorm"].update_buffers(
                    {k: stats[k] for k in ("mean", "var", "rstd")},
                    {"running_mean": self.running_mean, "running_var": self.running_var},
                    {"eps": self.eps, "momentum": self.momentum if self.momentum is not None else 0.0},
                    S,
                    reduce_dims=(input.shape[0],),
                )
            return y
        y, _ = self._dg["batchnorm"].forward(
            input,
            params,
            {},
            {"eps": self.eps, "momentum": 0.0},
            training=False,
            buffers={"running_mean": self.running_mean, "running_var": self.running_var},
        )
        return y


class InstanceNorm1d(_InstanceNormMixin, nn.InstanceNorm1d):
    """torch.nn.InstanceNorm1d, computed by derivgen's layer ``instancenorm``."""


class InstanceNorm2d(_InstanceNormMixin, nn.InstanceNorm2d):
    """torch.nn.InstanceNorm2d, computed by derivgen's layer ``instancenorm``."""


class InstanceNorm3d(_InstanceNormMixin, nn.InstanceNorm3d):
    """torch.nn.InstanceNorm3d, computed by derivgen's layer ``instancenorm``."""


class GroupNorm(_Twin, nn.GroupNorm):
    """torch.nn.GroupNorm, computed by derivgen's layer ``groupnorm``."""

    _DG_LAYERS = ("groupnorm",)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """y = (x - mean) * rstd * weight + bias, statistics over each (sample, group of channels)."""
        c = input.shape[1]
        try:
            y, _ = self._dg["groupnorm"].forward(
                input,
                {"gamma": _param(self.weight, input, (c,), 1.0), "beta": _param(self.bias, input, (c,), 0.0)},
                {},
                {"eps": self.eps},
                num_groups=self.num_groups,
                stats=False,
            )
        except (TypeError, ValueError) as e:
            raise _nn_names(e) from None
        return y


# ------------------------------------------------------------------ convert

_TWINS = {
    nn.LayerNorm: LayerNorm,
    nn.RMSNorm: RMSNorm,
    nn.BatchNorm1d: BatchNorm1d,
    nn.BatchNorm2d: BatchNorm2d,
    nn.BatchNorm3d: BatchNorm3d,
    nn.InstanceNorm1d: InstanceNorm1d,
    nn.InstanceNorm2d: InstanceNorm2d,
    nn.InstanceNorm3d: InstanceNorm3d,
    nn.GroupNorm: GroupNorm,
}


def _twin_of(m: nn.Module) -> nn.Module | None:
    cls = _TWINS.get(type(m))
    if cls is None:
        return None
    new = cls.__new__(cls)
    new.__dict__.update(m.__dict__)  # the same parameters, buffers, hooks, attributes and mode
    new.__dict__["_parameters"] = dict(m._parameters)
    new.__dict__["_buffers"] = dict(m._buffers)
    new.__dict__["_modules"] = dict(m._modules)
    new._dg_bind()
    return new


def convert(
    model: nn.Module,
    import_unknown: bool = False,
    *,
    example_inputs: tuple | list | None = None,
    example_kwargs: dict | None = None,
    report: ConvertReport | None = None,
) -> nn.Module:
    """Replace every torch.nn LayerNorm, RMSNorm, BatchNorm1d/2d/3d, InstanceNorm1d/2d/3d
    and GroupNorm in ``model`` (in place; the root too) by its derivgen twin, sharing
    the same parameter and buffer tensors (an optimizer built before keeps working).
    Subclasses of those (torch's SyncBatchNorm, user classes) are left alone.
    Returns the model (the twin when ``model`` itself is a norm).

    ``import_unknown=True`` (with ``example_inputs``, the model's positional inputs for one
    forward, and ``example_kwargs``): every other leaf submodule called with one
    floating-point tensor whose forward :func:`derivgen.from_torch` imports as a one-tensor
    spec is replaced too, by a :class:`Module` over that spec holding the submodule's own
    parameter and buffer tensors under their own names (the same ``state_dict`` keys); the
    rest are left. ``report``, a :class:`ConvertReport`, is filled with what was replaced
    (path: layer) and what was left (path: the reason, in one line)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    report = ConvertReport() if report is None else report
    if import_unknown:
        if example_inputs is None:
            raise TypeError("convert: import_unknown=True needs example_inputs, the model's inputs for one forward")
        return convert_imported(model, example_inputs, example_kwargs, report, _twin_of)
    return _convert_known(model, report, "")


def _convert_known(model: nn.Module, report: ConvertReport, path: str) -> nn.Module:
    """convert without imports: the torch.nn norms replaced by their twins."""
    root = _twin_of(model)
    if root is not None:
        report.replaced[path] = ", ".join(root._DG_LAYERS)
        return root
    for name, child in list(model.named_children()):
        twin = _twin_of(child)
        sub = f"{path}.{name}" if path else name
        if twin is not None:
            setattr(model, name, twin)
            report.replaced[sub] = ", ".join(twin._DG_LAYERS)
        else:
            _convert_known(child, report, sub)
    return model
