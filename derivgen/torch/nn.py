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
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from derivgen.runtime.validate import bind_arguments, check_float
from derivgen.spec.model import Spec
from derivgen.torch import sync
from derivgen.torch.ops import layer
from derivgen.torch.schema import tensor_inputs
from derivgen.torch.sync import check_syncable
from derivgen.torch.tensors import wide

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
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


# ------------------------------------------------------------------ any spec


class Module(nn.Module):
    """Any derivgen layer as a module: ``Module(spec, size, num_groups=..., **options)``.

    spec: a catalogue name, a spec file path or a Spec. size: the normalized
    shape for a trailing layout (an int or a tuple, as torch.nn.LayerNorm's
    normalized_shape), the number of channels C for a channel layout (both positional:
    an option may be called ``size``, as LocalResponseNorm's window is).
    Parameters are the spec's, named as in the spec and initialized with its
    ``init`` values; buffers likewise (updated in training mode with the
    spec's rule). Options are attributes (``m.eps``); the spec's per-group
    inputs are keyword arguments of ``forward`` (``m(x, prev_mean=..., prev_std=...)``).
    A spec's tensor inputs beside x come after x, positionally in the spec's order or
    by name (``m(x, residual)``); a spec with outputs beside y returns them after y, as a
    tuple (``y, h = m(x, residual)``).
    ``sync=True`` or a ``process_group`` (layers whose groups span the batch): in
    training, statistics over the batch the group's processes hold together, as
    :class:`SyncBatchNorm` (the default group when ``process_group`` is None).
    """

    def __init__(
        self,
        spec: Spec | str | Path,
        size: int | Sequence[int],
        /,
        *,
        num_groups: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sync: bool = False,
        process_group: dist.ProcessGroup | None = None,
        **options: float,
    ) -> None:
        super().__init__()
        self._layer = layer(spec)
        meta = self._layer.meta
        self.layer_name = meta["name"]
        self.sync = bool(sync or process_group is not None)
        self.process_group = process_group
        if self.sync:
            check_syncable(self._layer)
        unknown = set(options) - set(meta["options"])
        if unknown:
            raise TypeError(
                f"{self.layer_name}: unknown option(s) {sorted(unknown)}; options are {list(meta['options'])}"
            )
        for o, (default, lo, hi) in meta["options"].items():
            v = options.get(o, default)
            if v is None:
                raise TypeError(f"{self.layer_name}: option {o} is required (it has no default)")
            try:  # at construction, as torch.nn checks its arguments: not at the first call
                v = check_float(o, v, lo, hi)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{self.layer_name}: option {e}") from None
            setattr(self, o, v)
        self._size = _module_size(self.layer_name, meta, size)
        _check_groups(self.layer_name, meta, num_groups, self._size[0])
        self.num_groups = num_groups or 0
        kw = {"device": device, "dtype": dtype}
        for p in meta["params"]:
            shape = () if p in meta["scalar_params"] else self._size
            self.register_parameter(p, nn.Parameter(torch.full(shape, float(meta["param_init"][p]), **kw)))
        if meta["buffers"]:
            if meta["layout"] != "channels" or meta["reduce"] != "batch":
                raise ValueError(f"{self.layer_name}: buffers are supported for a batch-reduced layer only")
            for b in meta["buffers"]:
                self.register_buffer(b, torch.full(self._size, float(meta["buffer_init"][b]), **kw))

    def extra_repr(self) -> str:
        """The layer's name, size and options, for ``repr``."""
        opts = ", ".join(f"{o}={getattr(self, o)}" for o in self._layer.meta["options"])
        return f"{self.layer_name}, {self._size}" + (f", {opts}" if opts else "")

    def forward(
        self, x: torch.Tensor, *tensors: torch.Tensor, **inputs: torch.Tensor | float
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """y of the spec's layer (``(y, outputs...)`` for a spec with outputs beside y); its
        tensor inputs beside x after x (in spec order, or as keywords), its per-group inputs
        as keywords (tensors or numbers). In training mode the running buffers are updated
        in place."""
        lay, meta = self._layer, self._layer.meta
        tens = _tensor_arguments(self.layer_name, meta, tensors, inputs)
        missing = [i for i in meta["inputs"] if i not in inputs]
        extra = set(inputs) - set(meta["inputs"])
        if missing or extra:
            raise TypeError(
                f"{self.layer_name}: forward takes the per-group inputs {meta['inputs']} as keywords"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {sorted(extra)}" if extra else "")
            )
        if (
            meta["layout"] == "channels"
            and isinstance(x, torch.Tensor)
            and x.dim() >= 2
            and x.shape[1] != self._size[0]
        ):
            raise ValueError(
                f"{self.layer_name}: x has {x.shape[1]} channels (dimension 1 of shape {tuple(x.shape)}); "
                f"this module was made for {self._size[0]}"
            )
        params = {p: getattr(self, p) for p in meta["params"]}
        options = {o: getattr(self, o) for o in meta["options"]}
        bufs = {b: getattr(self, b) for b in meta["buffers"]}
        pg = sync.sync_group(self.process_group, self.training) if self.sync else None
        if pg is not None:
            ins = {
                i: (v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=x.dtype))
                for i, v in inputs.items()
            }
            y, stats, n = sync.sync_forward(lay, pg, x, params, options, ins)
            if bufs:
                lay.update_buffers(stats, bufs, options, n)
            return y
        return _run(lay, x, params, inputs, options, self.training, bufs, self.num_groups, tens)


def _tensor_arguments(name: str, meta: dict, given: Sequence, kw: dict) -> dict | None:
    """The tensor inputs beside x of a call by name: ``given`` positionally in spec order,
    the rest taken out of the keywords ``kw``; None for a layer without them."""
    names = tensor_inputs(meta)
    if len(given) > len(names):
        raise TypeError(
            f"{name}: forward takes x"
            + (f" and the tensor inputs {names}" if names else "")
            + f" positionally, got {1 + len(given)} tensors"
        )
    if not names:
        return None
    tens = dict(zip(names, given))
    twice = sorted(set(tens) & set(kw))
    if twice:
        raise TypeError(f"{name}: tensor input(s) {twice} given both by position and by keyword")
    for t in names[len(given) :]:
        if t in kw:
            tens[t] = kw.pop(t)
    missing = [t for t in names if t not in tens]
    if missing:
        raise TypeError(f"{name}: forward takes the tensor inputs {names} after x; missing {missing}")
    return tens


def _module_size(name: str, meta: dict, size: object) -> tuple[int, ...]:
    """A Module's size as a tuple of positive ints: the number of channels C (one int) for a
    channel layout, the normalized shape for a trailing one (an int or a sequence of them)."""
    sizes = (size,) if isinstance(size, int) and not isinstance(size, bool) else size
    try:
        out = tuple(sizes)  # type: ignore[arg-type]
    except TypeError:
        out = ()
    if not out or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in out):
        raise TypeError(f"{name}: size must be a positive int or a sequence of them, got {size!r}")
    if meta["layout"] == "channels" and len(out) != 1:
        raise ValueError(f"{name}: a channel layout's size is the number of channels C (one int), got {size!r}")
    return out


def _check_groups(name: str, meta: dict, num_groups: object, channels: int) -> None:
    """num_groups given exactly for a layout with groups of channels, and dividing C (as
    torch.nn.GroupNorm checks at construction)."""
    if meta["reduce"] != "group":
        if num_groups is not None:
            raise TypeError(f"{name}: num_groups applies to a layout with reduce = 'group', not {meta['reduce']!r}")
        return
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise TypeError(f"{name}: num_groups must be a positive int, got {num_groups!r}")
    if channels % num_groups:
        raise ValueError(f"{name}: num_channels ({channels}) must be divisible by num_groups ({num_groups})")


def _run(lay, x, params: dict, inputs: dict, options: dict, training: bool, bufs: dict, num_groups, tensors=None):
    """y of a spec's layer (``(y, outputs...)`` for a spec with outputs beside y); per-group
    inputs may be numbers; running buffers, when all are given, are updated in training
    mode (batch-reduced layers: N values per channel)."""
    ins = {i: (v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=x.dtype)) for i, v in inputs.items()}
    y, stats = lay.forward(
        x, params, ins, options, training=training, buffers=bufs, num_groups=num_groups, tensors=tensors
    )
    if training and bufs and all(v is not None for v in bufs.values()):
        lay.update_buffers(stats, bufs, options, x.numel() // x.shape[1])
    return y


class _Function:
    """A layer as a function of tensors (see :func:`function`)."""

    def __init__(self, spec):
        self._layer = layer(spec)
        args = ", ".join([*tensor_inputs(self._layer.meta), *self._layer.params])
        self.__doc__ = f"derivgen layer {self._layer.meta['name']}: f(x, {args}, **options)"

    def __call__(self, x, *params, training: bool = True, num_groups: int = 0, **kw):
        meta = self._layer.meta
        name = meta["name"]
        nt = len(tensor_inputs(meta))
        tensors = _tensor_arguments(name, meta, params[:nt], kw)
        kw = bind_arguments(meta, params[nt:], kw)
        options = {}
        for o, (default, _, _) in meta["options"].items():
            options[o] = kw.get(o, default)
            if options[o] is None:
                raise TypeError(f"{name}: option {o} is required")
        for i in meta["inputs"]:
            if i not in kw:
                raise TypeError(f"{name}: input {i} is required")
        bufs = {b: kw.get(b) for b in meta["buffers"]}
        if not training and any(v is None for v in bufs.values()):
            raise ValueError(f"{name}: training=False normalizes with the buffers {meta['buffers']}; pass them")
        return _run(
            self._layer,
            x,
            {p: kw[p] for p in meta["params"]},
            {i: kw[i] for i in meta["inputs"]},
            options,
            training,
            bufs,
            num_groups,
            tensors,
        )


def function(spec: Spec | str | Path) -> _Function:
    """A layer as an autograd-aware function: ``f = function("layernorm")``, then
    ``f(x, weight, bias, eps=1e-5)``. Tensor inputs beside x, then parameters, come
    positionally in the spec's order (or as keywords by name; ``function("add_rmsnorm")(x,
    residual, weight)`` gives ``(y, h)``), per-group inputs and options as keywords
    (options default as in the spec); ``training=False`` normalizes with the
    buffers passed as keywords, which training mode updates in place when given."""
    return _Function(spec)


class OnlineLayerNorm(Module):
    """The online layer norm of the source material (catalogue ``online_layernorm``):
    ``OnlineLayerNorm(normalized_shape, alpha, eps=0.0)``; ``forward(x, prev_mean, prev_std)``
    takes the running moments (one value per row, or scalars), and gradients flow into them."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        alpha: float,
        eps: float = 0.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__("online_layernorm", normalized_shape, alpha=alpha, eps=eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, prev_mean: torch.Tensor | float, prev_std: torch.Tensor | float) -> torch.Tensor:
        """y of the online layer norm, given the running moments of the rows."""
        return super().forward(x, prev_mean=prev_mean, prev_std=prev_std)


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


def convert(model: nn.Module) -> nn.Module:
    """Replace every torch.nn LayerNorm, RMSNorm, BatchNorm1d/2d/3d, InstanceNorm1d/2d/3d
    and GroupNorm in ``model`` (in place; the root too) by its derivgen twin, sharing
    the same parameter and buffer tensors (an optimizer built before keeps working).
    Subclasses of those (torch's SyncBatchNorm, user classes) are left alone.
    Returns the model (the twin when ``model`` itself is a norm)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    root = _twin_of(model)
    if root is not None:
        return root
    for name, child in list(model.named_children()):
        twin = _twin_of(child)
        if twin is not None:
            setattr(model, name, twin)
        else:
            convert(child)
    return model
