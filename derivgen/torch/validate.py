"""The argument contract of :mod:`derivgen.runtime.validate` on tensors: the first call with a
given signature is checked in full, with errors naming the argument (see
:mod:`derivgen.torch.plan`). float32/float64 tensors go through the NumPy runtime's checks
(``derivgen.runtime.prepare_forward``, on the tensors' memory); bfloat16 and the
channels-last view, which NumPy lacks, through the same checks on shapes and dtypes."""

from __future__ import annotations

import torch

from derivgen import runtime as rt
from derivgen.runtime.abi import reads_buffers
from derivgen.runtime.meta import LayerMeta
from derivgen.runtime.validate import (
    check_call_shapes,
    check_same_dtype,
)
from derivgen.torch.tensors import check_tensor, numpy_view


def _tensor_names(meta: LayerMeta, mode: str) -> list[str]:
    """The spec names of a forward call's tensors (buffers where the mode's statistics read them)."""
    return ["x", *meta.params, *meta.inputs, *(meta.buffers if reads_buffers(meta, mode) else ())]


def check_on_tensors(meta: LayerMeta, mode: str, a: dict, any_device: bool = False) -> rt.Layout:
    """The forward's argument contract checked on tensors by spec name (shapes and dtypes
    only: it holds for tensors under torch.func transforms and on any device); their
    layout. ``any_device``: the device-agnostic path's dtypes and devices (one device for all)."""
    x = a["x"]
    for k in _tensor_names(meta, mode):
        check_tensor(meta.name, k, a[k], any_device)
        check_same_dtype(meta, k, a[k].dtype, x.dtype, "; use one dtype for all")
        _check_device(meta, k, a[k], x)
    return check_call_shapes(meta, mode, a, a["num_groups"])


def _check_device(meta: LayerMeta, k: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """Every tensor of a call on x's device (a meta-device parameter beside a CPU x, say)."""
    if t.device != x.device:
        raise ValueError(f"{meta.name}: {k} is on {t.device} but x is on {x.device}; use one device for all")


def check_through_numpy(meta: LayerMeta, mode: str, a: dict) -> rt.Layout:
    """The forward's argument contract checked by the NumPy runtime on the tensors' memory
    (float32/float64, NCHW); their layout."""
    for k in _tensor_names(meta, mode):
        check_tensor(meta.name, k, a[k])
        _check_device(meta, k, a[k], a["x"])
    call = rt.prepare_forward(
        meta,
        numpy_view(a["x"]),
        {p: numpy_view(a[p]) for p in meta.params},
        {o: a[o] for o in meta.options},
        {i: numpy_view(a[i]) for i in meta.inputs},
        {b: (numpy_view(a[b]) if reads_buffers(meta, mode) else None) for b in meta.buffers},
        training=mode == "train",
        num_groups=a["num_groups"] if meta.reduce == "group" else None,
    )
    return call.layout


def check_forward(meta: LayerMeta, mode: str, a: dict, nhwc: bool) -> rt.Layout:
    """The forward's argument contract, through NumPy where it can be (the same messages
    as NumPy callers get); the layout of x."""
    x = a["x"]
    if nhwc or (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16):
        return check_on_tensors(meta, mode, a)
    return check_through_numpy(meta, mode, a)


def check_backward_extras(meta: LayerMeta, mode: str, a: dict, n_groups: int) -> None:
    """What the backward takes beyond the forward's arguments: dy like x, and the
    statistics as the forward returns them."""
    name = meta.name
    check_tensor(name, "dy", a["dy"])
    if a["dy"].dtype != a["x"].dtype or tuple(a["dy"].shape) != tuple(a["x"].shape):
        raise ValueError(
            f"{name}: dy must have the shape and dtype of x {tuple(a['x'].shape)} "
            f"{a['x'].dtype}, got {tuple(a['dy'].shape)} {a['dy'].dtype}"
        )
    for s in meta.stats[mode]:
        t = a[s]
        if t.dtype != torch.float64 or t.numel() != n_groups:
            raise ValueError(
                f"{name}: statistic {s} must be float64 with one value per group "
                f"({n_groups}), as the forward returns them; got {t.dtype} {tuple(t.shape)}"
            )


def check_tensor_inputs(meta: LayerMeta, a: dict, L: rt.Layout, any_device: bool = False, values: bool = True) -> None:
    """The tensor inputs beside x (a multi layer's), by spec name in ``a``: tensors of x's
    dtype and device, each of its declared shape (:func:`derivgen.runtime.tensor_shape`); a
    mask 0 or 1 everywhere (``values``: not checked where the values cannot be read, under
    torch.func transforms). Errors name the argument, as the NumPy runtime's."""
    name, x = meta.name, a["x"]
    for t, (kind, _grad, mask) in meta.tensors.items():
        v = a.get(t)
        if v is None:
            raise TypeError(f"{name}: {t} is required (a tensor input)")
        check_tensor(name, t, v, any_device)
        if v.dtype != x.dtype:
            raise TypeError(f"{name}: {t} has dtype {v.dtype} but x has {x.dtype}")
        _check_device(meta, t, v, x)
        want = rt.tensor_shape(meta, kind, L)
        if tuple(v.shape) != tuple(want):
            raise ValueError(
                f"{name}: {t} must have shape {tuple(want)} ({kind!r} for x of shape {tuple(L.x_shape)}), "
                f"got {tuple(v.shape)}"
            )
        if mask and values and v.numel() and not bool(((v == 0) | (v == 1)).all()):
            raise ValueError(f"{name}: {t} is a mask: every value must be 0 or 1")


def check_cotangent(meta: LayerMeta, what: str, v: object, x: torch.Tensor) -> None:
    """A cotangent of y or of an output beside y: a tensor of x's shape and dtype."""
    name = meta.name
    check_tensor(name, what, v, any_device=True)
    if v.dtype != x.dtype or tuple(v.shape) != tuple(x.shape):
        raise ValueError(
            f"{name}: {what} must have the shape and dtype of x {tuple(x.shape)} "
            f"{x.dtype}, got {tuple(v.shape)} {v.dtype}"
        )
