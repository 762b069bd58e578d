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
from derivgen.runtime.abi import reads_buffers
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
    parameters, options, per-group inputs, buffers the statistics read (copies), and the
    statistics (float32, one value per group); as attributes (``cache.mean``) the
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
    the layout of x."""
    name, x = meta["name"], a["x"]
    tensors = ["x", *meta["params"], *meta["inputs"], *(meta["buffers"] if reads_buffers(meta, mode) else ())]
    for k in tensors:
        _check_tensor(name, k, a[k])
        check_same_dtype(meta, k, a[k].dtype, x.dtype, "; use one dtype for all")
        if a[k].device != x.device:
            raise ValueError(f"{name}: {k} is on {a[k].device} but x is on {x.device}")
    return check_call_shapes(meta, mode, a, a.get("num_groups"))


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


def run_forward(layer: Layer, mode: str, a: dict, L: rt.Layout, update: bool) -> tuple[torch.Tensor, dict]:
    """y and the statistics (float32, one per group) by the mode's forward kernel; with
    ``update``, the running buffers given in ``a`` are updated in place (training mode)."""
    meta = layer.meta
    x = _dense(a["x"])
    y = torch.empty_like(x)
    if y.stride() != x.stride():
        y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    stats = {s: torch.empty(L.n_groups, dtype=torch.float32, device=x.device) for s in meta["stats"][mode]}
    if x.numel() == 0:
        for s in stats.values():
            s.fill_(math.nan)
        return y, stats
    values = {("x", "x"): x, ("y", "y"): y, **_common(meta, a)}
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
    return y, stats


def run_backward(layer: Layer, mode: str, a: dict, L: rt.Layout) -> tuple[torch.Tensor, dict, dict]:
    """(dx, {parameter: gradient}, {input: per-group gradient, float32}) by the mode's
    backward kernel and the reduction of the partial sums; ``a`` has dy, x as the forward
    read it, the parameters, inputs, buffers the statistics read, the statistics, options."""
    meta = layer.meta
    x = _dense(a["x"])
    dy = a["dy"]
    if dy.stride() != x.stride():
        dy = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(dy)
    dx = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
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
        values.update({("buffer", b): a[b].reshape(-1).contiguous() for b in meta["buffers"] if b in a})
        values.update({("stat", s): a[s].reshape(-1).to(torch.float32).contiguous() for s in meta["stats"][mode]})
        values.update({("dparam", p): parts[p] for p in meta["params"]})
        values.update({("dinput", i): dins[i] for i in meta["inputs"]})
        args = _kernel_args(layer.args[mode]["backward"], values, L)
        _check_runnable(layer.kernels[mode][1], x)
        layer.kernels[mode][1][(nprog,)](*args, *geo.values(), channels, **blk, PCHAN=pchan, **_warps(geo, blk))
    else:
        dx.zero_()
    dparams = {p: reduce_rows(parts[p], a[p].dtype).reshape(a[p].shape) for p in meta["params"]}
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
) -> tuple[torch.Tensor, Cache]:
    """``(y, cache)`` by the mode's forward kernel; running buffers given in training mode
    are updated in place."""
    meta = layer.meta
    name = meta["name"]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    mode = _mode(meta, training)
    params = {p: _tensor(v, x) if p in meta["scalar_params"] else v for p, v in params.items()}
    ins = {i: _tensor(v, x) for i, v in inputs.items()}
    a = {"x": x, **params, **ins, **options, "num_groups": num_groups or 0}
    if reads_buffers(meta, mode):
        missing = [b for b in meta["buffers"] if buffers.get(b) is None]
        if missing:
            raise ValueError(f"{name}: {mode} mode needs {missing[0]} (its statistics read it)")
    a.update({b: v for b, v in buffers.items() if v is not None})
    L = check_call(meta, mode, a)
    kept = {b: buffers[b].detach().clone() for b in meta["buffers"]} if reads_buffers(meta, mode) else {}
    with torch.no_grad():
        y, stats = run_forward(layer, mode, a, L, update=mode == "train" and x.numel() > 0)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != y.shape or out.dtype != y.dtype:
            raise ValueError(f"out must be a tensor of shape {tuple(y.shape)} and dtype {y.dtype}")
        y = out.copy_(y)
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
    )
    return y, cache


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


def backward(layer: Layer, dy: torch.Tensor, cache: Cache, out: Any = None) -> tuple:
    """``Grads(dx, d<param>..., d<input>...)`` by the mode's backward kernel."""
    meta = layer.meta
    cache = _check_cache(meta, cache)
    x = cache.x
    if not isinstance(dy, torch.Tensor) or tuple(dy.shape) != tuple(x.shape) or dy.dtype != x.dtype:
        got = f"{tuple(dy.shape)} {dy.dtype}" if isinstance(dy, torch.Tensor) else type(dy).__name__
        raise ValueError(f"{meta['name']}: dy must have the shape and dtype of x {tuple(x.shape)} {x.dtype}, got {got}")
    a = {"dy": dy.detach(), "x": x, **cache.params, **cache.inputs, **cache.buffers, **cache.options, **cache.stats}
    with torch.no_grad():
        dx, dparams, dins = run_backward(layer, cache.mode, a, cache.layout)
    got = [dx, *(dparams[p] for p in meta["params"])]
    for i in meta["inputs"]:
        given = cache.inputs[i]
        d = dins[i]
        got.append((d.double().sum() if given.numel() == 1 else d).to(x.dtype).reshape(given.shape))
    return layer.grads_type(*_store_all(tuple(got), out, layer.grads_type._fields))


def _torch_cache(layer: Layer, cache: Cache) -> tuple[Any, Any]:
    """The generated PyTorch module of the layer's spec and its cache at the same point."""
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
    _, tcache = tm.forward(cache.user_x, *(cache.params[p] for p in meta["params"]), **kw)
    return tm, tcache


def backward_backward(
    layer: Layer, dy: torch.Tensor, cache: Cache, ddx: Any, ddparams: Any, ddinputs: Any, out: Any
) -> tuple:
    """The double backward, by the PyTorch closed forms on the tensors' device."""
    tm, tcache = _torch_cache(layer, _check_cache(layer.meta, cache))
    return tm.backward_backward(dy, tcache, ddx, ddparams, ddinputs=ddinputs, out=out)


def jvp(layer: Layer, cache: Cache, tx: Any, tparams: Any, tinputs: Any, out: Any) -> torch.Tensor:
    """The forward-mode derivative, by the PyTorch closed forms on the tensors' device."""
    tm, tcache = _torch_cache(layer, _check_cache(layer.meta, cache))
    return tm.jvp(tcache, tx, tparams, tinputs=tinputs, out=out)
