"""Plain NumPy for any spec: the forward and backward a person writes by hand from the
layer's formulas, as a baseline for ``derivgen bench --spec``.

Whole arrays in their own dtype, one NumPy call per operation, means over the group
axes with ``keepdims`` -- no chunking, no threads, no fused loops: what the generated
NumPy and C are measured against. The formulas are the derivation's (statistics in
order, the closed-form backward), walked by :func:`derivgen.tools.evaluate.evaluate`;
nothing is generated or evaluated as text.
"""

from __future__ import annotations

import numpy as np

from derivgen.derive.first import G, ModeDerivation
from derivgen.runtime import Layout
from derivgen.spec.model import DY, N, X
from derivgen.tools.evaluate import evaluate


class PlainNumPy:
    """One mode's forward and backward over whole arrays in the (O, G, Cg, S) view of ``layout``."""

    def __init__(self, mode: ModeDerivation, layout: Layout):
        self.mode, self.spec, self.layout = mode, mode.spec, layout

    def _mean(self, a: np.ndarray) -> np.ndarray:
        """The mean over each group's axes, kept as size-1 axes."""
        layout = self.layout
        return np.mean(np.broadcast_to(a, layout.view4), axis=layout.reduce_axes, keepdims=True)

    def _extreme(self, a: np.ndarray, kind: str) -> np.ndarray:
        """The group max() or min() over each group's axes, kept as size-1 axes."""
        layout = self.layout
        pick = np.min if kind == "min" else np.max
        return pick(np.broadcast_to(a, layout.view4), axis=layout.reduce_axes, keepdims=True)

    def _block(self, a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        """A block mean over the axes of (O, G, Cg, S) its blocks span, kept as size-1 axes."""
        return np.mean(np.broadcast_to(a, self.layout.view4), axis=tuple(axes), keepdims=True)

    def _eval(self, expr, env: dict):
        """``expr`` over whole arrays: group means, maxima and block means as NumPy reductions."""
        return evaluate(expr, env, self._mean, self._extreme, self._block)

    def _group(self, v: object) -> float | np.ndarray:
        """A per-group value (input, buffer) as a scalar or in the statistics' shape."""
        v = np.asarray(v)
        return float(v.reshape(-1)[0]) if v.size == 1 else v.reshape(self.layout.stat4)

    def forward(self, x: np.ndarray, params: list[np.ndarray], kw: dict) -> tuple[np.ndarray, dict]:
        """y and the values the backward needs (a dict of arrays and scalars); ``kw`` holds the
        options, inputs and buffers by name."""
        layout, mode, spec = self.layout, self.mode, self.spec
        env: dict = {X: x.reshape(layout.view4), N: float(layout.group_size)}
        for p, v in zip(spec.params, params):
            env[p.symbol] = float(np.asarray(v).reshape(-1)[0]) if p.scalar else v.reshape(layout.param4)
        for o in spec.options:
            env[o.symbol] = float(kw.get(o.name, o.default))
        for item in (*spec.inputs, *spec.buffers):
            if kw.get(item.name) is not None:
                env[item.symbol] = self._group(kw[item.name])
        for st in mode.statistics:
            env[st.symbol] = self._eval(st.expr, env)
        for st in mode.blocks:  # one value per block, broadcast over its elements
            env[st.symbol] = self._eval(st.expr, env)
        if spec.normalized is not None:
            env[spec.normalized.symbol] = self._eval(mode.normalized_expr, env)
        if mode.coordinate is not None:
            env[mode.coordinate.symbol] = self._eval(mode.coordinate_expr, env)
        y = self._eval(spec.output, env)
        return np.broadcast_to(y, layout.view4).reshape(layout.x_shape), env

    def backward(self, dy: np.ndarray, env: dict) -> list:
        """[dx, the parameters' gradients..., the inputs' gradients...] at cotangent ``dy``, each
        in its argument's shape."""
        layout, mode, spec = self.layout, self.mode, self.spec
        env = dict(env)
        env[DY] = dy.reshape(layout.view4)
        if mode.g is not None:
            env[G] = self._eval(mode.g, env)
        dx = np.broadcast_to(self._eval(mode.dx, env), layout.view4).reshape(layout.x_shape)
        grads = [dx]
        for p in spec.params:
            grad = mode.grads[p.name]
            elem = np.broadcast_to(self._eval(grad.element, env), layout.view4)
            group = np.sum(np.broadcast_to(self._eval(grad.group, env), layout.stat4))
            if p.scalar:
                grads.append(np.sum(elem) + group)
            else:
                grads.append(np.sum(elem, axis=layout.param_axes).reshape(layout.param_shape))
        for i in spec.inputs:  # in the input's shape: one value, or one per group
            gi = np.broadcast_to(self._eval(mode.dinputs[i.name], env), layout.stat4)
            scalar = not isinstance(env.get(i.symbol), np.ndarray)
            grads.append(np.sum(gi) if scalar else gi.reshape(layout.group_shape))
        return grads

    def step(self, x: np.ndarray, params: list[np.ndarray], dy: np.ndarray, kw: dict) -> tuple[np.ndarray, list]:
        """Forward then backward: (y, the backward's gradients)."""
        y, env = self.forward(x, params, kw)
        return y, self.backward(dy, env)
