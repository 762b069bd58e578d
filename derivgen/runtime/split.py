"""The split reduction's calls: a layer whose groups span the batch (batch norm, any
spec with ``reduce = "batch"``) computes its training statistics from sums over parts of
the batch, level by level (the ``split_*`` functions of the generated NumPy modules and C
bindings call these checks and helpers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from derivgen.runtime.base import _by_name, _check_array, _contig, _inputs, _param_dtypes, _param_shapes, named_errors
from derivgen.runtime.meta import LayerMeta, MetaLike, layer_meta
from derivgen.runtime.tensors import check_tensors, finish_tensor_grad, tensor_shape
from derivgen.runtime.validate import Layout, check_float, check_options, layout_from_shapes, scalar_params


@dataclass
class SplitCall:
    """A validated call of a split-reduction function on one part of a batch."""

    meta: LayerMeta
    layout: Layout  # O: this part's samples (0 for an empty part)
    dtype: np.dtype
    x: np.ndarray  # C-contiguous, the part's own shape
    params: dict[str, np.ndarray]
    options: dict[str, float]
    inputs: dict[str, np.ndarray]
    stats: np.ndarray | None  # (statistics, groups) float64, in meta.stats["train"] order
    count: float | None  # values per group over all parts
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # the tensor inputs at the part's x shape


def split_layout(meta: MetaLike, x_shape: Sequence[int], param_shapes: dict[str, Sequence[int]]) -> Layout:
    """The layout of one part of a batch (it may hold no samples)."""
    meta = layer_meta(meta)
    x_shape = tuple(x_shape)
    if len(x_shape) >= 2 and x_shape[0] == 0:
        L = layout_from_shapes(meta, (1, *x_shape[1:]), param_shapes, None)
        return Layout(
            O=0,
            G=L.G,
            Cg=L.Cg,
            S=L.S,
            per_sample=L.per_sample,
            x_shape=x_shape,
            param_shape=L.param_shape,
            group_shape=L.group_shape,
        )
    return layout_from_shapes(meta, x_shape, param_shapes, None)


@named_errors
def prepare_split(
    meta: MetaLike,
    x: np.ndarray,
    params: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    options: Mapping[str, float] | Sequence[float] | None = None,
    inputs: Mapping[str, Any] | Sequence[Any] | None = None,
    stats: np.ndarray | None = None,
    count: float | None = None,
    need_stats: bool = False,
    need_count: bool = False,
    tensors: Mapping[str, Any] | None = None,
    need_tensors: bool = False,
) -> SplitCall:
    """Checks for the split-reduction functions (errors name the argument). Parameters are
    a dict by name or a sequence in spec order; options, per-group inputs and the tensor
    inputs beside x (the part's own, of their declared shapes for the part's x) dicts by name
    (options default as in the spec). A part may be empty; the minimum group size applies
    to ``count``, the size over all parts. The tensors are checked with ``need_tensors``
    (the functions that read the part's elements; ``split_finish`` reads none)."""
    meta = layer_meta(meta)
    name = meta.name
    if meta.split is None:
        raise ValueError(
            f"{name}: the split reduction is for layers whose groups span the batch "
            f"(layout channels, reduce batch); this one is {meta.layout}/{meta.reduce}"
        )
    params = _by_name(meta, "params", params, list(meta.params))
    missing = [p for p in meta.params if p not in params]
    if missing:
        raise TypeError(f"{name}: params {missing} are required")
    options = _by_name(
        meta,
        "options",
        options,
        list(meta.options),
        {o: d for o, (d, _, _) in meta.options.items() if d is not None},
    )
    inputs = _by_name(meta, "inputs", inputs, list(meta.inputs))
    x = _check_array("x", x)
    dtype = x.dtype
    params = scalar_params(meta, params, dtype)
    _param_dtypes(meta, params, dtype)
    layout = split_layout(meta, x.shape, {p: params[p].shape for p in meta.params})
    _param_shapes(meta, params, layout)
    opts = check_options(meta, options)
    nst = len(meta.stats["train"])
    if stats is not None:
        stats = _check_array("stats", stats)
        if stats.dtype != np.float64 or stats.shape != (nst, layout.n_groups):
            raise ValueError(
                f"{name}: stats must be float64 of shape ({nst}, {layout.n_groups}) (statistics "
                f"{meta.stats['train']}, one row each), got {stats.dtype} {stats.shape}"
            )
    elif need_stats:
        raise TypeError(f"{name}: stats is required (from split_finish)")
    if count is not None:
        n = check_float("count", count, 1, None)
        need = meta.min_group_size["train"]
        if n < need:
            raise ValueError(f"{name}: count={n:g} values per group over all parts; training needs at least {need}")
        count = n
    elif need_count:
        raise TypeError(f"{name}: count is required (values per group over all parts)")
    full = {}
    if meta.tensors and need_tensors:
        if tensors is not None and not isinstance(tensors, Mapping):
            raise TypeError(f"{name}: tensors must be a dict by name ({', '.join(meta.tensors)})")
        full = check_tensors(meta, tensors or {}, layout, dtype)
    return SplitCall(
        meta,
        layout,
        dtype,
        _contig(x),
        {p: _contig(params[p]) for p in meta.params},
        opts,
        _inputs(meta, inputs, layout, dtype),
        stats,
        count,
        full,
    )


def part_sum(layout: Layout, x: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """``_sum``: a part's sum over each group's elements (4-D, keepdims); an operand
    constant along reduced axes (a parameter) counts once per element of the part."""
    axes = layout.reduce_axes

    def total(a: np.ndarray) -> np.ndarray:
        return np.add.reduce(np.broadcast_to(a, x.shape), axis=axes, keepdims=True, dtype=np.float64)

    return total


def sums_array(layout: Layout, sums: list) -> np.ndarray:
    """A level's sums (4-D, keepdims, one per accumulator) as a float64 (sums, groups) array."""
    out = np.zeros((len(sums), layout.n_groups))
    for k, v in enumerate(sums):
        out[k] = np.broadcast_to(v, layout.stat4).reshape(-1)
    return out


def split_level(meta: MetaLike, level: int) -> int:
    """``level`` as an int, checked against the layer's statistics levels."""
    meta = layer_meta(meta)
    n = len(meta.split.levels)
    if isinstance(level, (bool, np.bool_)) or not isinstance(level, (int, np.integer)) or not 0 <= level < n:
        raise ValueError(f"{meta.name}: level must be an int from 0 to {n - 1}, got {level!r}")
    return int(level)


def need_stats(meta: MetaLike, call: SplitCall, level: int) -> None:
    """A level after the first needs the statistics of the earlier ones."""
    meta = layer_meta(meta)
    if level > 0 and call.stats is None:
        raise TypeError(
            f"{meta.name}: level {level} needs the statistics of the earlier levels: stats= (from split_finish)"
        )


def finish_part(sums: Any, meta: MetaLike, params: Mapping[str, Any] | Sequence[Any] | None) -> np.ndarray:
    """An empty part with the groups of ``sums`` (split_finish reads no x): its layout
    and dtype (the parameters', float64 without any)."""
    meta = layer_meta(meta)
    params = list(params.values()) if isinstance(params, dict) else list(params or [])
    arrays = [p for p in params if isinstance(p, np.ndarray)]
    spanning = [p for p in arrays if p.size > 1 or p.ndim == 1 and p.shape[0] > 1]
    groups = spanning[0].shape[0] if spanning else (np.shape(sums)[1] if np.ndim(sums) == 2 else 0)
    dtype = arrays[0].dtype if arrays else np.float64
    return np.empty((0, groups), dtype=dtype)


def stats_array(meta: MetaLike, call: SplitCall) -> np.ndarray:
    """The statistics to fill: a copy of the call's (zeros when it has none), (statistics, groups)."""
    meta = layer_meta(meta)
    nst = len(meta.stats["train"])
    return np.zeros((nst, call.layout.n_groups)) if call.stats is None else call.stats.copy()


def check_dy(meta: MetaLike, dy: np.ndarray, call: SplitCall) -> np.ndarray:
    """dy of a part, with the part's shape and dtype, in C order."""
    meta = layer_meta(meta)
    dy = _check_array("dy", dy)
    if dy.dtype != call.dtype or dy.shape != call.x.shape:
        raise ValueError(
            f"{meta.name}: dy must have the shape and dtype of x {call.x.shape} {call.dtype}, got {dy.shape} {dy.dtype}"
        )
    return _contig(dy)


def part_param_grad(value: np.ndarray | float, param: np.ndarray) -> np.ndarray:
    """A parameter's gradient over a part, in its shape and dtype (a constant: every entry)."""
    v = np.asarray(value, dtype=np.float64)
    if v.size == 1 and param.size != 1:
        return np.full(param.shape, v.reshape(-1)[0], dtype=param.dtype)
    return v.astype(param.dtype).reshape(param.shape)


def part_tensor_grad(meta: MetaLike, tname: str, layout: Layout, buf: np.ndarray) -> np.ndarray:
    """A tensor input's gradient over a part from its element gradients ``buf`` (the part's x
    shape): itself for a tensor of x's shape, else summed over the axes it is broadcast over."""
    meta = layer_meta(meta)
    kind = meta.tensors[tname][0]
    if kind == "x":
        return buf
    return finish_tensor_grad(meta, tname, layout, buf, np.zeros(tensor_shape(meta, kind, layout), buf.dtype))


def part_input_grad(call: SplitCall, iname: str, per_group: np.ndarray | float) -> np.ndarray:
    """A per-group input's gradient over a part: summed for a scalar input, else one per group."""
    v = np.broadcast_to(per_group, call.layout.stat4).reshape(-1)
    if call.inputs[iname].size == 1:
        return np.asarray(v.sum(dtype=np.float64), dtype=call.dtype)
    return v.astype(call.dtype).reshape(call.layout.group_shape)


def check_sums(meta: MetaLike, sums: np.ndarray, rows: int, layout: Layout) -> np.ndarray:
    """Sums over whole groups: float64 of shape (rows, groups), in C order."""
    meta = layer_meta(meta)
    name = meta.name
    sums = _check_array("sums", sums)
    if sums.dtype != np.float64 or sums.shape != (rows, layout.n_groups):
        raise ValueError(
            f"{name}: sums must be float64 of shape ({rows}, {layout.n_groups}), got {sums.dtype} {sums.shape}"
        )
    return _contig(sums)
