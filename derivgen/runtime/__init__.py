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
==============  ============================  ==================================

Parameters are always ``(1, G, Cg, 1)`` in this view; statistics are one value
per group, stored as a flat array of ``n_groups`` values.

Stage 0 beside :mod:`derivgen.symbolic` (no SymPy here): what generated code calls at run
time. This face is the module the generated NumPy and C bindings import
(``from derivgen import runtime as _rt``); beside it:

* :mod:`~derivgen.runtime.abi`: every C kernel's calling convention, as data (the C
  prototypes, the ctypes binding and the PyTorch operators are all produced from it);
* :mod:`~derivgen.runtime.validate`: the one argument-validation contract of every backend;
* :mod:`~derivgen.runtime.executor`: the NumPy backend's thread pool;
* :mod:`~derivgen.runtime.cbind`: the ctypes binding of compiled kernels;
* :mod:`~derivgen.runtime.build`: compiling generated C into cached shared libraries;
* :mod:`~derivgen.runtime.machine`: what the CPU is (model, ISA flags, caches);
* :mod:`~derivgen.runtime.fsutil`: atomic file writes.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from derivgen.runtime.validate import (Layout, check_buffer_shape, check_float, check_group_size, check_input_shape,
                       check_not_empty, check_options, check_param_shapes, check_same_dtype, is_scalar_shape,
                       layout_from_shapes)

# re-exported: the generated modules call them as derivgen.runtime.<name>
from derivgen.runtime.executor import (CHUNK_BYTES, chunks, f64, for_chunks, group_mean, group_mean_prod, group_total,
                       new_stats, num_threads, set_num_threads, store, sum_prod)

_check_float = check_float      # the name derivgen.torch and older callers use

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _check_array(name: str, a: Any) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        if isinstance(a, (list, tuple)) or np.isscalar(a):
            raise TypeError(f"{name} must be a numpy.ndarray of float32 or float64, got {type(a).__name__}")
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype not in DTYPES:
        raise TypeError(f"{name} must have dtype float32 or float64, got {a.dtype}")
    return a


def resolve_layout(meta: dict, x: np.ndarray, params: dict, num_groups) -> Layout:
    """The layout of a non-empty x (errors name the argument)."""
    check_not_empty(meta, x.shape)
    return layout_from_shapes(meta, x.shape, {p: a.shape for p, a in params.items()}, num_groups)


@lru_cache(maxsize=None)
def grads_type(name: str, fields: tuple[str, ...]):
    return namedtuple(f"{name.title().replace('_', '')}Grads", fields)


class Cache:
    """What the forward saves for the backward.

    Statistics are flat float64 arrays of ``n_groups`` values (kept in double
    so the backward centres float32 data exactly as the forward did); as
    attributes (``cache.mean``, ``cache.rstd`` ...) they are shown in the
    layer's group shape (rows for layer norm, (N, C) for instance norm, (C,)
    for batch norm) and dtype.
    """

    def __init__(self, meta, mode, layout, x, params, stats, options, inputs):
        self.meta, self.mode, self.layout = meta, mode, layout
        self.x, self.params, self.stats = x, params, stats
        self.options, self.inputs = options, inputs

    @property
    def dtype(self):
        return self.x.dtype

    def __getattr__(self, item):
        stats = self.__dict__.get("stats", {})
        if item in stats:
            return stats[item].reshape(self.layout.group_shape).astype(self.x.dtype)
        raise AttributeError(item)

    def __repr__(self):
        return (f"<{self.meta['name']} cache mode={self.mode} x{tuple(self.x.shape)} {self.x.dtype} "
                f"stats={list(self.stats)}>")


@dataclass
class ForwardCall:
    meta: dict
    mode: str
    layout: Layout
    dtype: np.dtype
    x: np.ndarray                     # C-contiguous, original shape
    params: dict[str, np.ndarray]     # C-contiguous, flat (C,)
    options: dict[str, float]
    inputs: dict[str, np.ndarray]     # flat, n_groups or 1 values
    buffers: dict[str, np.ndarray | None]
    out: np.ndarray
    extra: dict = field(default_factory=dict)

    def cache(self, stats: dict[str, np.ndarray]) -> Cache:
        return Cache(self.meta, self.mode, self.layout, self.x, self.params, stats, self.options, self.inputs)


def _contig(a: np.ndarray) -> np.ndarray:
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _options(meta: dict, options: dict) -> dict[str, float]:
    return check_options(meta, options)


def _param_dtypes(meta: dict, params: dict, dtype) -> None:
    for pname in meta["params"]:
        check_same_dtype(meta, pname, _check_array(pname, params[pname]).dtype, dtype, "; use one dtype for all arrays")


def _param_shapes(meta: dict, params: dict, layout: Layout) -> None:
    check_param_shapes(meta, {p: params[p].shape for p in meta["params"]}, layout)


def prepare_forward(meta: dict, x, params: dict, options: dict, inputs: dict, buffers: dict,
                    training: bool, num_groups=None, out=None) -> ForwardCall:
    name = meta["name"]
    x = _check_array("x", x)
    dtype = x.dtype
    _param_dtypes(meta, params, dtype)
    layout = resolve_layout(meta, x, params, num_groups)
    _param_shapes(meta, params, layout)
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"{name}: training must be a bool, got {type(training).__name__}")
    mode = "train" if training or "eval" not in meta["modes"] else "eval"
    check_group_size(meta, mode, layout)
    opts = _options(meta, options)
    ins = _inputs(meta, inputs, layout, dtype)
    bufs = {}
    for bname in meta["buffers"]:
        b = buffers.get(bname)
        if b is not None:
            b = _check_array(bname, b)
            check_same_dtype(meta, bname, b.dtype, dtype)
            check_buffer_shape(meta, bname, b.shape, layout)
            if mode == "train" and not b.flags.writeable:
                raise ValueError(f"{name}: {bname} must be writeable (it is updated in place in training mode)")
        elif mode == "eval":
            raise ValueError(f"{name}: eval mode (training=False) needs {bname}")
        bufs[bname] = b
    out = check_out("out", out, x.shape, dtype)
    _no_overlap(name, {"out": out}, {"x": x, **params, **{k: v for k, v in bufs.items() if v is not None}})
    return ForwardCall(meta, mode, layout, dtype, _contig(x),
                       {p: _contig(params[p]).reshape(-1) for p in meta["params"]},
                       opts, ins, bufs, out)


def _inputs(meta: dict, inputs: dict, layout: Layout, dtype) -> dict:
    """Per-group inputs as flat arrays of x's dtype: one value (a scalar) or one per group."""
    name = meta["name"]
    ins = {}
    for iname in meta["inputs"]:
        v = inputs.get(iname)
        if v is None:
            raise TypeError(f"{name}: {iname} is required (a scalar or one value per group, shape {layout.group_shape})")
        if isinstance(v, np.ndarray):
            _check_array(iname, v)
            check_same_dtype(meta, iname, v.dtype, dtype)
            check_input_shape(meta, iname, v.shape, layout)
            ins[iname] = v.reshape(1).astype(dtype) if is_scalar_shape(v.shape) else _contig(v).reshape(-1)
        else:
            ins[iname] = np.array([_check_float(iname, v)], dtype=dtype)
    return ins


# ------------------------------------------------------------------ split reduction

@dataclass
class SplitCall:
    """A validated call of a split-reduction function on one part of a batch."""
    meta: dict
    layout: Layout              # O: this part's samples (0 for an empty part)
    dtype: np.dtype
    x: np.ndarray               # C-contiguous, the part's own shape
    params: dict[str, np.ndarray]
    options: dict[str, float]
    inputs: dict[str, np.ndarray]
    stats: np.ndarray | None    # (statistics, groups) float64, in meta["stats"]["train"] order
    count: float | None         # values per group over all parts


def split_layout(meta: dict, x_shape, param_shapes: dict) -> Layout:
    """The layout of one part of a batch (it may hold no samples)."""
    x_shape = tuple(x_shape)
    if len(x_shape) >= 2 and x_shape[0] == 0:
        L = layout_from_shapes(meta, (1, *x_shape[1:]), param_shapes, None)
        return Layout(O=0, G=L.G, Cg=L.Cg, S=L.S, per_sample=L.per_sample, x_shape=x_shape,
                      param_shape=L.param_shape, group_shape=L.group_shape)
    return layout_from_shapes(meta, x_shape, param_shapes, None)


def _by_name(meta: dict, what: str, given, names: list, defaults: dict | None = None) -> dict:
    """A dict by name from a dict or a sequence in spec order (None: empty), with defaults."""
    name = meta["name"]
    if given is None:
        given = {}
    if isinstance(given, (list, tuple)):
        if len(given) != len(names):
            raise TypeError(f"{name}: {what} must be a dict by name or a sequence of {len(names)} "
                            f"({names}), got {len(given)} values")
        given = dict(zip(names, given))
    if not isinstance(given, dict):
        raise TypeError(f"{name}: {what} must be a dict by name or a sequence, got {type(given).__name__}")
    unknown = set(given) - set(names)
    if unknown:
        raise TypeError(f"{name}: unknown {what} {sorted(unknown)}; {what} are {names}")
    out = dict(defaults or {})
    out.update(given)
    return out


def prepare_split(meta: dict, x, params, options=None, inputs=None, stats=None, count=None,
                  need_stats: bool = False, need_count: bool = False) -> SplitCall:
    """Checks for the split-reduction functions (errors name the argument). Parameters are
    a dict by name or a sequence in spec order; options and per-group inputs dicts by name
    (options default as in the spec). A part may be empty; the minimum group size applies
    to ``count``, the size over all parts."""
    name = meta["name"]
    if meta.get("split") is None:
        raise ValueError(f"{name}: the split reduction is for layers whose groups span the batch "
                         f"(layout channels, reduce batch); this one is {meta['layout']}/{meta['reduce']}")
    params = _by_name(meta, "params", params, list(meta["params"]))
    missing = [p for p in meta["params"] if p not in params]
    if missing:
        raise TypeError(f"{name}: params {missing} are required")
    options = _by_name(meta, "options", options, list(meta["options"]),
                       {o: d for o, (d, _, _) in meta["options"].items() if d is not None})
    inputs = _by_name(meta, "inputs", inputs, list(meta["inputs"]))
    x = _check_array("x", x)
    dtype = x.dtype
    _param_dtypes(meta, params, dtype)
    layout = split_layout(meta, x.shape, {p: params[p].shape for p in meta["params"]})
    _param_shapes(meta, params, layout)
    opts = _options(meta, options)
    nst = len(meta["stats"]["train"])
    if stats is not None:
        stats = _check_array("stats", stats)
        if stats.dtype != np.float64 or stats.shape != (nst, layout.n_groups):
            raise ValueError(f"{name}: stats must be float64 of shape ({nst}, {layout.n_groups}) (statistics "
                             f"{meta['stats']['train']}, one row each), got {stats.dtype} {stats.shape}")
    elif need_stats:
        raise TypeError(f"{name}: stats is required (from split_finish)")
    if count is not None:
        n = _check_float("count", count, 1, None)
        need = meta["min_group_size"]["train"]
        if n < need:
            raise ValueError(f"{name}: count={n:g} values per group over all parts; training needs at least {need}")
        count = n
    elif need_count:
        raise TypeError(f"{name}: count is required (values per group over all parts)")
    return SplitCall(meta, layout, dtype, _contig(x), {p: _contig(params[p]) for p in meta["params"]}, opts,
                     _inputs(meta, inputs, layout, dtype), stats, count)


def part_sum(layout: Layout, x: np.ndarray):
    """``_sum``: a part's sum over each group's elements (4-D, keepdims); an operand
    constant along reduced axes (a parameter) counts once per element of the part."""
    axes = layout.reduce_axes

    def total(a):
        return np.add.reduce(np.broadcast_to(a, x.shape), axis=axes, keepdims=True, dtype=np.float64)
    return total


def sums_array(layout: Layout, sums: list) -> np.ndarray:
    out = np.zeros((len(sums), layout.n_groups))
    for k, v in enumerate(sums):
        out[k] = np.broadcast_to(v, layout.stat4).reshape(-1)
    return out


def split_level(meta: dict, level) -> int:
    n = len(meta["split"]["levels"])
    if isinstance(level, (bool, np.bool_)) or not isinstance(level, (int, np.integer)) or not 0 <= level < n:
        raise ValueError(f"{meta['name']}: level must be an int from 0 to {n - 1}, got {level!r}")
    return int(level)


def need_stats(meta: dict, call: SplitCall, level: int) -> None:
    if level > 0 and call.stats is None:
        raise TypeError(f"{meta['name']}: level {level} needs the statistics of the earlier levels: "
                        f"stats= (from split_finish)")


def finish_part(sums, meta: dict, params) -> np.ndarray:
    """An empty part with the groups of ``sums`` (split_finish reads no x): its layout
    and dtype (the parameters', float64 without any)."""
    params = list(params.values()) if isinstance(params, dict) else list(params or [])
    arrays = [p for p in params if isinstance(p, np.ndarray)]
    spanning = [p for p in arrays if p.size > 1 or p.ndim == 1 and p.shape[0] > 1]
    groups = spanning[0].shape[0] if spanning else (np.shape(sums)[1] if np.ndim(sums) == 2 else 0)
    dtype = arrays[0].dtype if arrays else np.float64
    return np.empty((0, groups), dtype=dtype)


def stats_array(meta: dict, call: SplitCall) -> np.ndarray:
    nst = len(meta["stats"]["train"])
    return np.zeros((nst, call.layout.n_groups)) if call.stats is None else call.stats.copy()


def check_dy(meta: dict, dy, call: SplitCall) -> np.ndarray:
    dy = _check_array("dy", dy)
    if dy.dtype != call.dtype or dy.shape != call.x.shape:
        raise ValueError(f"{meta['name']}: dy must have the shape and dtype of x {call.x.shape} {call.dtype}, "
                         f"got {dy.shape} {dy.dtype}")
    return _contig(dy)


def part_param_grad(value, param: np.ndarray) -> np.ndarray:
    """A parameter's gradient over a part, in its shape and dtype (a constant: every entry)."""
    v = np.asarray(value, dtype=np.float64)
    if v.size == 1 and param.size != 1:
        return np.full(param.shape, v.reshape(-1)[0], dtype=param.dtype)
    return v.astype(param.dtype).reshape(param.shape)


def part_input_grad(call: SplitCall, iname: str, per_group) -> np.ndarray:
    v = np.broadcast_to(per_group, call.layout.stat4).reshape(-1)
    if call.inputs[iname].size == 1:
        return np.asarray(v.sum(dtype=np.float64), dtype=call.dtype)
    return v.astype(call.dtype).reshape(call.layout.group_shape)


def check_sums(meta: dict, sums, rows: int, layout: Layout) -> np.ndarray:
    name = meta["name"]
    sums = _check_array("sums", sums)
    if sums.dtype != np.float64 or sums.shape != (rows, layout.n_groups):
        raise ValueError(f"{name}: sums must be float64 of shape ({rows}, {layout.n_groups}), "
                         f"got {sums.dtype} {sums.shape}")
    return _contig(sums)


def _no_overlap(name: str, outputs: dict, inputs: dict) -> None:
    for on, o in outputs.items():
        for iname, i in inputs.items():
            if isinstance(i, np.ndarray) and np.shares_memory(o, i):
                raise ValueError(f"{name}: output {on} overlaps input {iname}; pass a separate array")
    outs = list(outputs.items())
    for k, (an, a) in enumerate(outs):
        for bn, b in outs[k + 1:]:
            if np.shares_memory(a, b):
                raise ValueError(f"{name}: outputs {an} and {bn} overlap")


def check_out(name, out, shape, dtype):
    if out is None:
        return np.empty(shape, dtype=dtype)
    out = _check_array(name, out)
    if out.dtype != dtype or tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} and dtype {dtype}, got {out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be a writeable C-contiguous array")
    return out


@dataclass
class BackwardCall:
    cache: Cache
    dy: np.ndarray
    outs: dict[str, np.ndarray]       # dx (x shape), d<param> (param shape), d<input> (n_groups)


def prepare_backward(meta: dict, dy, cache, out=None) -> BackwardCall:
    name = meta["name"]
    if not isinstance(cache, Cache) or cache.meta["name"] != name:
        raise TypeError(f"{name}: cache must be the second value returned by this layer's forward")
    dy = _check_array("dy", dy)
    if dy.dtype != cache.dtype:
        raise TypeError(f"{name}: dy has dtype {dy.dtype} but the forward ran in {cache.dtype}")
    if tuple(dy.shape) != tuple(cache.layout.x_shape):
        raise ValueError(f"{name}: dy must have the shape of x {cache.layout.x_shape}, got {dy.shape}")
    fields = grad_fields(meta)
    shapes = {"dx": cache.layout.x_shape}
    for p in meta["params"]:
        shapes["d" + p] = () if p in meta.get("scalar_params", ()) else cache.layout.param_shape
    given = {}
    if out is not None:
        if isinstance(out, dict):
            given = dict(out)
        else:
            given = dict(zip(fields, out))
        unknown = set(given) - set(fields)
        if unknown:
            raise ValueError(f"{name}: out has unknown field(s) {sorted(unknown)}; fields are {fields}")
    outs = {}
    for f in fields:
        if f in shapes:
            outs[f] = check_out(f"out.{f}", given.get(f), shapes[f], cache.dtype)
    _no_overlap(name, outs, {"dy": dy, "x": cache.x, **cache.params})
    return BackwardCall(cache, _contig(dy), outs)


# ------------------------------------------------------------------ second order

@dataclass
class SecondCall:
    """A validated call of ``backward_backward`` or ``jvp``: the seeds (cotangents of the
    backward's outputs, or tangents of the forward's inputs; zeros where not given) and
    the outputs."""
    cache: Cache
    dy: np.ndarray | None             # backward_backward only
    seed_x: np.ndarray                # x's shape, C-contiguous
    seed_params: dict[str, np.ndarray]   # flat, like cache.params
    seed_inputs: dict[str, np.ndarray]   # flat, 1 or n_groups values
    outs: dict[str, np.ndarray]


def second_fields(meta) -> tuple[str, ...]:
    """``backward_backward``'s fields: the gradients of L2 = sum(ddx*dx) + sum(dd<p>*d<p>) + ...
    with respect to x, dy, the parameters and the inputs."""
    return ("dx", "ddy", *("d" + p for p in meta["params"]), *("d" + i for i in meta["inputs"]))


def _cache(meta: dict, cache) -> Cache:
    if not isinstance(cache, Cache) or cache.meta["name"] != meta["name"]:
        raise TypeError(f"{meta['name']}: cache must be the second value returned by this layer's forward")
    return cache


def _like_x(meta: dict, what: str, v, cache: Cache) -> np.ndarray:
    if v is None:
        return np.zeros(cache.layout.x_shape, dtype=cache.dtype)
    v = _check_array(what, v)
    if v.dtype != cache.dtype:
        raise TypeError(f"{meta['name']}: {what} has dtype {v.dtype} but the forward ran in {cache.dtype}")
    if tuple(v.shape) != tuple(cache.layout.x_shape):
        raise ValueError(f"{meta['name']}: {what} must have the shape of x {cache.layout.x_shape}, got {v.shape}")
    return _contig(v)


def _seeds(meta: dict, what: str, params, inputs, cache: Cache) -> tuple[dict, dict]:
    """Seeds of the parameters (dict by name or sequence in spec order; None entries are
    zeros) and of the per-group inputs (dict by name)."""
    name = meta["name"]
    given = _by_name(meta, what + "params", params, meta["params"])
    sp = {}
    for pn in meta["params"]:
        ref = cache.params[pn]
        v = given.get(pn)
        if v is None:
            sp[pn] = np.zeros(ref.shape, dtype=cache.dtype)
            continue
        if not isinstance(v, np.ndarray):
            v = np.asarray(_check_float(f"{what}params.{pn}", v), dtype=cache.dtype)
        a = _check_array(f"{what}params.{pn}", v)
        if a.dtype != cache.dtype:
            raise TypeError(f"{name}: {what}params.{pn} has dtype {a.dtype} but the forward ran in {cache.dtype}")
        shape = () if pn in meta.get("scalar_params", ()) else cache.layout.param_shape
        if a.size != ref.size or (a.ndim and tuple(a.shape) != tuple(shape) and pn not in meta.get("scalar_params", ())):
            raise ValueError(f"{name}: {what}params.{pn} must have the shape of {pn} {shape}, got {a.shape}")
        sp[pn] = _contig(a).reshape(-1)
    gi = _by_name(meta, what + "inputs", inputs, meta["inputs"])
    si = _inputs(meta, {i: (0.0 if gi.get(i) is None else gi[i]) for i in meta["inputs"]}, cache.layout, cache.dtype)
    return sp, si


def prepare_backward_backward(meta: dict, dy, cache, ddx=None, ddparams=None, ddinputs=None,
                              out=None) -> SecondCall:
    name = meta["name"]
    cache = _cache(meta, cache)
    dy = _like_x(meta, "dy", dy if dy is not None else _missing(name, "dy"), cache)
    seed_x = _like_x(meta, "ddx", ddx, cache)
    sp, si = _seeds(meta, "dd", ddparams, ddinputs, cache)
    fields = second_fields(meta)
    shapes = {"dx": cache.layout.x_shape, "ddy": cache.layout.x_shape}
    for p in meta["params"]:
        shapes["d" + p] = () if p in meta.get("scalar_params", ()) else cache.layout.param_shape
    given = {}
    if out is not None:
        given = dict(out) if isinstance(out, dict) else dict(zip(fields, out))
        unknown = set(given) - set(fields)
        if unknown:
            raise ValueError(f"{name}: out has unknown field(s) {sorted(unknown)}; fields are {fields}")
    outs = {f: check_out(f"out.{f}", given.get(f), shapes[f], cache.dtype) for f in fields if f in shapes}
    _no_overlap(name, outs, {"dy": dy, "x": cache.x, "ddx": seed_x, **cache.params})
    return SecondCall(cache, dy, seed_x, sp, si, outs)


def prepare_jvp(meta: dict, cache, tx=None, tparams=None, tinputs=None, out=None) -> SecondCall:
    cache = _cache(meta, cache)
    seed_x = _like_x(meta, "tx", tx, cache)
    sp, si = _seeds(meta, "t", tparams, tinputs, cache)
    ty = check_out("out", out, cache.layout.x_shape, cache.dtype)
    _no_overlap(meta["name"], {"out": ty}, {"x": cache.x, "tx": seed_x, **cache.params})
    return SecondCall(cache, None, seed_x, sp, si, {"ty": ty})


def _missing(name: str, what: str):
    raise TypeError(f"{name}: {what} is required")


def grad_fields(meta) -> tuple[str, ...]:
    return ("dx", *("d" + p for p in meta["params"]), *("d" + i for i in meta["inputs"]))


def finish_input_grad(cache: Cache, iname: str, per_group: np.ndarray) -> np.ndarray:
    """Per-group input gradients, summed when the input was a scalar."""
    if cache.inputs[iname].size == 1:
        return np.asarray(per_group.sum(dtype=np.float64), dtype=cache.dtype)
    return per_group.astype(cache.dtype, copy=False).reshape(cache.layout.group_shape)




def group_view(values: np.ndarray, layout: Layout) -> np.ndarray:
    """A per-group input (1 value or n_groups values) as a broadcastable 4-D array."""
    return values.reshape(1, 1, 1, 1) if values.size == 1 else values.reshape(layout.stat4)
