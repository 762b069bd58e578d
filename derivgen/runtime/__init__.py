"""Runtime shared by the generated NumPy modules and the C bindings.

Generated files hold the mathematics; this module holds the calling
contract: argument validation (clear ``ValueError``/``TypeError`` naming the
argument), the layout of x as a 4-D view ``(O, G, Cg, S)`` -- O outer
(samples or rows), G groups of channels, Cg channels per group, S inner
(spatial) -- and the output buffers.

Every catalogue layout is such a view:

==============  ============================  ==================================
layer           view (O, G, Cg, S)            one normalization group
==============  ============================  ==================================
layernorm-like  (rows, 1, D, 1)               a row (per sample)
instancenorm    (N, C, 1, spatial)            (sample, channel)
groupnorm       (N, G, C/G, spatial)          (sample, group)
batchnorm       (N, C, 1, spatial)            a channel, over samples and space
layernorm2d     (N, 1, C, spatial)            (sample, position): its C channels
==============  ============================  ==================================

Parameters are always ``(1, G, Cg, 1)`` in this view; statistics are one value
per group, stored as a flat array of ``n_groups`` values (a position layout's in
(sample, position) order, shown with shape ``(N, *spatial)``).

Stage 0 beside :mod:`derivgen.symbolic` (no SymPy here): what generated code calls at run
time. This face is the module the generated NumPy and C bindings import
(``from derivgen import runtime as _rt``); it re-exports what they call. Beside it:

* :mod:`~derivgen.runtime.abi`: every C kernel's calling convention, as data (the C
  prototypes, the ctypes binding and the PyTorch operators are all produced from it);
* :mod:`~derivgen.runtime.validate`: the one argument-validation contract of every backend;
* :mod:`~derivgen.runtime.base`: the checks and buffers the calls below share;
* :mod:`~derivgen.runtime.split`: the split reduction (statistics over a batch no one
  process holds); :mod:`~derivgen.runtime.second`: the second-order calls;
* :mod:`~derivgen.runtime.executor`: the NumPy backend's thread pool;
* :mod:`~derivgen.runtime.cbind`: the ctypes binding of compiled kernels;
* :mod:`~derivgen.runtime.build`: compiling generated C into cached shared libraries;
* :mod:`~derivgen.runtime.machine`: what the CPU is (model, ISA flags, caches);
* :mod:`~derivgen.runtime.fsutil`: atomic file writes;
* :mod:`~derivgen.runtime.elementwise`: NumPy versions of the table functions NumPy lacks.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from derivgen.runtime.abi import reads_buffers
from derivgen.runtime.base import (
    DTYPES,
    Cache,
    StatisticsView,
    _check_array,
    _check_cache,
    _contig,
    _grad_shapes,
    _input_grad_shapes,
    _inputs,
    _no_overlap,
    _out_by_field,
    _param_dtypes,
    _param_shapes,
    aligned_empty,
    check_out,
    named_errors,
)
from derivgen.runtime.elementwise import erf, indicator, sigmoid, softplus, step, stop_gradient
from derivgen.runtime.executor import (
    CHUNK_BYTES,
    chunks,
    f64,
    for_chunks,
    group_max,
    group_mean,
    group_mean_prod,
    group_min,
    group_total,
    new_stats,
    num_threads,
    set_num_threads,
    store,
    sum_prod,
)
from derivgen.runtime.meta import LayerMeta, MetaLike, layer_meta
from derivgen.runtime.second import SecondCall, prepare_backward_backward, prepare_jvp, second_fields
from derivgen.runtime.split import (
    SplitCall,
    check_dy,
    check_sums,
    finish_part,
    need_stats,
    part_input_grad,
    part_param_grad,
    part_sum,
    part_tensor_grad,
    prepare_split,
    split_layout,
    split_level,
    stats_array,
    sums_array,
)
from derivgen.runtime.tensors import (
    check_cotangents,
    check_tensors,
    extra_outputs,
    finish_tensor_grad,
    grad_buffer,
    tensor_shape,
)
from derivgen.runtime.validate import (
    Layout,
    check_buffer_shape,
    check_group_size,
    check_not_empty,
    check_options,
    check_same_dtype,
    layout_from_shapes,
    leading_count,
    scalar_params,
)

# The face: what the generated modules call as ``_rt.<name>``, what the PyTorch
# operators and tools use, and the calls defined below.
__all__ = [
    "CHUNK_BYTES",
    "DTYPES",
    "BackwardCall",
    "Cache",
    "ForwardCall",
    "Layout",
    "SecondCall",
    "SplitCall",
    "StatisticsView",
    "aligned_empty",
    "block_mean",
    "check_buffer_shape",
    "check_dy",
    "check_group_size",
    "check_not_empty",
    "check_options",
    "check_out",
    "check_same_dtype",
    "check_sums",
    "chunks",
    "erf",
    "f64",
    "finish_input_grad",
    "finish_part",
    "finish_tensor_grad",
    "for_chunks",
    "grad_buffer",
    "grad_fields",
    "grads_type",
    "group_max",
    "group_mean",
    "group_mean_prod",
    "group_min",
    "group_total",
    "group_view",
    "indicator",
    "layout_from_shapes",
    "leading_count",
    "leading_mask",
    "need_stats",
    "new_stats",
    "num_threads",
    "part_input_grad",
    "part_param_grad",
    "part_sum",
    "part_tensor_grad",
    "prepare_backward",
    "prepare_backward_backward",
    "prepare_forward",
    "prepare_jvp",
    "prepare_split",
    "resolve_layout",
    "second_fields",
    "set_num_threads",
    "sigmoid",
    "softplus",
    "split_layout",
    "split_level",
    "stats_array",
    "step",
    "stop_gradient",
    "store",
    "sum_prod",
    "sums_array",
    "window_sum",
]


def resolve_layout(meta: MetaLike, x: np.ndarray, params: dict[str, np.ndarray], num_groups: int | None) -> Layout:
    """The layout of x (errors name the argument); an empty x has one too (no groups,
    or groups of no values), as torch.nn accepts empty batches."""
    meta = layer_meta(meta)
    return layout_from_shapes(meta, x.shape, {p: a.shape for p, a in params.items()}, num_groups)


@cache
def grads_type(name: str, fields: tuple[str, ...]) -> type[tuple]:
    """The named tuple a layer's backward returns (``LayernormGrads(dx, dgamma, ...)``)."""
    return namedtuple(f"{name.title().replace('_', '')}Grads", fields)


def grad_fields(meta: MetaLike) -> tuple[str, ...]:
    """The backward's fields: dx, then d<tensor> (the tensor inputs with a gradient), d<param>
    and d<input> in spec order."""
    meta = layer_meta(meta)
    tensors = tuple("d" + t for t, (_, grad, _) in meta.tensors.items() if grad)
    return ("dx", *tensors, *("d" + p for p in meta.params), *("d" + i for i in meta.inputs))


@dataclass
class ForwardCall:
    """A validated forward call: the layout, C-ordered arrays, checked options and inputs."""

    meta: LayerMeta
    mode: str
    layout: Layout
    dtype: np.dtype
    x: np.ndarray  # C-contiguous, original shape
    params: dict[str, np.ndarray]  # C-contiguous, flat (C,)
    options: dict[str, float]
    inputs: dict[str, np.ndarray]  # flat, n_groups or 1 values
    buffers: dict[str, np.ndarray | None]
    out: np.ndarray
    extra: dict = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # tensor inputs, C order, x's shape
    outs: dict[str, np.ndarray] = field(default_factory=dict)  # the outputs beside y

    def cache(self, stats: dict[str, np.ndarray]) -> Cache:
        """What the backward needs of this call, with the forward's statistics."""
        c = Cache(self.meta, self.mode, self.layout, self.x, self.params, stats, self.options, self.inputs)
        c.tensors = self.tensors
        return c

    def result(self, stats: dict[str, np.ndarray]) -> tuple:
        """``(y, cache)``, or ``((y, *outputs beside y), cache)`` for a layer with several."""
        cache = self.cache(stats)
        if not self.outs:
            return self.out, cache
        return (self.out, *self.outs.values()), cache


def _buffers(meta: LayerMeta, buffers: dict, layout: Layout, dtype: np.dtype, mode: str) -> dict:
    """The running buffers by name (None where not given; eval mode needs them all)."""
    name = meta.name
    bufs = {}
    for bname in meta.buffers:
        b = buffers.get(bname)
        if b is not None:
            b = _check_array(bname, b)
            check_same_dtype(meta, bname, b.dtype, dtype)
            check_buffer_shape(meta, bname, b.shape, layout)
            if mode == "train" and not b.flags.writeable:
                raise ValueError(f"{name}: {bname} must be writeable (it is updated in place in training mode)")
        elif mode == "eval":
            raise ValueError(f"{name}: eval mode (training=False) needs {bname}")
        elif reads_buffers(meta, mode):
            raise ValueError(f"{name}: training mode needs {bname} (its statistics read it)")
        bufs[bname] = b
    return bufs


@named_errors
def prepare_forward(
    meta: MetaLike,
    x: np.ndarray,
    params: dict[str, np.ndarray],
    options: dict[str, float],
    inputs: dict[str, Any],
    buffers: dict[str, np.ndarray | None],
    training: bool,
    num_groups: int | None = None,
    out: np.ndarray | None = None,
    tensors: Mapping[str, Any] | None = None,
    outs: Any = None,
) -> ForwardCall:
    """Checks for a forward call (errors name the argument), and its layout; ``tensors`` are
    the tensor inputs beside x by name, ``outs`` preallocated outputs beside y."""
    meta = layer_meta(meta)
    name = meta.name
    x = _check_array("x", x)
    dtype = x.dtype
    params = scalar_params(meta, params, dtype)
    _param_dtypes(meta, params, dtype)
    layout = resolve_layout(meta, x, params, num_groups)
    _param_shapes(meta, params, layout)
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"{name}: training must be a bool, got {type(training).__name__}")
    mode = "train" if training or "eval" not in meta.modes else "eval"
    empty = x.size == 0
    if not empty:  # an empty x normalizes to an empty y, as in torch.nn
        check_group_size(meta, mode, layout)
    opts = check_options(meta, options)
    ins = _inputs(meta, inputs, layout, dtype)
    bufs = _buffers(meta, buffers, layout, dtype, mode)
    if empty and mode == "train":  # no values: the running buffers stay as they are (as torch.nn leaves them)
        bufs = dict.fromkeys(bufs)
    out = check_out("out", out, x.shape, dtype)
    tens = check_tensors(meta, tensors or {}, layout, dtype)
    extra_outs = extra_outputs(meta, layout, dtype, outs)
    _no_overlap(
        name,
        {"out": out, **{"outs." + k: v for k, v in extra_outs.items()}},
        {"x": x, **params, **{k: v for k, v in bufs.items() if v is not None}, **tens},
    )
    return ForwardCall(
        meta,
        mode,
        layout,
        dtype,
        _contig(x),
        {p: _contig(params[p]).reshape(-1) for p in meta.params},
        opts,
        ins,
        bufs,
        out,
        tensors=tens,
        outs=extra_outs,
    )


@dataclass
class BackwardCall:
    """A validated backward call: the forward's cache, dy in C order, the outputs."""

    cache: Cache
    dy: np.ndarray
    outs: dict[str, np.ndarray]  # dx (x shape), d<tensor>, d<param> (param shape), d<input> (n_groups)
    cotangents: dict[str, np.ndarray | None] = field(default_factory=dict)  # of the outputs beside y


@named_errors
def prepare_backward(
    meta: MetaLike,
    dy: np.ndarray,
    cache: Cache,
    out: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
    cotangents: Mapping[str, Any] | None = None,
) -> BackwardCall:
    """Checks for a backward call against the forward's cache (errors name the argument);
    ``cotangents`` are those of the outputs beside y by name (None: zero)."""
    meta = layer_meta(meta)
    name = meta.name
    cache = _check_cache(meta, cache)
    dy = _check_array("dy", dy)
    if dy.dtype != cache.dtype:
        raise TypeError(f"{name}: dy has dtype {dy.dtype} but the forward ran in {cache.dtype}")
    if tuple(dy.shape) != tuple(cache.layout.x_shape):
        raise ValueError(f"{name}: dy must have the shape of x {cache.layout.x_shape}, got {dy.shape}")
    fields = grad_fields(meta)
    shapes = {**_grad_shapes(meta, cache.layout, ("dx",)), **_input_grad_shapes(meta, cache.layout, cache.inputs)}
    for t, (kind, grad, _) in meta.tensors.items():
        if grad:
            shapes["d" + t] = tensor_shape(meta, kind, cache.layout)
    given = _out_by_field(name, out, fields)
    outs = {f: check_out(f"out.{f}", given.get(f), shapes[f], cache.dtype) for f in fields if f in shapes}
    cots = check_cotangents(meta, cotangents or {}, cache.layout, cache.dtype)
    tens = getattr(cache, "tensors", {})
    _no_overlap(
        name,
        outs,
        {"dy": dy, "x": cache.x, **cache.params, **tens, **{"d" + k: v for k, v in cots.items() if v is not None}},
    )
    return BackwardCall(cache, _contig(dy), outs, cots)


def finish_input_grad(cache: Cache, iname: str, per_group: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Per-group input gradients, summed when the input was a scalar; into ``out`` (the
    array the caller passed for it, checked by the prepare step) when given."""
    if cache.inputs[iname].size == 1:
        got = np.asarray(per_group.sum(dtype=np.float64), dtype=cache.dtype)
    else:
        got = per_group.astype(cache.dtype, copy=False).reshape(cache.layout.group_shape)
    if out is None:
        return got
    out[...] = got.reshape(out.shape)
    return out


def leading_mask(layout: Layout, p: float) -> np.ndarray:
    """``leading(p)`` as a float64 array of a parameter's 4-D shape: 1 on the first
    ⌊p·N⌋ normalized features, 0 on the rest."""
    n = layout.Cg
    mask = np.zeros(n, dtype=np.float64)
    mask[: leading_count(p, n)] = 1.0
    return mask.reshape(layout.param4)


def window_sum(u: np.ndarray | float, k: float, transposed: bool, like: np.ndarray) -> np.ndarray:
    """``window(u, k)`` over the group's axis (axis 2 of the 4-D view, shaped like ``like``):
    at each element the sum of u over elements i - ⌊k/2⌋ .. i + ⌊(k-1)/2⌋ inside the group
    (zero padded); ``transposed``: over i - ⌊(k-1)/2⌋ .. i + ⌊k/2⌋ (see
    :mod:`derivgen.symbolic.window`). Summed in offset order, the same at every element."""
    u = np.broadcast_to(np.asarray(u, dtype=np.float64), like.shape)
    k, n = int(k), like.shape[2]
    lo, hi = k // 2, (k - 1) // 2
    if transposed:
        lo, hi = hi, lo
    out = np.zeros(like.shape, dtype=np.float64)
    for d in range(-lo, hi + 1):  # out[i] += u[i + d] where 0 <= i + d < n
        if d >= 0 and d < n:
            out[:, :, : n - d] += u[:, :, d:]
        elif d < 0 and -d < n:
            out[:, :, -d:] += u[:, :, : n + d]
    return out


def block_mean(u: np.ndarray | float, axes: tuple[int, ...], like: np.ndarray) -> np.ndarray:
    """``mean(u, kind)`` (:mod:`derivgen.symbolic.block`): at each element the mean of u over
    the ``axes`` of the 4-D view one block spans, in float64, shaped like ``like``."""
    u = np.broadcast_to(np.asarray(u, dtype=np.float64), like.shape)
    return np.broadcast_to(u.mean(axis=axes, keepdims=True, dtype=np.float64), like.shape)


def group_view(values: np.ndarray, layout: Layout) -> np.ndarray:
    """A per-group input (1 value or n_groups values) as a broadcastable 4-D array."""
    return values.reshape(1, 1, 1, 1) if values.size == 1 else values.reshape(layout.stat4)
