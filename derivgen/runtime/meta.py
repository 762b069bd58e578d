"""A layer's calling contract, typed: :class:`LayerMeta`, built once from the ``_META`` dict
that the generated modules embed (``codegen/emit.py``'s ``layer_meta`` writes it; the
generated files stay plain data) and read by every run-time package instead of string keys.

:func:`layer_meta` takes the dict or a ``LayerMeta`` and returns the ``LayerMeta``, one per
dict (cached by identity), so that the entry points generated code calls with ``_META`` and
the internal helpers called with a ``LayerMeta`` are the same functions. A dict may leave
out any field but ``name`` (tools and tests build small ones for a layout); the defaults
are those of a layer without that part.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = ["LayerMeta", "MetaLike", "OptionMeta", "SplitMeta", "TensorMeta", "layer_meta"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class OptionMeta(NamedTuple):
    """A numeric option: its default and bounds (``None``: unbounded), as ``(default, min, max)``."""

    default: float
    min: float | None
    max: float | None


class TensorMeta(NamedTuple):
    """A tensor input beside x, as ``(shape, grad, mask)``."""

    shape: str
    """Its declared shape: ``"x"`` (x's own) or a broadcast one (``runtime/tensors.py``)."""
    grad: bool
    """Whether it has a gradient (a mask or other constant has none)."""
    mask: bool
    """Whether it is a mask (boolean values allowed)."""


@dataclass(frozen=True)
class SplitMeta:
    """The split reduction's shape (batch layouts in training): sums per level of the forward
    and the number of sums of the backward, per group."""

    levels: tuple[int, ...]
    backward: int


@dataclass(frozen=True, eq=False)
class LayerMeta:
    """What the generated code of one layer is called with: names, layout, options with their
    bounds, statistics per mode, tensor inputs and outputs beside x and y."""

    name: str
    """The layer's name (C symbols and error messages start with it)."""
    layout: str = "trailing"
    """Which axes a group spans: ``"trailing"`` (the last ``axes``) or ``"channels"`` (NCHW...)."""
    reduce: str = "features"
    """What a group is: ``features``, ``batch``, ``instance``, ``group`` (``spec/model.py``'s LAYOUTS)."""
    params: tuple[str, ...] = ()
    """The parameters, in the order of the spec (and of every call)."""
    scalar_params: tuple[str, ...] = ()
    """The parameters that are one number rather than one per feature."""
    axes: int = 1
    """The number of trailing axes a ``trailing`` layer normalizes over."""
    param_init: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    """Each parameter's initial value (the nn modules' reset)."""
    options: Mapping[str, OptionMeta] = field(default_factory=lambda: _EMPTY)
    """The numeric options by name, in order: default and bounds."""
    integer_options: tuple[str, ...] = ()
    """The options that must be whole numbers."""
    inputs: tuple[str, ...] = ()
    """Per-group inputs beside x (one value per group, or one for all)."""
    buffers: tuple[str, ...] = ()
    """Running buffers (batch norm's running mean and variance), in order."""
    buffer_init: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    """Each buffer's initial value."""
    modes: tuple[str, ...] = ("train",)
    """The modes, ``train`` first (``eval`` where the layer has one)."""
    min_group_size: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    """The fewest elements a group may have, per mode."""
    stats: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _EMPTY)
    """The statistics each mode's forward saves, in the order of the kernels' arrays."""
    split: SplitMeta | None = None
    """The split reduction's shape, or None where the layer has none."""
    buffer_reads: tuple[str, ...] = ()
    """The modes whose statistics read the running buffers (their kernels take them; a dict
    without the field: ``eval``)."""
    blocks: bool = False
    """Whether a mode has block statistics (no channels-last C kernels: NCHW copies are run)."""
    tensors: Mapping[str, TensorMeta] = field(default_factory=lambda: _EMPTY)
    """Tensor inputs beside x, by name, in order."""
    outputs: tuple[str, ...] = ()
    """Outputs beside y, in order."""

    @property
    def multi(self) -> bool:
        """Whether the layer has tensor inputs beside x or outputs beside y."""
        return bool(self.tensors or self.outputs)

    @property
    def grad_tensors(self) -> tuple[str, ...]:
        """The tensor inputs with a gradient, in order."""
        return tuple(t for t, tm in self.tensors.items() if tm.grad)

    def as_dict(self) -> dict[str, Any]:
        """The plain dict, as the generated modules embed it."""
        return {
            "name": self.name,
            "layout": self.layout,
            "reduce": self.reduce,
            "params": list(self.params),
            "scalar_params": list(self.scalar_params),
            "axes": self.axes,
            "param_init": dict(self.param_init),
            "options": {k: tuple(v) for k, v in self.options.items()},
            **({"integer_options": list(self.integer_options)} if self.integer_options else {}),
            "inputs": list(self.inputs),
            "buffers": list(self.buffers),
            "buffer_init": dict(self.buffer_init),
            "modes": list(self.modes),
            "min_group_size": dict(self.min_group_size),
            "stats": {m: list(s) for m, s in self.stats.items()},
            "split": {"levels": list(self.split.levels), "backward": self.split.backward} if self.split else None,
            "buffer_reads": list(self.buffer_reads),
            **({"blocks": True} if self.blocks else {}),
            **({"tensors": {k: tuple(v) for k, v in self.tensors.items()}} if self.tensors else {}),
            **({"outputs": list(self.outputs)} if self.outputs else {}),
        }

    def __reduce__(self) -> tuple:
        return (LayerMeta.from_dict, (self.as_dict(),))  # mapping proxies do not pickle

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerMeta:
        """The ``LayerMeta`` of an embedded ``_META`` dict (any field but ``name`` may be missing)."""
        split = d.get("split")
        return cls(
            name=d["name"],
            layout=d.get("layout", "trailing"),
            reduce=d.get("reduce", "features"),
            params=tuple(d.get("params", ())),
            scalar_params=tuple(d.get("scalar_params", ())),
            axes=d.get("axes", 1),
            param_init=MappingProxyType(dict(d.get("param_init", {}))),
            options=MappingProxyType({k: OptionMeta(*v) for k, v in d.get("options", {}).items()}),
            integer_options=tuple(d.get("integer_options", ())),
            inputs=tuple(d.get("inputs", ())),
            buffers=tuple(d.get("buffers", ())),
            buffer_init=MappingProxyType(dict(d.get("buffer_init", {}))),
            modes=tuple(d.get("modes", ("train",))),
            min_group_size=MappingProxyType(dict(d.get("min_group_size", {}))),
            stats=MappingProxyType({m: tuple(s) for m, s in d.get("stats", {}).items()}),
            split=SplitMeta(tuple(split["levels"]), split["backward"]) if split else None,
            buffer_reads=tuple(d.get("buffer_reads", ("eval",))),  # older contracts: eval reads them
            blocks=bool(d.get("blocks", False)),
            tensors=MappingProxyType({k: TensorMeta(*v) for k, v in d.get("tensors", {}).items()}),
            outputs=tuple(d.get("outputs", ())),
        )


_CACHE: dict[int, tuple[Mapping[str, Any], LayerMeta]] = {}
_LOCK = threading.Lock()


def layer_meta(meta: Mapping[str, Any] | LayerMeta) -> LayerMeta:
    """``meta`` as a :class:`LayerMeta`: itself, or the one built from this dict (built once per
    dict object: the generated modules' ``_META`` are converted on their first call)."""
    if isinstance(meta, LayerMeta):
        return meta
    hit = _CACHE.get(id(meta))
    if hit is not None and hit[0] is meta:
        return hit[1]
    built = LayerMeta.from_dict(meta)
    with _LOCK:
        if len(_CACHE) > 4096:  # dicts built on the fly (tools, tests) must not pile up
            _CACHE.clear()
        _CACHE[id(meta)] = (meta, built)  # the dict is kept, so that its id is not reused
    return built


MetaLike = Mapping[str, Any] | LayerMeta
"""What the entry points take: the embedded dict or the ``LayerMeta`` built from it."""
