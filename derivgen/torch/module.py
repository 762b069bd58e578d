"""Any derivgen layer as a ``torch.nn`` module (:class:`Module`: a catalogue name or a spec
file, with its parameters, buffers and options), as a function of tensors (:func:`function`),
and :class:`OnlineLayerNorm`; re-exported by :mod:`derivgen.torch.nn`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from derivgen.runtime.meta import LayerMeta
from derivgen.runtime.validate import bind_arguments, check_float
from derivgen.spec import Spec
from derivgen.torch import sync
from derivgen.torch.ops import layer
from derivgen.torch.schema import tensor_inputs
from derivgen.torch.sync import check_syncable

__all__ = ["Module", "OnlineLayerNorm", "function"]


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
        self.layer_name = meta.name
        self.sync = bool(sync or process_group is not None)
        self.process_group = process_group
        if self.sync:
            check_syncable(self._layer)
        unknown = set(options) - set(meta.options)
        if unknown:
            raise TypeError(f"{self.layer_name}: unknown option(s) {sorted(unknown)}; options are {list(meta.options)}")
        for o, (default, lo, hi) in meta.options.items():
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
        for p in meta.params:
            shape = () if p in meta.scalar_params else self._size
            self.register_parameter(p, nn.Parameter(torch.full(shape, float(meta.param_init[p]), **kw)))
        if meta.buffers:
            if meta.layout != "channels" or meta.reduce != "batch":
                raise ValueError(f"{self.layer_name}: buffers are supported for a batch-reduced layer only")
            for b in meta.buffers:
                self.register_buffer(b, torch.full(self._size, float(meta.buffer_init[b]), **kw))

    def extra_repr(self) -> str:
        """The layer's name, size and options, for ``repr``."""
        opts = ", ".join(f"{o}={getattr(self, o)}" for o in self._layer.meta.options)
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
        missing = [i for i in meta.inputs if i not in inputs]
        extra = set(inputs) - set(meta.inputs)
        if missing or extra:
            raise TypeError(
                f"{self.layer_name}: forward takes the per-group inputs {meta.inputs} as keywords"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {sorted(extra)}" if extra else "")
            )
        if meta.layout == "channels" and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] != self._size[0]:
            raise ValueError(
                f"{self.layer_name}: x has {x.shape[1]} channels (dimension 1 of shape {tuple(x.shape)}); "
                f"this module was made for {self._size[0]}"
            )
        params = {p: getattr(self, p) for p in meta.params}
        options = {o: getattr(self, o) for o in meta.options}
        bufs = {b: getattr(self, b) for b in meta.buffers}
        pg = sync.sync_group(self.process_group, self.training) if self.sync else None
        if pg is not None:
            ins = {
                i: (v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=x.dtype))
                for i, v in inputs.items()
            }
            y, stats, n = sync.sync_forward(lay, pg, x, params, options, ins, tens)
            if bufs:
                lay.update_buffers(stats, bufs, options, n)
            return y
        return _run(lay, x, params, inputs, options, self.training, bufs, self.num_groups, tens)


def _tensor_arguments(name: str, meta: LayerMeta, given: Sequence, kw: dict) -> dict | None:
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


def _module_size(name: str, meta: LayerMeta, size: object) -> tuple[int, ...]:
    """A Module's size as a tuple of positive ints: the number of channels C (one int) for a
    channel layout, the normalized shape for a trailing one (an int or a sequence of them)."""
    sizes = (size,) if isinstance(size, int) and not isinstance(size, bool) else size
    try:
        out = tuple(sizes)  # type: ignore[arg-type]
    except TypeError:
        out = ()
    if not out or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in out):
        raise TypeError(f"{name}: size must be a positive int or a sequence of them, got {size!r}")
    if meta.layout == "channels" and len(out) != 1:
        raise ValueError(f"{name}: a channel layout's size is the number of channels C (one int), got {size!r}")
    return out


def _check_groups(name: str, meta: LayerMeta, num_groups: object, channels: int) -> None:
    """num_groups given exactly for a layout with groups of channels, and dividing C (as
    torch.nn.GroupNorm checks at construction)."""
    if meta.reduce != "group":
        if num_groups is not None:
            raise TypeError(f"{name}: num_groups applies to a layout with reduce = 'group', not {meta.reduce!r}")
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
        self.__doc__ = f"derivgen layer {self._layer.meta.name}: f(x, {args}, **options)"

    def __call__(self, x, *params, training: bool = True, num_groups: int = 0, **kw):
        meta = self._layer.meta
        name = meta.name
        nt = len(tensor_inputs(meta))
        tensors = _tensor_arguments(name, meta, params[:nt], kw)
        kw = bind_arguments(meta, params[nt:], kw)
        options = {}
        for o, (default, _, _) in meta.options.items():
            options[o] = kw.get(o, default)
            if options[o] is None:
                raise TypeError(f"{name}: option {o} is required")
        for i in meta.inputs:
            if i not in kw:
                raise TypeError(f"{name}: input {i} is required")
        bufs = {b: kw.get(b) for b in meta.buffers}
        if not training and any(v is None for v in bufs.values()):
            raise ValueError(f"{name}: training=False normalizes with the buffers {meta.buffers}; pass them")
        return _run(
            self._layer,
            x,
            {p: kw[p] for p in meta.params},
            {i: kw[i] for i in meta.inputs},
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
