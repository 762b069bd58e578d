"""Second-order calls: ``backward_backward`` (the gradients of a loss on the backward's
outputs) and ``jvp`` (forward mode) of the generated NumPy modules and C bindings,
checked against the forward's cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from derivgen.runtime.abi import grad_tensor_names
from derivgen.runtime.base import (
    Cache,
    _by_name,
    _check_array,
    _check_cache,
    _contig,
    _grad_shapes,
    _input_grad_shapes,
    _inputs,
    _no_overlap,
    _out_by_field,
    check_out,
    named_errors,
)
from derivgen.runtime.meta import LayerMeta, MetaLike, layer_meta
from derivgen.runtime.tensors import check_cotangents, extra_outputs, full_view, seeds_by_name, tensor_shape
from derivgen.runtime.validate import check_float


@dataclass
class SecondCall:
    """A validated call of ``backward_backward`` or ``jvp``: the seeds (cotangents of the
    backward's outputs, or tangents of the forward's inputs; zeros where not given) and
    the outputs."""

    cache: Cache
    dy: np.ndarray | None  # backward_backward only
    seed_x: np.ndarray  # x's shape, C-contiguous
    seed_params: dict[str, np.ndarray]  # flat, like cache.params
    seed_inputs: dict[str, np.ndarray]  # flat, 1 or n_groups values
    outs: dict[str, np.ndarray]
    # tensor inputs and outputs beside y: the seeds of the tensors with a gradient (x's shape,
    # C order, broadcast ones written out), and (backward_backward) the first-order
    # cotangents of the outputs beside y (zeros where not given)
    seed_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    cotangents: dict[str, np.ndarray] = field(default_factory=dict)


def second_fields(meta: MetaLike) -> tuple[str, ...]:
    """``backward_backward``'s fields: the gradients of L2 = sum(ddx*dx) + sum(dd<t>*d<t>) +
    sum(dd<p>*d<p>) + ... with respect to x, dy, the cotangents d<o> of the outputs beside y
    (``dd<o>``), the tensor inputs with a gradient, the parameters and the inputs."""
    meta = layer_meta(meta)
    return (
        "dx",
        "ddy",
        *("dd" + o for o in meta.outputs),
        *("d" + t for t in grad_tensor_names(meta)),
        *("d" + p for p in meta.params),
        *("d" + i for i in meta.inputs),
    )


def _tensor_seeds(meta: LayerMeta, label: str, given: Any, cache: Cache) -> dict[str, np.ndarray]:
    """The seeds of the tensor inputs with a gradient (a dict by name; None entries and names
    not given are zeros), each of the tensor's declared shape and the forward's dtype, returned
    at x's shape in C order."""
    names = grad_tensor_names(meta)
    given = seeds_by_name(meta, label, given, names)
    out = {}
    for t in names:
        kind, v = meta.tensors[t][0], given.get(t)
        want = tensor_shape(meta, kind, cache.layout)
        if v is None:
            out[t] = np.zeros(cache.layout.x_shape, dtype=cache.dtype)
            continue
        v = _check_array(f"{label}.{t}", v)
        if v.dtype != cache.dtype:
            raise TypeError(f"{meta.name}: {label}.{t} has dtype {v.dtype} but the forward ran in {cache.dtype}")
        if tuple(v.shape) != want:
            raise ValueError(f"{meta.name}: {label}.{t} must have the shape of {t} {want}, got {v.shape}")
        out[t] = full_view(meta, kind, v, cache.layout)
    return out


def _second_shapes(meta: LayerMeta, cache: Cache, data: tuple[str, ...]) -> dict[str, tuple]:
    """The shapes of backward_backward's outputs."""
    shapes = {**_grad_shapes(meta, cache.layout, data), **_input_grad_shapes(meta, cache.layout, cache.inputs)}
    for o in meta.outputs:
        shapes["dd" + o] = cache.layout.x_shape
    for t in grad_tensor_names(meta):
        shapes["d" + t] = tensor_shape(meta, meta.tensors[t][0], cache.layout)
    return shapes


def _like_x(meta: LayerMeta, what: str, v: np.ndarray | None, cache: Cache) -> np.ndarray:
    """An array of x's shape and the forward's dtype, in C order (None: zeros)."""
    if v is None:
        return np.zeros(cache.layout.x_shape, dtype=cache.dtype)
    v = _check_array(what, v)
    if v.dtype != cache.dtype:
        raise TypeError(f"{meta.name}: {what} has dtype {v.dtype} but the forward ran in {cache.dtype}")
    if tuple(v.shape) != tuple(cache.layout.x_shape):
        raise ValueError(f"{meta.name}: {what} must have the shape of x {cache.layout.x_shape}, got {v.shape}")
    return _contig(v)


def _param_seed(meta: LayerMeta, label: str, pname: str, v: Any, cache: Cache) -> np.ndarray:
    """One parameter's seed, flat like ``cache.params`` (None: zeros; a number: a scalar)."""
    name, ref = meta.name, cache.params[pname]
    if v is None:
        return np.zeros(ref.shape, dtype=cache.dtype)
    if not isinstance(v, np.ndarray):
        v = np.asarray(check_float(label, v), dtype=cache.dtype)
    a = _check_array(label, v)
    if a.dtype != cache.dtype:
        raise TypeError(f"{name}: {label} has dtype {a.dtype} but the forward ran in {cache.dtype}")
    scalar = pname in meta.scalar_params
    shape = () if scalar else cache.layout.param_shape
    if a.size != ref.size or (a.ndim and tuple(a.shape) != tuple(shape) and not scalar):
        raise ValueError(f"{name}: {label} must have the shape of {pname} {shape}, got {a.shape}")
    return _contig(a).reshape(-1)


def _seeds(meta: LayerMeta, what: str, params: Any, inputs: Any, cache: Cache) -> tuple[dict, dict]:
    """Seeds of the parameters (dict by name or sequence in spec order; None entries are
    zeros) and of the per-group inputs (dict by name)."""
    given = _by_name(meta, what + "params", params, meta.params)
    sp = {pn: _param_seed(meta, f"{what}params.{pn}", pn, given.get(pn), cache) for pn in meta.params}
    gi = _by_name(meta, what + "inputs", inputs, meta.inputs)
    si = _inputs(meta, {i: (0.0 if gi.get(i) is None else gi[i]) for i in meta.inputs}, cache.layout, cache.dtype)
    return sp, si


@named_errors
def prepare_backward_backward(
    meta: MetaLike,
    dy: np.ndarray,
    cache: Cache,
    ddx: np.ndarray | None = None,
    ddparams: Mapping[str, Any] | Sequence[Any] | None = None,
    ddinputs: Mapping[str, Any] | None = None,
    out: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
    ddtensors: Mapping[str, Any] | None = None,
    cotangents: Mapping[str, Any] | None = None,
) -> SecondCall:
    """Checks for ``backward_backward`` (errors name the argument); ``ddtensors`` are the seeds
    of the tensor inputs' gradients by name, ``cotangents`` the first-order cotangents of the
    outputs beside y by name (None: zero)."""
    meta = layer_meta(meta)
    name = meta.name
    cache = _check_cache(meta, cache)
    if dy is None:
        raise TypeError(f"{name}: dy is required")
    dy = _like_x(meta, "dy", dy, cache)
    seed_x = _like_x(meta, "ddx", ddx, cache)
    sp, si = _seeds(meta, "dd", ddparams, ddinputs, cache)
    st = _tensor_seeds(meta, "ddtensors", ddtensors, cache)
    cots = check_cotangents(meta, cotangents or {}, cache.layout, cache.dtype)
    fields = second_fields(meta)
    shapes = _second_shapes(meta, cache, ("dx", "ddy"))
    given = _out_by_field(name, out, fields)
    outs = {f: check_out(f"out.{f}", given.get(f), shapes[f], cache.dtype) for f in fields if f in shapes}
    _no_overlap(
        name,
        outs,
        {
            "dy": dy,
            "x": cache.x,
            "ddx": seed_x,
            **cache.params,
            **getattr(cache, "tensors", {}),
            **{"dd" + t: v for t, v in st.items()},
            **{"d" + o: v for o, v in cots.items()},
        },
    )
    return SecondCall(cache, dy, seed_x, sp, si, outs, st, cots)


@named_errors
def prepare_jvp(
    meta: MetaLike,
    cache: Cache,
    tx: np.ndarray | None = None,
    tparams: Mapping[str, Any] | Sequence[Any] | None = None,
    tinputs: Mapping[str, Any] | None = None,
    out: np.ndarray | None = None,
    ttensors: Mapping[str, Any] | None = None,
    outs: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
) -> SecondCall:
    """Checks for ``jvp`` (errors name the argument); ``ttensors`` are the tangents of the
    tensor inputs with a gradient by name, ``outs`` preallocated tangents of the outputs beside
    y (as the forward's ``outs``)."""
    meta = layer_meta(meta)
    cache = _check_cache(meta, cache)
    seed_x = _like_x(meta, "tx", tx, cache)
    sp, si = _seeds(meta, "t", tparams, tinputs, cache)
    st = _tensor_seeds(meta, "ttensors", ttensors, cache)
    ty = check_out("out", out, cache.layout.x_shape, cache.dtype)
    results = {"ty": ty, **{"t" + o: a for o, a in extra_outputs(meta, cache.layout, cache.dtype, outs).items()}}
    _no_overlap(
        meta.name,
        results,
        {
            "x": cache.x,
            "tx": seed_x,
            **cache.params,
            **getattr(cache, "tensors", {}),
            **{"t" + t: v for t, v in st.items()},
        },
    )
    return SecondCall(cache, None, seed_x, sp, si, results, st)
