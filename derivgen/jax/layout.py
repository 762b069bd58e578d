"""The layout of a JAX call: which axes of x's view make one normalization group.

x is viewed as 4-D: channels first ``(O, G, Cg, S)`` as in :mod:`derivgen.runtime`
(``(rows, 1, D, 1)`` for trailing layouts), or, for channel layouts with
``channels_last`` (Flax's convention, x of shape ``(N, *spatial, C)``),
``(N, S, G, Cg)``; then the axes of size 1 are dropped (``(rows, D)``). Parameters are views that broadcast against it, per-group values
(statistics, inputs, buffers) views of one value per group. A group sum is a sum over
the reduced axes with kept dimensions, and over the devices of ``axis_name`` when
it is set (batch layouts only): the statistics are then those of the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from derivgen.runtime.meta import MetaLike, layer_meta
from derivgen.runtime.validate import layout_from_shapes


@dataclass(frozen=True)
class JaxLayout:
    """x's view and what its groups reduce over (hashable: it keys compiled rules)."""

    view: tuple  # x as 4-D
    reduce_axes: tuple  # the axes of the view one group spans
    param_view: tuple  # a (non-scalar) parameter's broadcastable view
    stat_view: tuple  # a per-group value's broadcastable view
    param_axes: tuple  # the axes a parameter gradient is summed over
    n_local: int  # the values of one group held here
    x_shape: tuple
    param_shape: tuple  # a parameter's shape as users give it
    group_shape: tuple  # a per-group value's shape as users see it
    dtype: str  # the arithmetic's dtype (float32 at least)
    axis_name: object = None  # a named axis the groups span (batch layouts), or None
    axes4: tuple = (0, 1, 2, 3)  # the view's axis of each axis of (O, G, Cg, S); -1 where dropped

    @property
    def scalar_view(self) -> tuple:
        """A scalar's view: ones, one per axis of x's view."""
        return (1,) * len(self.view)

    @property
    def N(self):
        """The size of one whole group (over the devices of ``axis_name`` too)."""
        if self.axis_name is None:
            return self.n_local
        return self.n_local * jax.lax.psum(1, self.axis_name)

    def _array(self, a):
        return jnp.asarray(a, dtype=self.dtype)

    def _ranked(self, e):
        """``e`` as an array of the view's rank (leading axes of size 1 added): a value that
        broadcasts against x, not broadcast."""
        e = self._array(e)
        return e.reshape((1,) * (len(self.view) - e.ndim) + e.shape)

    def _kept(self, axes) -> tuple:
        """The view with ``axes`` reduced to 1: the shape a reduction over them keeps."""
        return tuple(1 if a in axes else n for a, n in enumerate(self.view))

    def _total(self, e, axes):
        """The sum over ``axes`` of ``e`` broadcast to x, without writing the broadcast: axes
        along which ``e`` does not vary count by their length."""
        e = self._ranked(e)
        here = tuple(a for a in axes if e.shape[a] != 1)
        count = math.prod(self.view[a] for a in axes if e.shape[a] == 1)
        s = jnp.sum(e, axis=here, keepdims=True) if here else e
        return jnp.broadcast_to(s * count if count != 1 else s, self._kept(axes))

    def _select(self, e, f):
        """``f`` (jnp.max, jnp.min) over each group of ``e`` broadcast to x."""
        e = self._ranked(e)
        here = tuple(a for a in self.reduce_axes if e.shape[a] != 1)
        return jnp.broadcast_to(f(e, axis=here, keepdims=True) if here else e, self._kept(self.reduce_axes))

    def sum(self, e):
        """The sum over each group of the element values ``e`` (broadcast to x: a
        parameter counts once per element), kept as a per-group view."""
        s = self._total(e, self.reduce_axes)
        return s if self.axis_name is None else jax.lax.psum(s, self.axis_name)

    def max(self, e):
        """The maximum over each group (over the devices of ``axis_name`` too)."""
        m = self._select(e, jnp.max)
        return m if self.axis_name is None else jax.lax.pmax(m, self.axis_name)

    def min(self, e):
        """The minimum over each group (over the devices of ``axis_name`` too)."""
        m = self._select(e, jnp.min)
        return m if self.axis_name is None else jax.lax.pmin(m, self.axis_name)

    def window(self, u, k, transposed=False):
        """``window(u, k)`` (:mod:`derivgen.symbolic.window`) along the group's axis: at each
        element i the sum of u over elements i - ⌊k/2⌋ .. i + ⌊(k-1)/2⌋ of its group, zero
        padded past the group's ends (``transposed``: i - ⌊(k-1)/2⌋ .. i + ⌊k/2⌋). k is an
        option, a Python number (static under ``jit``). One ``lax.reduce_window`` sum (JAX
        transposes it into another): a window of shifted slices of u, added, let XLA's CPU
        fusion evaluate u afresh at each of the k offsets -- in LRN's transposed JVP k powers
        per element where one does."""
        full = jnp.broadcast_to(self._array(u), self.view)
        axes = [a for a in self.reduce_axes if self.view[a] != 1]
        if not axes:  # a group of one element: the window holds it alone
            return full
        (axis,) = axes  # windows are only in layouts whose groups lie along one axis
        n, k = self.view[axis], int(k)
        lo, hi = k // 2, (k - 1) // 2
        if transposed:
            lo, hi = hi, lo
        lo, hi = min(lo, n - 1), min(hi, n - 1)  # offsets past the group only add padding
        dims, pad = [1] * len(self.view), [(0, 0)] * len(self.view)
        dims[axis], pad[axis] = lo + hi + 1, (lo, hi)
        return jax.lax.reduce_window(full, np.zeros((), full.dtype), jax.lax.add, tuple(dims), (1,) * len(dims), pad)

    def block_mean(self, u, axes):
        """``mean(u, kind)`` (:mod:`derivgen.symbolic.block`): the mean of u over each block,
        the ``axes`` of the (O, G, Cg, S) view one block spans (blocks lie inside a group: on
        this device, never across ``axis_name``), one value per block: a view that broadcasts
        against x (an element's block mean is its block's), not broadcast to x's shape. u may
        itself be one value per smaller block: the mean of block means over a coarser block."""
        u = self._ranked(u)
        mine = tuple(self.axes4[a] for a in axes if self.axes4[a] >= 0 and u.shape[self.axes4[a]] != 1)
        return jnp.mean(u, axis=mine, keepdims=True) if mine else u

    def mean(self, e):
        """The mean over each group."""
        return self.sum(e) / self.N

    def mean_prod(self, a, b=None):
        """The mean over each group of a*b (of a² with one argument)."""
        return self.mean(a * (a if b is None else b))

    def stat(self, v):
        """A per-group value as a view of one value per group."""
        return jnp.broadcast_to(self._array(v), self.stat_view)

    def full(self, v):
        """An element value (y, a tangent, dx) with x's view."""
        return jnp.broadcast_to(self._array(v), self.view)

    def param_sum(self, e, scalar=False):
        """A parameter gradient: element contributions summed over the axes it does not span
        (everything for a scalar); the part held here under ``axis_name``."""
        if scalar:
            return self._total(e, tuple(range(len(self.view)))).reshape(self.scalar_view)
        return self._total(e, self.param_axes)

    def group_total(self, v):
        """The sum over the groups of a per-group value (a scalar parameter in the statistics)."""
        return jnp.sum(self.stat(v)).reshape(self.scalar_view)


def _squeezed(view, reduce_axes, param_view, stat_view, param_axes, order=(0, 1, 2, 3)) -> dict:
    """The view without its axes of size 1 (XLA's CPU code is several times slower on arrays
    with trailing unit axes); every other view loses the same axes. ``order`` gives the axis
    of (O, G, Cg, S) each axis of ``view`` is."""
    keep = [i for i, n in enumerate(view) if n != 1] or [len(view) - 1]
    new = {i: k for k, i in enumerate(keep)}
    return {
        "axes4": tuple(new.get(order.index(a), -1) for a in range(4)),
        "view": tuple(view[i] for i in keep),
        "reduce_axes": tuple(new[i] for i in reduce_axes if i in new),
        "param_view": tuple(param_view[i] for i in keep),
        "stat_view": tuple(stat_view[i] for i in keep),
        "param_axes": tuple(new[i] for i in param_axes if i in new),
    }


def make_layout(
    meta: MetaLike,
    x_shape: tuple,
    param_shapes: dict,
    num_groups: int | None,
    dtype,
    *,
    channels_last: bool = False,
    axis_name=None,
) -> JaxLayout:
    """The layout of x (shape ``x_shape``) for the layer ``meta`` (errors name the argument)."""
    meta = layer_meta(meta)
    x_shape = tuple(int(d) for d in x_shape)
    if math.prod(x_shape) == 0:
        raise ValueError(f"{meta.name}: x is empty (shape {x_shape})")
    if axis_name is not None and meta.reduce != "batch":
        raise ValueError(
            f"{meta.name}: axis_name makes batch statistics collective; this layer's groups lie within a "
            "sample, so every device already holds whole groups (run it under pmap/shard_map as it is)"
        )
    kind = meta.layout
    if channels_last and kind == "channels":
        first = (x_shape[0], x_shape[-1], *x_shape[1:-1])  # as channels first, for the shape checks
        L = layout_from_shapes(meta, first, param_shapes, num_groups)
        n, s = x_shape[0], L.S
        per_sample = L.per_sample
        if L.per_position:  # a group is one (sample, position): its channels, contiguous here
            reduce_axes, stat = (2, 3), (n, s, 1, 1)
        else:
            reduce_axes = (1, 3) if per_sample else (0, 1, 3)
            stat = (n, 1, L.G, 1) if per_sample else (1, 1, L.G, 1)
        views = _squeezed((n, s, L.G, L.Cg), reduce_axes, (1, 1, L.G, L.Cg), stat, (0, 1), order=(0, 3, 1, 2))
    else:
        L = layout_from_shapes(meta, x_shape, param_shapes, num_groups)
        views = _squeezed(L.view4, L.reduce_axes, L.param4, L.stat4, L.param_axes)
    return JaxLayout(
        **views,
        n_local=L.group_size,
        x_shape=x_shape,
        param_shape=L.param_shape,
        group_shape=L.group_shape,
        dtype=str(jnp.dtype(dtype)),
        axis_name=axis_name,
    )
