"""The argument-validation contract shared by every backend: NumPy and C
(:mod:`derivgen.runtime`) and PyTorch (:mod:`derivgen.torch`).

The checks work on shapes, dtypes and Python numbers, whatever holds the data (NumPy
arrays, tensors), so each backend runs the same checks with the same messages; the
backends add what only they have (array types, devices, memory overlap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from derivgen.runtime.abi import reads_buffers
from derivgen.runtime.meta import MetaLike, layer_meta


@dataclass
class Layout:
    """x as a 4-D view (O, G, Cg, S) and the shapes users see (see derivgen.runtime).

    O outer (samples or rows), G groups of channels, Cg channels per group, S inner
    (spatial); ``per_sample`` is false only for batch statistics (a group spans the samples);
    ``per_position``: a group is one (sample, position), its Cg values strided by S
    (G == 1), and per-group values run over (O, S).
    """

    O: int
    G: int
    Cg: int
    S: int
    per_sample: bool
    x_shape: tuple
    param_shape: tuple
    group_shape: tuple  # shape users see for per-group values (stats, inputs, buffers)
    per_position: bool = False

    @property
    def n_groups(self) -> int:
        """How many normalization groups: O*G per sample (O*S per position), else G."""
        if self.per_position:
            return self.O * self.S
        return self.O * self.G if self.per_sample else self.G

    @property
    def group_size(self) -> int:
        """Values in one group: Cg*S per sample (Cg per position), else O*Cg*S."""
        if self.per_position:
            return self.Cg
        return self.Cg * self.S * (1 if self.per_sample else self.O)

    @property
    def view4(self) -> tuple:
        """The 4-D view of x, ``(O, G, Cg, S)``."""
        return (self.O, self.G, self.Cg, self.S)

    @property
    def stat4(self) -> tuple:
        """A per-group value's broadcastable 4-D shape: ``(O, G, 1, 1)`` per sample
        (``(O, 1, 1, S)`` per position), else ``(1, G, 1, 1)``."""
        if self.per_position:
            return (self.O, 1, 1, self.S)
        return (self.O, self.G, 1, 1) if self.per_sample else (1, self.G, 1, 1)

    @property
    def param4(self) -> tuple:
        """A parameter's broadcastable 4-D shape, ``(1, G, Cg, 1)``."""
        return (1, self.G, self.Cg, 1)

    @property
    def reduce_axes(self) -> tuple:
        """Axes of the 4-D view a statistic reduces over: (Cg, S), and O too when not per
        sample; Cg alone per position."""
        if self.per_position:
            return (2,)
        return (2, 3) if self.per_sample else (0, 2, 3)

    @property
    def param_axes(self) -> tuple:
        """Axes of the 4-D view a parameter gradient is summed over."""
        return (0, 3)


def check_float(name: str, v: Any, lo: float | None = None, hi: float | None = None) -> float:
    """A real number as a float, finite and within [lo, hi] (None: unbounded)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {f}")
    if lo is not None and f < lo or hi is not None and f > hi:
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"{name} must lie in {rng}, got {f}")
    return f


def scalar_params(meta: MetaLike, params: dict, dtype: Any) -> dict:
    """``params`` with every scalar parameter given as a Python or NumPy number (``0.7``,
    ``np.float32(0.7)``) as a 0-d array of ``dtype`` (x's); anything else is left for the
    array checks."""
    meta = layer_meta(meta)
    out = dict(params)
    for pname in meta.scalar_params:
        v = out.get(pname)
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
            out[pname] = np.asarray(check_float(f"{meta.name}: {pname}", v), dtype=dtype)
    return out


def bind_arguments(meta: MetaLike, params: Sequence[Any], kw: dict) -> dict:
    """The arguments of a functional call ``f(x, *params, **kw)`` by name: parameters by
    position or keyword (not both), every other name one the layer declares, every parameter
    given; errors name the layer and the argument."""
    meta = layer_meta(meta)
    name = meta.name
    if len(params) > len(meta.params):
        raise TypeError(
            f"{name}: takes x and {len(meta.params)} parameter(s) {meta.params} positionally, got {len(params)}"
        )
    given = dict(zip(meta.params, params))
    twice = set(given) & set(kw)
    if twice:
        raise TypeError(f"{name}: parameter(s) {sorted(twice)} given both by position and by keyword")
    kw = {**given, **kw}
    known = {*meta.params, *meta.inputs, *meta.options, *meta.buffers}
    unknown = set(kw) - known
    if unknown:
        raise TypeError(f"{name}: unknown argument(s) {sorted(unknown)}; arguments are {sorted(known)}")
    for p in meta.params:
        if p not in kw:
            raise TypeError(f"{name}: parameter {p} is required")
    return kw


def leading_count(p: float, n: int) -> int:
    """How many leading features ``leading(p)`` selects of ``n``: ⌊p·n⌋ (the product in
    double, truncated as C's cast and Python's ``int`` do), within 0..n."""
    return min(max(int(p * n), 0), n)


def layout_from_shapes(
    meta: MetaLike, x_shape: Sequence[int], param_shapes: dict[str, Sequence[int]], num_groups: int | None
) -> Layout:
    """The 4-D view of x from shapes alone (derivgen.torch calls it on fake and symbolic
    shapes too), with errors naming the argument."""
    meta = layer_meta(meta)
    kind, red = meta.layout, meta.reduce
    name = meta.name
    x_shape = tuple(x_shape)
    nd = len(x_shape)
    if kind == "trailing":
        spanning = [p for p in meta.params if p not in meta.scalar_params]
        if spanning:
            p0, first = spanning[0], tuple(param_shapes[spanning[0]])
            k = len(first)
            if k == 0:
                raise ValueError(f"{name}: {p0} must have at least one dimension (it defines the normalized axes)")
            if nd < k or x_shape[nd - k :] != first:
                raise ValueError(
                    f"{name}: {p0} has shape {first}, which must equal the trailing axes of x (shape {x_shape})"
                )
        else:
            k = meta.axes
            if nd < k:
                raise ValueError(f"{name}: x must have at least {k} dimension(s), got shape {x_shape}")
        lead = x_shape[: nd - k]
        norm = x_shape[nd - k :]
        return Layout(
            O=math.prod(lead),
            G=1,
            Cg=math.prod(norm),
            S=1,
            per_sample=True,
            x_shape=x_shape,
            param_shape=norm,
            group_shape=lead,
        )
    # channel layouts: x is (N, C, *spatial)
    min_nd = 3 if red == "instance" else 2
    if nd < min_nd:
        raise ValueError(
            f"{name}: x must have shape (N, C{', *spatial' if min_nd == 2 else ', L, ...'}) "
            f"with at least {min_nd} dimensions, got {x_shape}"
        )
    n, c = x_shape[0], x_shape[1]
    S = math.prod(x_shape[2:])
    if red == "batch":
        return Layout(O=n, G=c, Cg=1, S=S, per_sample=False, x_shape=x_shape, param_shape=(c,), group_shape=(c,))
    if red == "instance":
        return Layout(O=n, G=c, Cg=1, S=S, per_sample=True, x_shape=x_shape, param_shape=(c,), group_shape=(n, c))
    if red == "all":  # one group: the whole tensor, its channels along Cg
        return Layout(O=n, G=1, Cg=c, S=S, per_sample=False, x_shape=x_shape, param_shape=(c,), group_shape=())
    if red == "position":
        return Layout(
            O=n,
            G=1,
            Cg=c,
            S=S,
            per_sample=True,
            x_shape=x_shape,
            param_shape=(c,),
            group_shape=(n, *x_shape[2:]),
            per_position=True,
        )
    if isinstance(num_groups, (bool, np.bool_)) or not isinstance(num_groups, (int, np.integer)):
        raise TypeError(f"{name}: num_groups must be an int, got {type(num_groups).__name__}")
    G = int(num_groups)
    if G <= 0 or c % G:
        raise ValueError(f"{name}: num_groups={G} must be positive and divide the number of channels C={c}")
    return Layout(O=n, G=G, Cg=c // G, S=S, per_sample=True, x_shape=x_shape, param_shape=(c,), group_shape=(n, G))


def check_not_empty(meta: MetaLike, x_shape: Sequence[int]) -> None:
    """x holds at least one value."""
    meta = layer_meta(meta)
    if math.prod(x_shape) == 0:
        raise ValueError(f"{meta.name}: x is empty (shape {tuple(x_shape)})")


def check_same_dtype(meta: MetaLike, what: str, dtype: Any, x_dtype: Any, hint: str = "") -> None:
    """An argument has x's dtype (``hint`` ends the message)."""
    meta = layer_meta(meta)
    if dtype != x_dtype:
        raise TypeError(f"{meta.name}: {what} has dtype {dtype} but x has {x_dtype}{hint}")


def check_param_shapes(meta: MetaLike, shapes: dict, layout: Layout) -> None:
    """Every parameter has the shape of the normalized channels (a scalar one: () or (1,))."""
    meta = layer_meta(meta)
    for pname in meta.params:
        shape = tuple(shapes[pname])
        if pname in meta.scalar_params:
            if math.prod(shape) != 1 or len(shape) > 1:
                raise ValueError(f"{meta.name}: {pname} is a scalar parameter: shape () or (1,), got {shape}")
        elif shape != tuple(layout.param_shape):
            raise ValueError(f"{meta.name}: {pname} must have shape {tuple(layout.param_shape)}, got {shape}")


def check_group_size(meta: MetaLike, mode: str, layout: Layout) -> None:
    """Each normalization group holds at least the mode's minimum number of values."""
    meta = layer_meta(meta)
    need = meta.min_group_size[mode]
    if layout.group_size < need:
        raise ValueError(
            f"{meta.name}: {mode} mode needs at least {need} values per normalization group, "
            f"got {layout.group_size} (x shape {tuple(layout.x_shape)})"
        )


def check_options(meta: MetaLike, options: dict) -> dict[str, float]:
    """Every option given, a finite float within its declared range (a whole number for an
    integer option: a window's size)."""
    meta = layer_meta(meta)
    opts = {}
    whole = set(meta.integer_options)
    for oname, (_, lo, hi) in meta.options.items():
        v = options.get(oname)
        if v is None:
            raise TypeError(f"{meta.name}: option {oname} is required")
        opts[oname] = check_float(oname, v, lo, hi)
        if oname in whole and opts[oname] != int(opts[oname]):
            raise ValueError(f"{oname} must be a whole number, got {opts[oname]}")
    return opts


def is_scalar_shape(shape: Sequence[int]) -> bool:
    """A per-group input given as one value: shape () or (1,)."""
    return math.prod(shape) == 1 and len(shape) <= 1


def check_input_shape(meta: MetaLike, iname: str, shape: Sequence[int], layout: Layout) -> None:
    """A per-group input is a scalar or has one value per group."""
    meta = layer_meta(meta)
    if not is_scalar_shape(shape) and tuple(shape) != tuple(layout.group_shape):
        raise ValueError(
            f"{meta.name}: {iname} must be a scalar or have shape {tuple(layout.group_shape)}, got {tuple(shape)}"
        )


def check_buffer_shape(meta: MetaLike, bname: str, shape: Sequence[int], layout: Layout) -> None:
    """A running buffer has one value per group."""
    meta = layer_meta(meta)
    if tuple(shape) != tuple(layout.group_shape):
        raise ValueError(f"{meta.name}: {bname} must have shape {tuple(layout.group_shape)}, got {tuple(shape)}")


def check_call_shapes(meta: MetaLike, mode: str, a: dict, groups: int | None) -> Layout:
    """The shape part of a forward call's contract on arrays or tensors by spec name (their
    dtypes and devices checked by the caller): x's layout, the parameters', inputs' and read
    buffers' shapes, the group size (not for an empty x: it normalizes to an empty y, as in
    torch.nn) and the options' ranges. Returns the layout."""
    meta = layer_meta(meta)
    x = a["x"]
    L = layout_from_shapes(
        meta,
        tuple(x.shape),
        {p: tuple(a[p].shape) for p in meta.params},
        groups if meta.reduce == "group" else None,
    )
    check_param_shapes(meta, {p: a[p].shape for p in meta.params}, L)
    if math.prod(x.shape):
        check_group_size(meta, mode, L)
    check_options(meta, {o: a[o] for o in meta.options})
    for i in meta.inputs:
        check_input_shape(meta, i, tuple(a[i].shape), L)
    for b in meta.buffers if reads_buffers(meta, mode) else ():
        check_buffer_shape(meta, b, tuple(a[b].shape), L)
    return L
