"""The NumPy and C modules' calling convention on torch tensors: what the public
functions of the generated PyTorch modules (``derivgen.load(spec, backend="torch")``)
call. ``forward(x, params..., *, options..., out=None) -> (y, cache)``,
``backward(dy, cache) -> Grads``, ``backward_backward(dy, cache, ddx, ddparams, ddinputs=)
-> SecondGrads`` and ``jvp(cache, tx, tparams, tinputs=) -> ty`` (a layer with tensor inputs
beside x and outputs beside y: ``ddtensors=``/``ttensors=`` seeds of its tensors, the
cotangents ``d<output>=`` its backward took, and ``(ty, t<output>...)``), on any device, with
autograd recording them (so they can be differentiated further, and torch.compile can
fuse them). float16 and bfloat16 inputs are computed in float32; results have x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from derivgen import runtime as rt
from derivgen.runtime.abi import reads_buffers
from derivgen.runtime.meta import LayerMeta, MetaLike, layer_meta
from derivgen.runtime.tensors import seeds_by_name
from derivgen.torch.schema import differentiable, extra_outputs, grad_tensors, is_multi, tensor_inputs
from derivgen.torch.tensors import channels_last_format, full_tensor, is_channels_last, tensor_grad, wide
from derivgen.torch.validate import check_on_tensors, check_tensor_inputs

LOW = (torch.float16, torch.bfloat16)


class Cache(rt.StatisticsView):
    """What the forward keeps for the backward (the NumPy modules' ``Cache`` on tensors):
    the mode, layout, x, parameters, options, per-group inputs and the statistics (one
    float64 value per group, or float32 on a device without float64 support); as attributes
    (``cache.mean``, ``cache.rstd``) the statistics in the layer's group shape and x's dtype."""

    def __init__(self, meta, mode, layout, x, params, stats, options, inputs, num_groups, tensors=None) -> None:
        self.meta, self.mode, self.layout = meta, mode, layout
        self.x, self.params, self.stats = x, params, stats
        self.options, self.inputs, self.num_groups = options, inputs, num_groups
        self.tensors = dict(tensors or {})  # the tensor inputs beside x, as given

    def __repr__(self) -> str:
        return f"Cache({self.meta.name}, {self.mode}, x {tuple(self.x.shape)} {self.x.dtype})"


def _tensor(v: Any, x: torch.Tensor) -> torch.Tensor:
    """A per-group input given as a number: a tensor of x's dtype on x's device."""
    return v if isinstance(v, torch.Tensor) else torch.as_tensor(float(v), dtype=x.dtype, device=x.device)


def _compute(v: Any) -> Any:
    """A float16/bfloat16 tensor as float32 (the computation's dtype)."""
    return v.float() if isinstance(v, torch.Tensor) and v.dtype in LOW else v


def _views(meta: LayerMeta, a: dict, L: rt.Layout, mode: str) -> dict:
    """Keyword arguments of the generated functions: 4-D views, in the computation's dtype."""
    kw: dict = {"_L": L}
    for t in tensor_inputs(meta):  # the tensor inputs beside x, at x's shape
        kw[t] = _compute(full_tensor(meta, t, a[t], L)).reshape(L.view4)
    for p in meta.params:
        kw[p] = _compute(a[p]).reshape((1, 1, 1, 1) if p in meta.scalar_params else L.param4)
    for i in meta.inputs:
        v = _compute(a[i])
        kw[i] = v.reshape((1, 1, 1, 1) if v.numel() == 1 else L.stat4)
    for b in meta.buffers:
        v = a.get(b) if reads_buffers(meta, mode) else None
        kw[b] = None if v is None else _compute(v).reshape(L.stat4)
    for o in meta.options:
        kw[o] = a[o]
    return kw


def _store(out: torch.Tensor | None, v: torch.Tensor, what: str) -> torch.Tensor:
    """``v`` written into ``out`` when one is given (same shape and dtype), else ``v``."""
    if out is None:
        return v
    if not isinstance(out, torch.Tensor) or out.shape != v.shape or out.dtype != v.dtype:
        raise ValueError(f"{what} must be a tensor of shape {tuple(v.shape)} and dtype {v.dtype}")
    return out.copy_(v)


def _store_all(got: tuple, out: Any, fields: tuple[str, ...]) -> tuple:
    """``got`` written into ``out`` (a sequence, or a dict by field name) where given."""
    if out is None:
        return got
    given = out if not isinstance(out, dict) else [out.get(f) for f in fields]
    return tuple(_store(o, v, f) for o, v, f in zip(given, got, fields))


def forward(
    meta: MetaLike,
    functions: dict[str, Callable],
    update: Callable | None,
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
) -> tuple[torch.Tensor | tuple, Cache]:
    """``(y, cache)`` by the generated forward; running buffers given in training mode
    are updated in place (not differentiated). A layer with tensor inputs beside x takes
    them in ``tensors`` (by name); one with outputs beside y returns ``((y, outputs...),
    cache)`` and writes them into ``outs`` (a sequence or a dict by name) when given."""
    meta = layer_meta(meta)
    name = meta.name
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(training, bool):
        raise TypeError(f"{name}: training must be a bool, got {type(training).__name__}")
    mode = "train" if training or "eval" not in meta.modes else "eval"
    ins = {i: _tensor(v, x) for i, v in inputs.items()}
    a = {"x": x, **params, **ins, **options, "num_groups": num_groups or 0}
    if reads_buffers(meta, mode):
        missing = [b for b in meta.buffers if buffers.get(b) is None]
        if missing:
            raise ValueError(f"{name}: {mode} mode needs {missing[0]} (its statistics read it)")
        a.update({b: buffers[b] for b in meta.buffers})
    tens = dict(tensors or {})
    a.update(tens)
    L = check_on_tensors(meta, mode, a, any_device=True)
    check_tensor_inputs(meta, a, L, any_device=True, values=not torch._C._are_functorch_transforms_active())
    opts = {o: float(options[o]) for o in meta.options}
    a.update(opts)
    got = functions[mode](_compute(x).reshape(L.view4), **_views(meta, a, L, mode))
    y4, st = got[0], got[1]
    y = _like_x(y4, x, meta)
    extra = [_like_x(got[2][o], x, meta) for o in extra_outputs(meta)] if is_multi(meta) else []
    sd = wide(x.device)
    stats = {s: st[s].reshape(L.n_groups).to(sd) for s in meta.stats[mode]}
    # the buffers the statistics read, as they were before this call updates them
    read = {b: buffers[b].detach().clone() for b in meta.buffers} if reads_buffers(meta, mode) else None
    if mode == "train" and update is not None and x.numel():
        bufs = {b: buffers.get(b) for b in meta.buffers}
        if any(v is not None for v in bufs.values()):
            with torch.no_grad():
                shape = L.group_shape
                vals = {s: t.detach().reshape(shape) for s, t in stats.items()}
                given = {b: (v.to(sd) if v is not None else torch.zeros(shape, dtype=sd)) for b, v in bufs.items()}
                new = update(**vals, **given, **opts, N=L.group_size)
                for b, v in new.items():
                    if bufs[b] is not None:
                        bufs[b].copy_(v.reshape(bufs[b].shape))
    y = _store(out, y, "out")
    cache = Cache(meta, mode, L, x, {p: params[p] for p in meta.params}, stats, opts, ins, num_groups, tens)
    if read is not None:
        cache.buffers = read
    if extra:
        given = _by_name(extra_outputs(meta), outs, "outs", meta)
        extra = [_store(given.get(o), v, "outs." + o) for o, v in zip(extra_outputs(meta), extra)]
        return (y, *extra), cache
    return y, cache


def _like_x(v4: torch.Tensor, x: torch.Tensor, meta: LayerMeta) -> torch.Tensor:
    """An element-level result (4-D) in x's shape, dtype and memory format."""
    v = v4.reshape(x.shape).to(x.dtype)
    if meta.layout == "channels" and is_channels_last(x):
        v = v.contiguous(memory_format=channels_last_format(x))
    return v


def _call_args(cache: Cache) -> dict:
    """A cache's arguments by spec name."""
    a = {"x": cache.x, **cache.tensors, **cache.params, **cache.inputs, **cache.options}
    a["num_groups"] = cache.num_groups or 0
    if reads_buffers(cache.meta, cache.mode):
        a.update(cache.__dict__.get("buffers", {}))
    return a


def _backward_of(
    meta: LayerMeta, functions: dict[str, Callable], cache: Cache, cotangents: dict | None = None
) -> Callable:
    """(dy, x, params..., inputs...) -> (dx, dparams..., dinputs...) of the cache's call; a
    multi layer's (dy, x, tensors with a gradient..., ...) -> (dx, dtensors..., ...), with
    the outputs' cotangents (x's shape) in ``cotangents`` by name."""
    a0, L, mode = _call_args(cache), cache.layout, cache.mode
    diff = differentiable(meta)
    cots = {"d" + o: _compute(c).reshape(L.view4) for o, c in (cotangents or {}).items()}

    def f(dy, *vals):
        a = {**a0, **dict(zip(diff, vals))}
        x = a["x"]
        got = functions[mode](
            _compute(dy).reshape(L.view4), _compute(x).reshape(L.view4), **cots, **_views(meta, a, L, mode)
        )
        dx, dp, di = got[:3]
        res = [dx.reshape(x.shape).to(x.dtype)]
        for t in grad_tensors(meta):
            d = got[3][t].reshape(x.shape)
            res.append(tensor_grad(meta, t, d, L, a[t].shape).to(x.dtype))
        res += [dp[p].reshape(a[p].shape).to(x.dtype) for p in meta.params]
        for i in meta.inputs:
            v = di[i]
            res.append((v.sum() if a[i].numel() == 1 else v).reshape(a[i].shape).to(x.dtype))
        return tuple(res)

    return f


def _check_like_x(name: str, what: str, v: Any, cache: Cache) -> torch.Tensor:
    """A tensor of x's shape and dtype (None: zeros)."""
    x = cache.x
    if v is None:
        return torch.zeros_like(x)
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(x.shape) or v.dtype != x.dtype:
        got = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"{name}: {what} must have the shape and dtype of x {tuple(x.shape)} {x.dtype}, got {got}")
    return v


def _by_name(names: Sequence[str], v: Any, what: str, meta: LayerMeta) -> dict:
    """Seeds given as a dict by name or a sequence in spec order (None: none)."""
    if v is None:
        return {}
    if isinstance(v, dict):
        unknown = set(v) - set(names)
        if unknown:
            raise ValueError(f"{meta.name}: unknown {what} {sorted(unknown)}; names are {list(names)}")
        return dict(v)
    v = list(v)
    if len(v) > len(names):
        raise ValueError(f"{meta.name}: {what}: at most {len(names)} values, got {len(v)}")
    return dict(zip(names, v))


def _tensor_seeds(meta: LayerMeta, cache: Cache, given: Any, label: str) -> list[torch.Tensor]:
    """The seeds of the tensor inputs with a gradient, in spec order: ``given`` a dict by
    name (None, a missing name or a None entry: zeros), each of the tensor's declared shape
    (a broadcast one's, not x's) and x's dtype; errors name ``<label>.<tensor>``."""
    name, names = meta.name, grad_tensors(meta)
    given = seeds_by_name(meta, label, given, names)
    x, seeds = cache.x, []
    for t in names:
        ref, v = cache.tensors[t], given.get(t)
        if v is None:
            seeds.append(torch.zeros(ref.shape, dtype=x.dtype, device=x.device))
            continue
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name}: {label}.{t} must be a torch.Tensor, got {type(v).__name__}")
        if v.dtype != x.dtype:
            raise TypeError(f"{name}: {label}.{t} has dtype {v.dtype} but the forward ran in {x.dtype}")
        if tuple(v.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: {label}.{t} must have the shape of {t} {tuple(ref.shape)}, got {tuple(v.shape)}")
        if v.device != x.device:
            raise ValueError(f"{name}: {label}.{t} is on {v.device} but x is on {x.device}")
        seeds.append(v)
    return seeds


def _seeds(
    meta: LayerMeta, cache: Cache, vx: Any, vparams: Any, vinputs: Any, what: str, vtensors: Any = None, label: str = ""
) -> list[torch.Tensor]:
    """One seed per differentiable argument (x, the tensor inputs with a gradient, parameters,
    inputs), zeros where missing; ``label`` names the tensor seeds' argument in errors."""
    name = meta.name
    ps = _by_name(meta.params, vparams, what + " (parameters)", meta)
    ins = _by_name(meta.inputs, vinputs, what + " (inputs)", meta)
    seeds = [_check_like_x(name, what + " of x", vx, cache)]
    seeds += _tensor_seeds(meta, cache, vtensors, label) if is_multi(meta) else []
    for p in meta.params:
        ref = cache.params[p]
        seeds.append(torch.zeros_like(ref) if ps.get(p) is None else _tensor(ps[p], ref).reshape(ref.shape))
    for i in meta.inputs:
        ref = cache.inputs[i]
        seeds.append(torch.zeros_like(ref) if ins.get(i) is None else _tensor(ins[i], ref).reshape(ref.shape))
    return seeds


def backward(
    meta: MetaLike,
    functions: dict[str, Callable],
    grads_type: type,
    dy: torch.Tensor,
    cache: Cache,
    out: Any = None,
    cotangents: dict | None = None,
) -> tuple:
    """``Grads(dx, d<tensor>..., d<param>..., d<input>...)`` by the generated closed form;
    ``cotangents``: those of the outputs beside y by name (None: zeros)."""
    meta = layer_meta(meta)
    if not isinstance(cache, Cache):
        raise TypeError(f"{meta.name}: cache must be what this module's forward returned")
    dy = _check_like_x(meta.name, "dy", dy, cache)
    cots = {o: _check_like_x(meta.name, "d" + o, (cotangents or {}).get(o), cache) for o in extra_outputs(meta)}
    a = _call_args(cache)
    diff = differentiable(meta)
    got = _backward_of(meta, functions, cache, cots)(dy, *(a[n] for n in diff))
    return grads_type(*_store_all(got, out, grads_type._fields))


def backward_backward(
    meta: MetaLike,
    functions: dict[str, Callable],
    second_type: type,
    dy: torch.Tensor,
    cache: Cache,
    ddx: Any = None,
    ddparams: Any = None,
    ddinputs: Any = None,
    out: Any = None,
    ddtensors: Any = None,
    cotangents: dict | None = None,
) -> tuple:
    """``SecondGrads(dx, ddy, dd<output>..., d<tensor>..., d<param>..., d<input>...)``: the VJP
    of the backward with the cotangents of dx, the tensor inputs' gradients (``ddtensors``, by
    name, each of the tensor's declared shape), the parameter and the input gradients
    (torch.func over the closed form). A layer with outputs beside y takes the cotangents its
    backward took for them in ``cotangents`` (by name, None: zero); they are differentiated
    too (``dd<output>``). The tensor inputs without a gradient (masks) are constants."""
    meta = layer_meta(meta)
    if not isinstance(cache, Cache) or cache.meta.name != meta.name:
        raise TypeError(f"{meta.name}: cache must be what this module's forward returned")
    dy = _check_like_x(meta.name, "dy", dy, cache)
    outs = extra_outputs(meta)
    cots = [_check_like_x(meta.name, "d" + o, (cotangents or {}).get(o), cache) for o in outs]
    a = _call_args(cache)
    diff = differentiable(meta)
    cot = _seeds(meta, cache, ddx, ddparams, ddinputs, "the cotangent", ddtensors, "ddtensors")

    def f(dy, *rest):
        return _backward_of(meta, functions, cache, dict(zip(outs, rest[: len(outs)])))(dy, *rest[len(outs) :])

    _, vjp = torch.func.vjp(f, dy, *cots, *(a[n] for n in diff))
    g = vjp(tuple(cot))
    k = 1 + len(outs)
    got = (g[k], *g[:k], *g[k + 1 :])
    return second_type(*_store_all(got, out, second_type._fields))


def jvp(
    meta: MetaLike,
    functions: dict[str, Callable],
    cache: Cache,
    tx: Any = None,
    tparams: Any = None,
    tinputs: Any = None,
    out: torch.Tensor | None = None,
    ttensors: Any = None,
    outs: Any = None,
) -> torch.Tensor | tuple:
    """y's tangent along the tangents of x, the tensor inputs with a gradient (``ttensors``, by
    name, each of the tensor's declared shape), the parameters and the inputs (torch.func's
    JVP of the generated forward) at the cache's point; a layer with outputs beside y returns
    ``(ty, t<output>...)``, the latter written into ``outs`` (a sequence or a dict by name)
    where given."""
    meta = layer_meta(meta)
    if not isinstance(cache, Cache) or cache.meta.name != meta.name:
        raise TypeError(f"{meta.name}: cache must be what this module's forward returned")
    a0, L, mode = _call_args(cache), cache.layout, cache.mode
    diff = differentiable(meta)
    names = extra_outputs(meta)
    given = _by_name(names, outs, "outs", meta)
    tangents = _seeds(meta, cache, tx, tparams, tinputs, "the tangent", ttensors, "ttensors")

    def f(*vals):
        a = {**a0, **dict(zip(diff, vals))}
        x = a["x"]
        got = functions[mode](_compute(x).reshape(L.view4), **_views(meta, a, L, mode))
        return (got[0].reshape(x.shape), *(got[2][o].reshape(x.shape) for o in names))

    ts = torch.func.jvp(f, tuple(a0[n] for n in diff), tuple(tangents))[1]
    ty = _store(out, ts[0].to(cache.x.dtype), "out")
    if not names:
        return ty
    rest = [_store(given.get(o), t.to(cache.x.dtype), "outs." + o) for o, t in zip(names, ts[1:])]
    return (ty, *rest)
