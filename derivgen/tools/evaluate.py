"""Direct numeric evaluation of derived expressions for ONE normalization group.

A deliberately simple tree walk (no code generation, no lambdify): element-level
symbols map to 1-D float64 arrays over the group, group-level symbols to
scalars, ``Mean(e)`` to ``np.mean``.  It is the reference the tests and
``derivgen check`` compare generated code against, so it shares nothing with
the emitters.
"""

from __future__ import annotations

import numpy as np
import sympy

from derivgen.derive.first import G, ModeDerivation
from derivgen.spec.model import DY, N, X
from derivgen.symbolic import functions
from derivgen.symbolic.reduce import Mean


def evaluate(expr: sympy.Expr, env: dict[sympy.Symbol, object], mean=np.mean):
    """``expr`` over the values in ``env``; ``mean`` reduces a Mean's argument (default: the
    whole array, one group; derivgen.tools.baseline passes a mean over the group axes)."""
    if expr.is_Symbol:
        try:
            return env[expr]
        except KeyError:
            raise KeyError(f"no value for symbol {expr}") from None
    if expr.is_Number:
        return float(expr)
    if isinstance(expr, Mean):
        return mean(evaluate(expr.args[0], env, mean))
    if expr.is_Add:
        return sum(evaluate(a, env, mean) for a in expr.args)
    if expr.is_Mul:
        out = 1.0
        for a in expr.args:
            out = out * evaluate(a, env, mean)
        return out
    if expr.is_Pow:
        b = evaluate(expr.base, env, mean)
        e = expr.exp
        root = functions.half_power_sign(expr)
        if root:
            r = getattr(np, functions.half_power().numpy)(b)
            return r if root > 0 else 1.0 / r
        return np.power(b, float(e)) if not e.is_Integer else b ** int(e)
    fn = functions.of_node(expr)
    if fn is not None:                 # the table's NumPy function
        return getattr(np, fn.numpy)(*(evaluate(a, env, mean) for a in expr.args))
    raise TypeError(f"cannot evaluate {type(expr).__name__}: {expr}")


class GroupEvaluator:
    """Forward and closed-form backward of one mode on a single group."""

    def __init__(self, md: ModeDerivation):
        self.md = md
        self.spec = md.spec

    def forward(self, x, params: dict, scalars: dict):
        env = self._env(x, params, scalars)
        for st in self.md.statistics:          # with the auxiliaries the engine named
            env[st.symbol] = evaluate(st.expr, env)
        if self.spec.normalized is not None:
            env[self.spec.normalized.symbol] = evaluate(self.md.normalized_expr, env) * np.ones_like(x)
        if self.md.coordinate is not None:        # the backward's coordinate (x̂, or the centred x - μ)
            env[self.md.coordinate.symbol] = evaluate(self.md.coordinate_expr, env) * np.ones_like(x)
        y = evaluate(self.spec.output, env) * np.ones_like(x)
        return y, env

    def backward(self, dy, env):
        env = dict(env)
        env[DY] = dy
        if self.md.g is not None:
            env[G] = evaluate(self.md.g, env) * np.ones_like(dy)
        dx = evaluate(self.md.dx, env) * np.ones_like(dy)
        dparams = {}
        for p in self.spec.params:
            gr = self.md.grads[p.name]
            elem = evaluate(gr.element, env) * np.ones_like(dy)
            # a scalar parameter: its whole gradient from this group; per channel: per element
            dparams[p.name] = float(np.sum(elem) + evaluate(gr.group, env)) if p.scalar else elem
        dinputs = {k: float(evaluate(v, env)) for k, v in self.md.dinputs.items()}
        return dx, dparams, dinputs

    def _env(self, x, params, scalars):
        env: dict = {X: np.asarray(x, dtype=np.float64), N: float(len(x))}
        for p in self.spec.params:
            v = np.asarray(params[p.name], dtype=np.float64)
            env[p.symbol] = float(v.reshape(-1)[0]) if p.scalar else v
        for item in (*self.spec.options, *self.spec.inputs, *self.spec.buffers):
            if item.name in scalars:
                env[item.symbol] = float(scalars[item.name])
        return env
