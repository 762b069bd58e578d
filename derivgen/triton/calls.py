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

A layer with tensor inputs beside x (``META["tensors"]``: fused residual adds, gates,
modulation, masks) takes them after x, in spec order; the kernels read each at x's element
offsets, so a broadcast one (``sample``, ``position``: :mod:`derivgen.runtime.tensors`) is
written out at x's shape and strides first (:func:`at_x`), and its element gradients, written
at x's shape in float32, are summed over the axes it is broadcast over afterwards
(:func:`finish_tensor_grad`). A layer with outputs beside y (``META["outputs"]``) returns
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

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

from derivgen import runtime as rt
from derivgen.api import load
from derivgen.runtime.abi import grad_tensor_names, reads_buffers, tensor_names
from derivgen.runtime.tensors import broadcast_axes, tensor_shape
from derivgen.runtime.validate import (
    check_call_shapes,
    check_same_dtype,
)
from derivgen.triton import _target

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 4096  # the most elements a program holds per tile (a group up to this size stays in registers)
_tile = [TILE]


@contextmanager
def tile_limit(elements: int) -> Iterator[None]:
    """Within the block, tiles of at most ``elements`` values (a power of two): small ones
    make every group too large for one tile, so the tests sweep in tiles too."""
    old, _tile[0] = _tile[0], int(elements)
    try:
        yield
    finally:
        _tile[0] = old


@dataclass
class Layer:
    """A generated Triton module's kernels and contract (its ``LAYER``): the metadata, the
    two kernels of each mode, their arguments by role and spec name, the result types and
    the Spec (set by :func:`derivgen.load`; the second order runs its PyTorch closed forms)."""

    meta: dict
    kernels: dict[str, tuple[Callable, Callable]]
    args: dict[str, dict[str, list[tuple[str, str]]]]
    grads_type: type
    second_type: type
    spec: Any = None


class Cache(rt.StatisticsView):
    """What the forward keeps for the backward: the mode, layout, x as the kernels read it,
    the tensor inputs beside x (as given), parameters, options, per-group inputs, buffers the
    statistics read (copies), and the statistics (float32, one value per group); as attributes (``cache.mean``) the
    statistics in the layer's group shape and x's dtype."""

    def __init__(self, meta: dict, mode: str, layout: rt.Layout, x: torch.Tensor, **kw: Any) -> None:
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
        return f"Cache({self.meta['name']}, {self.mode}, x {tuple(self.x.shape)} {self.x.dtype}, Triton)"


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


def check_call(meta: dict, mode: str, a: dict) -> rt.Layout:
    """The forward's argument contract on tensors by spec name (errors name the argument);
    the layout of x. The tensor inputs beside x have their declared shapes, and a mask's
    values are 0 or 1."""
    name, x = meta["name"], a["x"]
    for t in tensor_names(meta):
        if a.get(t) is None:
            raise TypeError(f"{name}: {t} is required (a tensor input)")
    tensors = ["x", *tensor_names(meta), *meta["params"], *meta["inputs"]]
    tensors += meta["buffers"] if reads_buffers(meta, mode) else []
    for k in tensors:
        _check_tensor(name, k, a[k])
        check_same_dtype(meta, k, a[k].dtype, x.dtype, "; use one dtype for all")
        if a[k].device != x.device:
            raise ValueError(f"{name}: {k} is on {a[k].device} but x is on {x.device}")
    L = check_call_shapes(meta, mode, a, a.get("num_groups"))
    for t, (kind, _, mask) in meta.get("tensors", {}).items():
        want, got = tensor_shape(meta, kind, L), tuple(a[t].shape)
        if got != want:
            raise ValueError(f"{name}: {t} must have shape {want} ({kind!r} for x of shape {L.x_shape}), got {got}")
        if mask and a[t].numel() and not bool(((a[t] == 0) | (a[t] == 1)).all()):
            raise ValueError(f"{name}: {t} is a mask: every value must be 0 or 1")
    return L


# ---- the geometry of the kernels


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: channels-first or channels-last memory, else a contiguous copy."""
    if x.is_contiguous():
        return x
    if x.dim() in (4, 5):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        if x.is_contiguous(memory_format=fmt):
            return x
    return x.contiguous()


def geometry(meta: dict, L: rt.Layout, x: torch.Tensor) -> dict:
    """The kernels' layout arguments for x (as :func:`_dense` made it): groups, the first
    element of group g of sample o at ``o*sO + g*Cg*sC``, each group an A x B matrix with
    strides sA, sB, and where the parameters' channel runs (PCHAN: 0 one per group, 1 along
    the rows, 2 along the columns)."""
    geo = {"NGroups": L.n_groups, "G": L.G, "Cg": L.Cg}
    if meta["layout"] == "trailing":
        D = L.Cg * L.S
        return {**geo, "sO": D, "sC": 1, "A": 1, "B": D, "sA": 0, "sB": 1, "PCHAN": 2}
    st = x.stride()
    sN, sCh = st[0], st[1]
    sS = st[-1] if x.dim() > 2 else 1  # channels first: 1; channels last: C (the spatial axes are one run)
    if L.per_position:  # group s of sample o: its C channels, a 1 x C matrix
        return {**geo, "G": L.S, "Cg": 1, "sO": sN, "sC": sS, "A": 1, "B": L.Cg, "sA": 0, "sB": sCh, "PCHAN": 2}
    if L.per_sample:
        return {**geo, "sO": sN, "sC": sCh, "A": L.Cg, "B": L.S, "sA": sCh, "sB": sS, "PCHAN": 1 if L.Cg > 1 else 0}
    if L.Cg != 1:
        raise NotImplementedError(f"{meta['name']}: batch statistics over groups of several channels")
    return {**geo, "sO": 0, "sC": sCh, "A": L.O, "B": L.S, "sA": sN, "sB": sS, "PCHAN": 0}


def at_x(meta: dict, name: str, t: torch.Tensor, x: torch.Tensor, L: rt.Layout) -> torch.Tensor:
    """A tensor input as the kernels read it: at x's shape and strides (``x`` as :func:`_dense`
    made it), a broadcast one written out over the axes it is broadcast over."""
    if tuple(t.shape) != tuple(x.shape):
        shape = list(x.shape)
        for ax in broadcast_axes(meta, meta["tensors"][name][0], L):
            shape[ax] = 1
        t = t.reshape(shape).expand(x.shape)
    elif t.stride() == x.stride():
        return t
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(t)


def _like_x(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A cotangent (of x's shape) with x's strides; zeros for one not given."""
    if t is None:
        return torch.zeros_like(x)
    if t.stride() == x.stride():
        return t
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(t)


def finish_tensor_grad(meta: dict, name: str, buf: torch.Tensor, given: torch.Tensor, L: rt.Layout) -> torch.Tensor:
    """A tensor input's gradient from its element gradients ``buf`` (x's shape): summed over
    the axes the input ``given`` was broadcast over, in its shape and dtype."""
    if tuple(buf.shape) == tuple(given.shape):
        return buf if buf.dtype == given.dtype else buf.to(given.dtype)
    axes = broadcast_axes(meta, meta["tensors"][name][0], L)
    return buf.sum(dim=axes, dtype=torch.float32).to(given.dtype).reshape(given.shape)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def blocks(geo: dict) -> dict:
    """Tile sizes for a layout's geometry: BLOCK_B columns (a power of two up to the tile
    limit), BLOCK_A rows with them; ONE_PASS when a whole group fits in one tile, and then
    ROWS groups per tile where groups share their channels (rows of x: PCHAN 2)."""
    limit = _tile[0]
    A, B = geo["A"], geo["B"]
    bb = min(_pow2(B), limit)
    ba = min(_pow2(A), max(1, limit // bb))
    one = A <= ba and B <= bb
    rows = min(_pow2(geo["NGroups"]), max(1, limit // (ba * bb))) if one and geo["PCHAN"] == 2 else 1
    return {"ROWS": rows, "BLOCK_A": ba, "BLOCK_B": bb, "ONE_PASS": one}


def programs(n_groups: int, device: torch.device, rows: int = 1) -> int:
    """How many programs (each sweeps blocks of ``rows`` groups Pid, Pid + programs, ...): a
    few per multiprocessor on a GPU; four under the interpreter, which runs them one by one."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_properties(device).multi_processor_count * 4
    else:
        cap = 4
    return max(1, min(-(-n_groups // rows), cap))


def _warps(geo: dict, blk: dict) -> dict:
    """Launch options: more warps for larger tiles (the interpreter ignores them)."""
    n = blk["ROWS"] * blk["BLOCK_A"] * blk["BLOCK_B"]
    return {"num_warps": 8 if n >= 2048 else 4 if n >= 512 else 2}


# ---- launches


def _group_values(v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A per-group input or buffer as the kernels read it: flat, and its stride (0 for one value)."""
    flat = v.reshape(-1).contiguous()
    return flat, (0 if flat.numel() == 1 else 1)


def _kernel_args(roles: list[tuple[str, str]], values: dict, L: rt.Layout) -> list:
    """The kernel's leading arguments in order, from ``values`` by (role, spec name); a
    per-group input is two arguments, its values and their stride; ("mask", o) is the
    feature count ⌊o·N⌋ of ``leading(o)``."""
    out: list = []
    for role, n in roles:
        if role == "input":
            out.extend(_group_values(values[role, n]))
        elif role == "mask":
            out.append(rt.leading_count(values["option", n], L.Cg))
        else:
            out.append(values[role, n])
    return out


def _common(meta: dict, a: dict) -> dict:
    """Kernel arguments by (role, spec name) that forward and backward share."""
    v: dict = {("param", p): a[p].reshape(-1).contiguous() for p in meta["params"]}
    v.update({("input", i): a[i] for i in meta["inputs"]})
    v.update({("option", o): float(a[o]) for o in meta["options"]})
    return v


def _check_runnable(kernel: Any, x: torch.Tensor) -> None:
    """Kernels compiled for a GPU cannot read CPU tensors: say how to run them interpreted."""
    if x.device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"the Triton kernels run on CUDA tensors, or on {x.device} tensors under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before Triton is first imported"
        )


def run_forward(layer: Layer, mode: str, a: dict, L: rt.Layout, update: bool) -> tuple[Any, dict]:
    """y and the statistics (float32, one per group) by the mode's forward kernel; with
    ``update``, the running buffers given in ``a`` are updated in place (training mode).
    ``a`` holds the tensor inputs beside x by name (their declared shapes); a layer with
    outputs beside y gives ``(y, *outputs)`` for y."""
    meta = layer.meta
    x = _dense(a["x"])
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    extra = {
        o: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for o in meta.get("outputs", [])
    }
    ys = (y, *extra.values()) if extra else y
    stats = {s: torch.empty(L.n_groups, dtype=torch.float32, device=x.device) for s in meta["stats"][mode]}
    if x.numel() == 0:
        for s in stats.values():
            s.fill_(math.nan)
        return ys, stats
    values = {("x", "x"): x, ("y", "y"): y, **_common(meta, a)}
    values.update({("tensor", t): at_x(meta, t, a[t], x, L) for t in tensor_names(meta)})
    values.update({("output", o): v for o, v in extra.items()})
    values.update({("stat", s): t for s, t in stats.items()})
    given = {b: a.get(b) for b in meta["buffers"]}
    copies = {}
    for b, v in given.items():
        if v is None:
            values["buffer", b] = x  # not read: a placeholder pointer
            continue
        flat = v.reshape(-1)
        copies[b] = flat if flat.is_contiguous() and flat.data_ptr() == v.data_ptr() else flat.contiguous()
        values["buffer", b] = copies[b]
    up = bool(update and meta["buffers"] and all(v is not None for v in given.values()))
    geo = geometry(meta, L, x)
    blk = blocks(geo)
    kernel = layer.kernels[mode][0]
    _check_runnable(kernel, x)
    args = _kernel_args(layer.args[mode]["forward"], values, L)
    pchan = geo.pop("PCHAN")
    grid = (programs(L.n_groups, x.device, blk["ROWS"]),)
    kernel[grid](*args, *geo.values(), **blk, PCHAN=pchan, UPDATE=up, **_warps(geo, blk))
    for b, c in copies.items():
        if up and c.data_ptr() != given[b].data_ptr():
            given[b].copy_(c.reshape(given[b].shape))
    return ys, stats


def run_backward(layer: Layer, mode: str, a: dict, L: rt.Layout) -> tuple[Any, dict, dict]:
    """(dx, {parameter: gradient}, {input: per-group gradient, float32}) by the mode's
    backward kernel and the reduction of the partial sums; ``a`` has dy, x as the forward
    read it, the parameters, inputs, buffers the statistics read, the statistics, options;
    and a layer's tensor inputs beside x by name and the cotangents of its outputs beside y
    (``d<output>``; missing or None: zero). A layer whose tensor inputs have gradients gives
    ``(dx, *d<tensor>)`` for dx (each in its input's shape: summed over its broadcast axes)."""
    meta = layer.meta
    x = _dense(a["x"])
    dy = _like_x(a["dy"], x)
    dx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    # a tensor's element gradients: its own dtype at x's shape, float32 where they are summed
    dts = {
        t: torch.empty_strided(
            x.shape, x.stride(), dtype=x.dtype if a[t].shape == x.shape else torch.float32, device=x.device
        )
        for t in grad_tensor_names(meta)
    }
    geo = geometry(meta, L, x)
    blk = blocks(geo)
    pchan = geo.pop("PCHAN")
    nprog = programs(L.n_groups, x.device, blk["ROWS"])
    scalar = set(meta["scalar_params"])
    channels = L.G * L.Cg
    parts = {
        p: torch.zeros((nprog, 1 if p in scalar else channels), dtype=torch.float32, device=x.device)
        for p in meta["params"]
    }
    dins = {i: torch.zeros(L.n_groups, dtype=torch.float32, device=x.device) for i in meta["inputs"]}
    if x.numel():
        values = {("x", "x"): x, ("dy", "dy"): dy, ("dx", "dx"): dx, **_common(meta, a)}
        values.update({("tensor", t): at_x(meta, t, a[t], x, L) for t in tensor_names(meta)})
        values.update({("cotangent", o): _like_x(a.get("d" + o), x) for o in meta.get("outputs", [])})
        values.update({("dtensor", t): v for t, v in dts.items()})
        values.update({("buffer", b): a[b].reshape(-1).contiguous() for b in meta["buffers"] if b in a})
        values.update({("stat", s): a[s].reshape(-1).to(torch.float32).contiguous() for s in meta["stats"][mode]})
        values.update({("dparam", p): parts[p] for p in meta["params"]})
        values.update({("dinput", i): dins[i] for i in meta["inputs"]})
        args = _kernel_args(layer.args[mode]["backward"], values, L)
        _check_runnable(layer.kernels[mode][1], x)
        layer.kernels[mode][1][(nprog,)](*args, *geo.values(), channels, **blk, PCHAN=pchan, **_warps(geo, blk))
    else:
        dx.zero_()
        for v in dts.values():
            v.zero_()
    dparams = {p: reduce_rows(parts[p], a[p].dtype).reshape(a[p].shape) for p in meta["params"]}
    if dts:
        return (dx, *(finish_tensor_grad(meta, t, v, a[t], L) for t, v in dts.items())), dparams, dins
    return dx, dparams, dins


def reduce_rows(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The column sums of the programs' partial sums (R, C) by the second kernel, in ``dtype``."""
    R, C = part.shape
    out = torch.empty(C, dtype=dtype, device=part.device)
    bc = min(_pow2(C), 1024)
    br = min(_pow2(R), max(1, 4096 // bc))
    _target.sum_rows_kernel[(triton_cdiv(C, bc),)](part, out, R, C, BLOCK_R=br, BLOCK_C=bc)
    return out


def triton_cdiv(a: int, b: int) -> int:
    """ceil(a / b)."""
    return -(-a // b)


# ---- the calling convention


def _tensor(v: Any, x: torch.Tensor) -> torch.Tensor:
    """A per-group input given as a number: a tensor of x's dtype on x's device."""
    return v if isinstance(v, torch.Tensor) else torch.as_tensor(float(v), dtype=x.dtype, device=x.device)


def _mode(meta: dict, training: Any) -> str:
    if not isinstance(training, bool):
        raise TypeError(f"{meta['name']}: training must be a bool, got {type(training).__name__}")
    return "train" if training or "eval" not in meta["modes"] else "eval"


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
    name = meta["name"]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    mode = _mode(meta, training)
    params = {p: _tensor(v, x) if p in meta["scalar_params"] else v for p, v in params.items()}
    ins = {i: _tensor(v, x) for i, v in inputs.items()}
    a = {"x": x, **params, **ins, **options, "num_groups": num_groups or 0}
    a.update({t: v for t, v in (tensors or {}).items()})
    if reads_buffers(meta, mode):
        missing = [b for b in meta["buffers"] if buffers.get(b) is None]
        if missing:
            raise ValueError(f"{name}: {mode} mode needs {missing[0]} (its statistics read it)")
    a.update({b: v for b, v in buffers.items() if v is not None})
    L = check_call(meta, mode, a)
    given = _outs_by_name(meta, outs)
    kept = {b: buffers[b].detach().clone() for b in meta["buffers"]} if reads_buffers(meta, mode) else {}
    with torch.no_grad():
        ys, stats = run_forward(layer, mode, a, L, update=mode == "train" and x.numel() > 0)
    names = meta.get("outputs", [])
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
        _dense(x).detach(),
        params={p: params[p] for p in meta["params"]},
        stats=stats,
        options={o: float(options[o]) for o in meta["options"]},
        inputs=ins,
        buffers=kept,
        num_groups=num_groups,
        user_x=x,
        tensors={t: a[t].detach() for t in tensor_names(meta)},
    )
    return (tuple(res) if names else res[0]), cache


def _outs_by_name(meta: dict, outs: Any) -> dict:
    """Preallocated outputs beside y by name: ``outs`` None, a sequence in order or a dict."""
    names = meta.get("outputs", [])
    if outs is None:
        return {}
    if not isinstance(outs, dict):
        outs = list(outs)
        if len(outs) != len(names):
            raise ValueError(
                f"{meta['name']}: outs must have {len(names)} tensors ({', '.join(names)}), got {len(outs)}"
            )
        outs = dict(zip(names, outs))
    extra = set(outs) - set(names)
    if extra:
        raise ValueError(f"{meta['name']}: outs has unknown output(s) {', '.join(sorted(extra))}")
    return outs


def _check_cache(meta: dict, cache: Any) -> Cache:
    if not isinstance(cache, Cache) or cache.meta["name"] != meta["name"]:
        raise TypeError(f"{meta['name']}: cache must be what this module's forward returned")
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


def _check_like_x(meta: dict, what: str, t: Any, x: torch.Tensor) -> None:
    """``t`` (dy, a cotangent) is a tensor of x's shape, dtype and device."""
    if (
        not isinstance(t, torch.Tensor)
        or tuple(t.shape) != tuple(x.shape)
        or t.dtype != x.dtype
        or t.device != x.device
    ):
        got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(
            f"{meta['name']}: {what} must have the shape and dtype of x {tuple(x.shape)} {x.dtype}"
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
    got = [*(dx if isinstance(dx, tuple) else (dx,)), *(dparams[p] for p in meta["params"])]
    for i in meta["inputs"]:
        given = cache.inputs[i]
        d = dins[i]
        got.append((d.double().sum() if given.numel() == 1 else d).to(x.dtype).reshape(given.shape))
    return layer.grads_type(*_store_all(tuple(got), out, layer.grads_type._fields))


def _torch_cache(layer: Layer, cache: Cache) -> tuple[Any, Any]:
    """The generated PyTorch module of the layer's spec and its cache at the same point (the
    tensor inputs beside x as the forward was given them)."""
    if layer.spec is None:
        raise RuntimeError(f"{layer.meta['name']}: load the module with derivgen.load(spec, backend='triton')")
    tm = load(layer.spec, "torch")
    meta = layer.meta
    kw: dict = {**cache.options, **cache.inputs}
    if reads_buffers(meta, cache.mode):
        kw.update({b: v.clone() for b, v in cache.buffers.items()})
    if meta["reduce"] == "group":
        kw["num_groups"] = cache.num_groups
    if "eval" in meta["modes"]:
        kw["training"] = cache.mode == "train"
    pos = [cache.user_x, *(cache.tensors[t] for t in tensor_names(meta)), *(cache.params[p] for p in meta["params"])]
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
    if not (layer.meta.get("tensors") or layer.meta.get("outputs")):
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
    if not (layer.meta.get("tensors") or layer.meta.get("outputs")):
        return tm.jvp(tcache, tx, tparams, tinputs=tinputs, out=out)
    kw = {"outs": outs} if layer.meta.get("outputs") else {}
    return tm.jvp(tcache, tx, tparams, tinputs=tinputs, ttensors=ttensors, out=out, **kw)
