"""The launches of a layer's generated Triton kernels: the :class:`Layer` a generated module
carries (its ``LAYER``), the geometry of a group (:func:`geometry`: A rows and B columns of x),
the tile and block sizes, the programs, the kernels' arguments by role, and the forward and
backward kernels run (:func:`run_forward`, :func:`run_backward`) for :mod:`derivgen.triton.calls`
and :mod:`derivgen.triton.ops`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

from derivgen import runtime as rt
from derivgen.runtime.abi import grad_tensor_names, tensor_names
from derivgen.runtime.meta import LayerMeta, layer_meta
from derivgen.runtime.tensors import broadcast_axes
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

    meta: LayerMeta
    kernels: dict[str, tuple[Callable, Callable]]
    args: dict[str, dict[str, list[tuple[str, str]]]]
    grads_type: type
    second_type: type
    spec: Any = None

    def __post_init__(self) -> None:
        self.meta = layer_meta(self.meta)  # the module's META dict, typed once


# ---- the geometry of the kernels


def dense(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: channels-first or channels-last memory, else a contiguous copy."""
    if x.is_contiguous():
        return x
    if x.dim() in (4, 5):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        if x.is_contiguous(memory_format=fmt):
            return x
    return x.contiguous()


def geometry(meta: LayerMeta, L: rt.Layout, x: torch.Tensor) -> dict:
    """The kernels' layout arguments for x (as :func:`dense` made it): groups, the first
    element of group g of sample o at ``o*sO + g*Cg*sC``, each group an A x B matrix with
    strides sA, sB, and where the parameters' channel runs (PCHAN: 0 one per group, 1 along
    the rows, 2 along the columns)."""
    geo = {"NGroups": L.n_groups, "G": L.G, "Cg": L.Cg}
    if meta.layout == "trailing":
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
        raise NotImplementedError(f"{meta.name}: batch statistics over groups of several channels")
    return {**geo, "sO": 0, "sC": sCh, "A": L.O, "B": L.S, "sA": sN, "sB": sS, "PCHAN": 0}


def at_x(meta: LayerMeta, name: str, t: torch.Tensor, x: torch.Tensor, L: rt.Layout) -> torch.Tensor:
    """A tensor input as the kernels read it: at x's shape and strides (``x`` as :func:`dense`
    made it), a broadcast one written out over the axes it is broadcast over."""
    if tuple(t.shape) != tuple(x.shape):
        shape = list(x.shape)
        for ax in broadcast_axes(meta, meta.tensors[name][0], L):
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


def finish_tensor_grad(
    meta: LayerMeta, name: str, buf: torch.Tensor, given: torch.Tensor, L: rt.Layout
) -> torch.Tensor:
    """A tensor input's gradient from its element gradients ``buf`` (x's shape): summed over
    the axes the input ``given`` was broadcast over, in its shape and dtype."""
    if tuple(buf.shape) == tuple(given.shape):
        return buf if buf.dtype == given.dtype else buf.to(given.dtype)
    axes = broadcast_axes(meta, meta.tensors[name][0], L)
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


def _common(meta: LayerMeta, a: dict) -> dict:
    """Kernel arguments by (role, spec name) that forward and backward share."""
    v: dict = {("param", p): a[p].reshape(-1).contiguous() for p in meta.params}
    v.update({("input", i): a[i] for i in meta.inputs})
    v.update({("option", o): float(a[o]) for o in meta.options})
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
    x = dense(a["x"])
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    extra = {o: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for o in meta.outputs}
    ys = (y, *extra.values()) if extra else y
    stats = {s: torch.empty(L.n_groups, dtype=torch.float32, device=x.device) for s in meta.stats[mode]}
    if x.numel() == 0:
        for s in stats.values():
            s.fill_(math.nan)
        return ys, stats
    values = {("x", "x"): x, ("y", "y"): y, **_common(meta, a)}
    values.update({("tensor", t): at_x(meta, t, a[t], x, L) for t in tensor_names(meta)})
    values.update({("output", o): v for o, v in extra.items()})
    values.update({("stat", s): t for s, t in stats.items()})
    given = {b: a.get(b) for b in meta.buffers}
    copies = {}
    for b, v in given.items():
        if v is None:
            values["buffer", b] = x  # not read: a placeholder pointer
            continue
        flat = v.reshape(-1)
        copies[b] = flat if flat.is_contiguous() and flat.data_ptr() == v.data_ptr() else flat.contiguous()
        values["buffer", b] = copies[b]
    up = bool(update and meta.buffers and all(v is not None for v in given.values()))
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
    x = dense(a["x"])
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
    scalar = set(meta.scalar_params)
    channels = L.G * L.Cg
    parts = {
        p: torch.zeros((nprog, 1 if p in scalar else channels), dtype=torch.float32, device=x.device)
        for p in meta.params
    }
    dins = {i: torch.zeros(L.n_groups, dtype=torch.float32, device=x.device) for i in meta.inputs}
    if x.numel():
        values = {("x", "x"): x, ("dy", "dy"): dy, ("dx", "dx"): dx, **_common(meta, a)}
        values.update({("tensor", t): at_x(meta, t, a[t], x, L) for t in tensor_names(meta)})
        values.update({("cotangent", o): _like_x(a.get("d" + o), x) for o in meta.outputs})
        values.update({("dtensor", t): v for t, v in dts.items()})
        values.update({("buffer", b): a[b].reshape(-1).contiguous() for b in meta.buffers if b in a})
        values.update({("stat", s): a[s].reshape(-1).to(torch.float32).contiguous() for s in meta.stats[mode]})
        values.update({("dparam", p): parts[p] for p in meta.params})
        values.update({("dinput", i): dins[i] for i in meta.inputs})
        args = _kernel_args(layer.args[mode]["backward"], values, L)
        _check_runnable(layer.kernels[mode][1], x)
        layer.kernels[mode][1][(nprog,)](*args, *geo.values(), channels, **blk, PCHAN=pchan, **_warps(geo, blk))
    else:
        dx.zero_()
        for v in dts.values():
            v.zero_()
    dparams = {p: reduce_rows(parts[p], a[p].dtype).reshape(a[p].shape) for p in meta.params}
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
