"""The generated Triton kernels launched on torch tensors, with the NumPy and C modules'
calling convention: what the public functions of ``generated/triton/<layer>.py``
(``derivgen.load(spec, backend="triton")``) and the CUDA implementation of the
``derivgen::`` operators (:mod:`derivgen.triton.ops`) call.

``forward(x, params..., *, options..., out=None) -> (y, cache)`` runs a mode's forward
kernel (statistics in float32 whatever x's dtype, running buffers updated in place);
``backward(dy, cache) -> Grads`` its backward kernel and, for the parameter gradients,
:func:`derivgen.triton._target.sum_rows_kernel` over the programs' partial sums;
``backward_backward`` and ``jvp`` run the PyTorch closed forms of the same spec on the
same device (``derivgen.load(spec, backend="torch")``).

A layer with tensor inputs beside x (``LayerMeta.tensors``: fused residual adds, gates,
modulation, masks) takes them after x, in spec order; the kernels read each at x's element
offsets, so a broadcast one (``sample``, ``position``: :mod:`derivgen.runtime.tensors`) is
written out at x's shape and strides first (:func:`at_x`), and its element gradients, written
at x's shape in float32, are summed over the axes it is broadcast over afterwards
(:func:`finish_tensor_grad`). A layer with outputs beside y (``LayerMeta.outputs``) returns
``((y, *outputs), cache)`` and its backward takes their cotangents ``d<output>=`` (None:
zero). Their ``backward_backward`` takes the seeds of the tensors' gradients ``ddtensors=`` (by
name, of each tensor's declared shape) and the first-order cotangents ``d<output>=``, and
their ``jvp`` the tangents ``ttensors=`` and returns ``(ty, t<output>...)``, by the PyTorch
closed forms as for every layer.

A group is a matrix of A rows and B columns of x (:func:`geometry`): a row of x for a
trailing layout (A = 1); a sample's channel (instance), a sample's group of channels
(A = the channels of a group), a channel over the batch (A = the samples) or a sample's
channels at one position (A = 1, B = the channels) for the channel layouts, whose x may be channels first or channels last (its strides are
passed as they are).
"""

from __future__ import annotations

from typing import Any

import torch

from derivgen import runtime as rt
from derivgen.api import load
from derivgen.runtime.abi import reads_buffers, tensor_names
from derivgen.runtime.meta import LayerMeta
from derivgen.runtime.tensors import tensor_shape
from derivgen.runtime.validate import (
    check_call_shapes,
    check_same_dtype,
)
from derivgen.triton.launch import DTYPES, Layer, dense, run_backward, run_forward


class Cache(rt.StatisticsView):
    """What the forward keeps for the backward: the mode, layout, x as the kernels read it,
    the tensor inputs beside x (as given), parameters, options, per-group inputs, buffers the
    statistics read (copies), and the statistics (float32, one value per group); as attributes (``cache.mean``) the
    statistics in the layer's group shape and x's dtype."""

    def __init__(self, meta: LayerMeta, mode: str, layout: rt.Layout, x: torch.Tensor, **kw: Any) -> None:
        self.meta, self.mode, self.layout, self.x = meta, mode, layout, x
        self.params: dict = kw["params"]
        self.stats: dict = kw["stats"]
        self.options: dict = kw["options"]
        self.inputs: dict = kw["inputs"]
        self.buffers: dict = kw["buffers"]
        self.num_groups: int | None = kw["num_groups"]
        self.user_x: torch.Tensor = kw["user_x"]
        self.tensors: dict = kw.get("tensors", {})  # the tensor inputs beside x, as given (declared shapes)

    def __repr__(self) -> str:
        return f"Cache({self.meta.name}, {self.mode}, x {tuple(self.x.shape)} {self.x.dtype}, Triton)"


# ---- checks


def _check_tensor(name: str, what: str, t: Any) -> None:
    """``t`` is a tensor of a dtype the kernels take."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(
            f"{name}: {what} has dtype {t.dtype}; the Triton kernels take float32, float16 and bfloat16 "
            "(float64: derivgen.load(spec, backend='torch'))"
        )


def check_call(meta: LayerMeta, mode: str, a: dict) -> rt.Layout:
    """The forward's argument contract on tensors by spec name (errors name the argument);
    the layout of x. The tensor inputs beside x have their declared shapes, and a mask's
    values are 0 or 1."""
    name, x = meta.name, a["x"]
    for t in tensor_names(meta):
        if a.get(t) is None:
            raise TypeError(f"{name}: {t} is required (a tensor input)")
    tensors = ["x", *tensor_names(meta), *meta.params, *meta.inputs]
    tensors += meta.buffers if reads_buffers(meta, mode) else []
    for k in tensors:
        _check_tensor(name, k, a[k])
        check_same_dtype(meta, k, a[k].dtype, x.dtype, "; use one dtype for all")
        if a[k].device != x.device:
            raise ValueError(f"{name}: {k} is on {a[k].device} but x is on {x.device}")
    L = check_call_shapes(meta, mode, a, a.get("num_groups"))
    for t, (kind, _, mask) in meta.tensors.items():
        want, got = tensor_shape(meta, kind, L), tuple(a[t].shape)
        if got != want:
            raise ValueError(f"{name}: {t} must have shape {want} ({kind!r} for x of shape {L.x_shape}), got {got}")
        if mask and a[t].numel() and not bool(((a[t] == 0) | (a[t] == 1)).all()):
            raise ValueError(f"{name}: {t} is a mask: every value must be 0 or 1")
    return L


# ---- the calling convention


def _tensor(v: Any, x: torch.Tensor) -> torch.Tensor:
    """A per-group input given as a number: a tensor of x's dtype on x's device."""
    return v if isinstance(v, torch.Tensor) else torch.as_tensor(float(v), dtype=x.dtype, device=x.device)


def _mode(meta: LayerMeta, training: Any) -> str:
    if not isinstance(training, bool):
        raise TypeError(f"{meta.name}: training must be a bool, got {type(training).__name__}")
    return "train" if training or "eval" not in meta.modes else "eval"


def forward(
    layer: Layer,
    x: torch.Tensor,
    params: dict,
    options: dict,
    inputs: dict,
    buffers: dict,
    training: bool = True,
    num_groups: int | None = None,
    out: torch.Tensor | None = None,
    tensors: dict | None = None,
    outs: Any = None,
) -> tuple[Any, Cache]:
    """``(y, cache)`` by the mode's forward kernel; running buffers given in training mode
    are updated in place. ``tensors``: the tensor inputs beside x by name; a layer with
    outputs beside y returns ``((y, *outputs), cache)``, written into ``outs`` (a sequence
    or a dict by name of preallocated tensors) where given."""
    meta = layer.meta
    name = meta.name
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    mode = _mode(meta, training)
    params = {p: _tensor(v, x) if p in meta.scalar_params else v for p, v in params.items()}
    ins = {i: _tensor(v, x) for i, v in inputs.items()}
    a = {"x": x, **params, **ins, **options, "num_groups": num_groups or 0}
    a.update({t: v for t, v in (tensors or {}).items()})
    if reads_buffers(meta, mode):
        missing = [b for b in meta.buffers if buffers.get(b) is None]
        if missing:
            raise ValueError(f"{name}: {mode} mode needs {missing[0]} (its statistics read it)")
    a.update({b: v for b, v in buffers.items() if v is not None})
    L = check_call(meta, mode, a)
    given = _outs_by_name(meta, outs)
    kept = {b: buffers[b].detach().clone() for b in meta.buffers} if reads_buffers(meta, mode) else {}
    with torch.no_grad():
        ys, stats = run_forward(layer, mode, a, L, update=mode == "train" and x.numel() > 0)
    names = meta.outputs
    got = ys if names else (ys,)
    res = []
    for f, g, o in zip(("y", *names), got, (out, *(given.get(n) for n in names))):
        if o is not None:
            what = "out" if f == "y" else f"outs.{f}"
            if not isinstance(o, torch.Tensor) or o.shape != g.shape or o.dtype != g.dtype:
                raise ValueError(f"{what} must be a tensor of shape {tuple(g.shape)} and dtype {g.dtype}")
            g = o.copy_(g)
        res.append(g)
    cache = Cache(
        meta,
        mode,
        L,
        dense(x).detach(),
        params={p: params[p] for p in meta.params},
        stats=stats,
        options={o: float(options[o]) for o in meta.options},
        inputs=ins,
        buffers=kept,
        num_groups=num_groups,
        user_x=x,
        tensors={t: a[t].detach() for t in tensor_names(meta)},
    )
    return (tuple(res) if names else res[0]), cache


def _outs_by_name(meta: LayerMeta, outs: Any) -> dict:
    """Preallocated outputs beside y by name: ``outs`` None, a sequence in order or a dict."""
    names = meta.outputs
    if outs is None:
        return {}
    if not isinstance(outs, dict):
        outs = list(outs)
        if len(outs) != len(names):
            raise ValueError(f"{meta.name}: outs must have {len(names)} tensors ({', '.join(names)}), got {len(outs)}")
        outs = dict(zip(names, outs))
    extra = set(outs) - set(names)
    if extra:
        raise ValueError(f"{meta.name}: outs has unknown output(s) {', '.join(sorted(extra))}")
    return outs


def _check_cache(meta: LayerMeta, cache: Any) -> Cache:
    if not isinstance(cache, Cache) or cache.meta.name != meta.name:
        raise TypeError(f"{meta.name}: cache must be what this module's forward returned")
    return cache


def _store_all(got: tuple, out: Any, fields: tuple[str, ...]) -> tuple:
    """Results written into ``out`` (a tuple or a dict by field) where given."""
    if out is None:
        return got
    outs = out if not isinstance(out, dict) else [out.get(f) for f in fields]
    res = []
    for o, g, f in zip(outs, got, fields):
        if o is None:
            res.append(g)
            continue
        if not isinstance(o, torch.Tensor) or o.shape != g.shape or o.dtype != g.dtype:
            raise ValueError(f"{f} must be a tensor of shape {tuple(g.shape)} and dtype {g.dtype}")
        res.append(o.copy_(g))
    return tuple(res)


def _check_like_x(meta: LayerMeta, what: str, t: Any, x: torch.Tensor) -> None:
    """``t`` (dy, a cotangent) is a tensor of x's shape, dtype and device."""
    if (
        not isinstance(t, torch.Tensor)
        or tuple(t.shape) != tuple(x.shape)
        or t.dtype != x.dtype
        or t.device != x.device
    ):
        got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{meta.name}: {what} must have the shape and dtype of x {tuple(x.shape)} {x.dtype}"
            f" (on {x.device}), got {got}"
        )


def backward(layer: Layer, dy: torch.Tensor, cache: Cache, out: Any = None, cotangents: dict | None = None) -> tuple:
    """``Grads(dx, d<tensor>..., d<param>..., d<input>...)`` by the mode's backward kernel;
    ``cotangents``: those of the outputs beside y by name (None: zero)."""
    meta = layer.meta
    cache = _check_cache(meta, cache)
    x = cache.x
    _check_like_x(meta, "dy", dy, x)
    cots = {}
    for o, c in (cotangents or {}).items():
        if c is not None:
            _check_like_x(meta, "d" + o, c, x)
            cots["d" + o] = c.detach()
    a = {"dy": dy.detach(), "x": x, **cache.params, **cache.inputs, **cache.buffers, **cache.options, **cache.stats}
    a.update(cache.tensors)
    a.update(cots)
    with torch.no_grad():
        dx, dparams, dins = run_backward(layer, cache.mode, a, cache.layout)
    got = [*(dx if isinstance(dx, tuple) else (dx,)), *(dparams[p] for p in meta.params)]
    for i in meta.inputs:
        given = cache.inputs[i]
        d = dins[i]
        got.append((d.double().sum() if given.numel() == 1 else d).to(x.dtype).reshape(given.shape))
    return layer.grads_type(*_store_all(tuple(got), out, layer.grads_type._fields))


def _torch_cache(layer: Layer, cache: Cache) -> tuple[Any, Any]:
    """The generated PyTorch module of the layer's spec and its cache at the same point (the
    tensor inputs beside x as the forward was given them)."""
    if layer.spec is None:
        raise RuntimeError(f"{layer.meta.name}: load the module with derivgen.load(spec, backend='triton')")
    tm = load(layer.spec, "torch")
    meta = layer.meta
    kw: dict = {**cache.options, **cache.inputs}
    if reads_buffers(meta, cache.mode):
        kw.update({b: v.clone() for b, v in cache.buffers.items()})
    if meta.reduce == "group":
        kw["num_groups"] = cache.num_groups
    if "eval" in meta.modes:
        kw["training"] = cache.mode == "train"
    pos = [cache.user_x, *(cache.tensors[t] for t in tensor_names(meta)), *(cache.params[p] for p in meta.params)]
    _, tcache = tm.forward(*pos, **kw)
    return tm, tcache


def backward_backward(
    layer: Layer,
    dy: torch.Tensor,
    cache: Cache,
    ddx: Any,
    ddparams: Any,
    ddinputs: Any,
    out: Any,
    ddtensors: Any = None,
    cotangents: dict | None = None,
) -> tuple:
    """The double backward, by the PyTorch closed forms on the tensors' device; a layer with
    tensor inputs beside x takes the seeds of their gradients in ``ddtensors`` (by name), one
    with outputs beside y the cotangents its backward took in ``cotangents`` (by name)."""
    tm, tcache = _torch_cache(layer, _check_cache(layer.meta, cache))
    if not (layer.meta.tensors or layer.meta.outputs):
        return tm.backward_backward(dy, tcache, ddx, ddparams, ddinputs=ddinputs, out=out)
    cots = {"d" + o: v for o, v in (cotangents or {}).items()}
    return tm.backward_backward(dy, tcache, ddx, ddparams, ddinputs=ddinputs, ddtensors=ddtensors, out=out, **cots)


def jvp(
    layer: Layer,
    cache: Cache,
    tx: Any,
    tparams: Any,
    tinputs: Any,
    out: Any,
    ttensors: Any = None,
    outs: Any = None,
) -> torch.Tensor | tuple:
    """The forward-mode derivative, by the PyTorch closed forms on the tensors' device: y's
    tangent, or ``(ty, t<output>...)`` for a layer with outputs beside y (``outs``: preallocated
    tangents of the latter)."""
    tm, tcache = _torch_cache(layer, _check_cache(layer.meta, cache))
    if not (layer.meta.tensors or layer.meta.outputs):
        return tm.jvp(tcache, tx, tparams, tinputs=tinputs, out=out)
    kw = {"outs": outs} if layer.meta.outputs else {}
    return tm.jvp(tcache, tx, tparams, tinputs=tinputs, ttensors=ttensors, out=out, **kw)
