"""Tensor inputs beside x and outputs beside y: their shapes, checks and gradients.

A spec's ``[tensors]`` are element values of x's shape, or broadcast over some of its axes
(``_META["tensors"]``: name -> (shape, gradient, mask)):

==========  =========================  ================================================
shape       layout                     the tensor's shape (for x's)
==========  =========================  ================================================
``x``       any                        x's own
``sample``  trailing, x (B, ..., *D)   (B, *D): one value per sample and feature
``sample``  channels, x (N, C, *S)     (N, C): one value per (sample, channel)
``position`` channels, x (N, C, *S)    (N, 1, *S): one value per (sample, position)
==========  =========================  ================================================

A broadcast tensor's gradient is summed over the axes it is broadcast over, as autograd
sums a broadcast operand's. The C kernels read the ``sample`` and ``position`` tensors at
their own shape (:func:`native`: a trailing layout's element of sample b and feature d at
``b * D + d``, b from the group and the kernels' ``Samples`` argument, :func:`samples`; a
channel layout's of sample n and channel c at ``n * C + c``, of sample n and position s at
``n * S + s``), and the backward kernel sums the ``sample`` ones' gradients itself
(:func:`sums_own`); they read every other tensor at x's shape (written out once per call).
The element gradients of a tensor whose sum the kernel does not take, written at x's
shape, are summed here (:func:`finish_tensor_grad`). No SymPy here (stage 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from derivgen.runtime.abi import native, sums_own
from derivgen.runtime.base import _check_array, _contig, aligned_empty, check_out
from derivgen.runtime.meta import MetaLike, layer_meta
from derivgen.runtime.validate import Layout


def tensor_shape(meta: MetaLike, kind: str, layout: Layout) -> tuple[int, ...]:
    """The shape a tensor input declared ``kind`` has for x of ``layout``."""
    meta = layer_meta(meta)
    xs = tuple(layout.x_shape)
    if kind == "x":
        return xs
    if meta.layout == "trailing":  # (B, *normalized)
        k = len(layout.param_shape)
        return (xs[0], *xs[len(xs) - k :]) if len(xs) > k else xs
    if kind == "sample":
        return xs[:2]
    return (xs[0], 1, *xs[2:])  # position


def samples(meta: MetaLike, layout: Layout) -> int:
    """The kernels' ``Samples`` argument: how many samples a native tensor holds (x.shape[0]
    for a trailing layout with axes before the normalized ones, else 1)."""
    xs, k = tuple(layout.x_shape), len(layout.param_shape)
    return xs[0] if len(xs) > k else 1


def kernel_view(meta: MetaLike, kind: str, full: np.ndarray, layout: Layout) -> np.ndarray:
    """A tensor input as the C kernels read it, from its array at x's shape (:func:`full_view`):
    itself, or a :func:`native` tensor's own values, C-contiguous at its declared shape."""
    meta = layer_meta(meta)
    if not native(meta, kind):
        return full
    shape = tensor_shape(meta, kind, layout)
    if full.size == 0:
        return np.zeros(shape, full.dtype)
    axes = broadcast_axes(meta, kind, layout)
    return np.ascontiguousarray(full[tuple(0 if a in axes else slice(None) for a in range(full.ndim))]).reshape(shape)


def broadcast_axes(meta: MetaLike, kind: str, layout: Layout) -> tuple[int, ...]:
    """The axes of x a tensor declared ``kind`` is broadcast over (its gradient is summed over them)."""
    meta = layer_meta(meta)
    nd = len(layout.x_shape)
    if kind == "x":
        return ()
    if meta.layout == "trailing":
        k = len(layout.param_shape)
        return tuple(range(1, nd - k)) if nd > k else ()
    if kind == "sample":
        return tuple(range(2, nd))
    return (1,)


def full_view(meta: MetaLike, kind: str, t: np.ndarray, layout: Layout, copy: bool = True) -> np.ndarray:
    """A tensor of its declared shape as a C-contiguous array of x's shape (``copy=False``: a
    read-only broadcast view of it, stride 0 along the axes it is broadcast over)."""
    meta = layer_meta(meta)
    if kind == "x":
        return _contig(t)
    shape = list(layout.x_shape)
    for a in broadcast_axes(meta, kind, layout):
        shape[a] = 1
    view = np.broadcast_to(t.reshape(shape), layout.x_shape)
    return np.ascontiguousarray(view) if copy else view


def check_tensors(meta: MetaLike, tensors: Mapping[str, Any], layout: Layout, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Every tensor input checked (an array of x's dtype, of its declared shape; a mask 0 or 1
    everywhere), as arrays of x's shape: C-contiguous, or a broadcast view of a :func:`native`
    one (the C kernels read its own values, :func:`kernel_view`: no x-sized copy); errors name
    the argument."""
    meta = layer_meta(meta)
    name, out = meta.name, {}
    for tname, (kind, _grad, mask) in meta.tensors.items():
        t = tensors.get(tname)
        if t is None:
            raise TypeError(f"{name}: {tname} is required (a tensor input)")
        t = _check_array(tname, t)
        if t.dtype != dtype:
            raise TypeError(f"{name}: {tname} has dtype {t.dtype} but x has {dtype}")
        want = tensor_shape(meta, kind, layout)
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name}: {tname} must have shape {want} ({kind!r} for x of shape {layout.x_shape}), got {t.shape}"
            )
        if mask and t.size and not np.all((t == 0) | (t == 1)):
            raise ValueError(f"{name}: {tname} is a mask: every value must be 0 or 1")
        out[tname] = full_view(meta, kind, t, layout, copy=not native(meta, kind))
    return out


def extra_outputs(meta: MetaLike, layout: Layout, dtype: np.dtype, given: Any) -> dict[str, np.ndarray]:
    """The arrays the outputs beside y are written to (x's shape and dtype): ``given`` is None,
    or a sequence or dict by name of preallocated ones (None where not given)."""
    meta = layer_meta(meta)
    names = meta.outputs
    if given is None:
        given = {}
    elif not isinstance(given, Mapping):
        given = list(given)
        if len(given) != len(names):
            raise ValueError(f"{meta.name}: outs must have {len(names)} arrays ({', '.join(names)}), got {len(given)}")
        given = dict(zip(names, given))
    extra = set(given) - set(names)
    if extra:
        raise ValueError(f"{meta.name}: outs has unknown output(s) {', '.join(sorted(extra))}")
    return {o: check_out(f"outs.{o}", given.get(o), layout.x_shape, dtype) for o in names}


def check_cotangents(meta: MetaLike, cots: Mapping[str, Any], layout: Layout, dtype: np.dtype) -> dict:
    """The cotangents of the outputs beside y (``d<name>``): arrays of x's shape and dtype; one
    not given (None) is zero, as autograd passes for an output that no loss reads."""
    meta = layer_meta(meta)
    out = {}
    for o in meta.outputs:
        c = cots.get(o)
        if c is not None:
            c = _check_array("d" + o, c)
            if c.dtype != dtype:
                raise TypeError(f"{meta.name}: d{o} has dtype {c.dtype} but the forward ran in {dtype}")
            if tuple(c.shape) != tuple(layout.x_shape):
                raise ValueError(f"{meta.name}: d{o} must have the shape of x {layout.x_shape}, got {c.shape}")
            c = _contig(c)
        else:
            c = np.zeros(layout.x_shape, dtype=dtype)
        out[o] = c
    return out


def grad_buffer(
    meta: MetaLike,
    tname: str,
    layout: Layout,
    out: np.ndarray,
    dtype: np.dtype | type = np.float64,
    summed: bool = False,
) -> np.ndarray:
    """Where a tensor's element gradients are written: its output itself (a tensor of x's
    shape, or with ``summed`` -- the C backward kernel's -- one whose sums the kernel takes,
    :func:`sums_own`), else an array of x's shape and ``dtype`` that :func:`finish_tensor_grad` sums."""
    meta = layer_meta(meta)
    kind = meta.tensors[tname][0]
    return out if kind == "x" or (summed and sums_own(meta, kind)) else aligned_empty(layout.x_shape, dtype)


def finish_tensor_grad(meta: MetaLike, tname: str, layout: Layout, buf: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A tensor's gradient: the element gradients ``buf`` summed over the axes it is broadcast
    over (nothing to do for one of x's shape, or where ``buf`` is ``out``: the kernel summed
    them), stored in ``out``."""
    meta = layer_meta(meta)
    kind = meta.tensors[tname][0]
    if kind == "x" or buf is out:
        return out
    axes = broadcast_axes(meta, kind, layout)
    total = buf.sum(axis=axes, keepdims=True, dtype=np.float64) if axes else buf
    out[...] = total.reshape(out.shape)
    return out


def seeds_by_name(meta: MetaLike, label: str, given: Any, names: list[str]) -> Mapping[str, Any]:
    """Seeds of the tensor inputs with a gradient (``names``) given as a dict by name (None:
    none), checked: ``label`` names the argument in the errors (a non-dict, an unknown name)."""
    meta = layer_meta(meta)
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise TypeError(f"{meta.name}: {label} must be a dict by tensor name ({', '.join(names)})")
    unknown = set(given) - set(names)
    if unknown:
        raise ValueError(
            f"{meta.name}: {label} has {', '.join(sorted(map(str, unknown)))}, which is not a tensor input with a "
            f"gradient ({', '.join(names) or 'none'})"
        )
    return given
