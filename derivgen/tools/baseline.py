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
    def __init__(self, md: ModeDerivation, layout: Layout):
        self.md, self.spec, self.L = md, md.spec, layout

    def _mean(self, a):
        L = self.L
        return np.mean(np.broadcast_to(a, L.view4), axis=L.reduce_axes, keepdims=True)

    def _group(self, v):
        """A per-group value (input, buffer) as a scalar or in the statistics' shape."""
        v = np.asarray(v)
        return float(v.reshape(-1)[0]) if v.size == 1 else v.reshape(self.L.stat4)

    def forward(self, x, params, kw):
        """y and the values the backward needs (a dict of arrays and scalars)."""
        L, md, spec = self.L, self.md, self.spec
        env: dict = {X: x.reshape(L.view4), N: float(L.group_size)}
        for p, v in zip(spec.params, params):
            env[p.symbol] = float(np.asarray(v).reshape(-1)[0]) if p.scalar else v.reshape(L.param4)
        for o in spec.options:
            env[o.symbol] = float(kw.get(o.name, o.default))
        for item in (*spec.inputs, *spec.buffers):
            if kw.get(item.name) is not None:
                env[item.symbol] = self._group(kw[item.name])
        for st in md.statistics:
            env[st.symbol] = evaluate(st.expr, env, self._mean)
        if spec.normalized is not None:
            env[spec.normalized.symbol] = evaluate(md.normalized_expr, env, self._mean)
        if md.coordinate is not None:
            env[md.coordinate.symbol] = evaluate(md.coordinate_expr, env, self._mean)
        y = evaluate(spec.output, env, self._mean)
        return np.broadcast_to(y, L.view4).reshape(L.x_shape), env

    def backward(self, dy, env):
        L, md, spec = self.L, self.md, self.spec
        env = dict(env)
        env[DY] = dy.reshape(L.view4)
        if md.g is not None:
            env[G] = evaluate(md.g, env, self._mean)
        dx = np.broadcast_to(evaluate(md.dx, env, self._mean), L.view4).reshape(L.x_shape)
        grads = [dx]
        for p in spec.params:
            gr = md.grads[p.name]
            elem = np.broadcast_to(evaluate(gr.element, env, self._mean), L.view4)
            group = np.sum(np.broadcast_to(evaluate(gr.group, env, self._mean), L.stat4))
            if p.scalar:
                grads.append(np.sum(elem) + group)
            else:
                grads.append(np.sum(elem, axis=L.param_axes).reshape(L.param_shape))
        for i in spec.inputs:                   # in the input's shape: one value, or one per group
            gi = np.broadcast_to(evaluate(md.dinputs[i.name], env, self._mean), L.stat4)
            scalar = not isinstance(env.get(i.symbol), np.ndarray)
            grads.append(np.sum(gi) if scalar else gi.reshape(L.group_shape))
        return grads

    def step(self, x, params, dy, kw):
        y, env = self.forward(x, params, kw)
        return y, self.backward(dy, env)
