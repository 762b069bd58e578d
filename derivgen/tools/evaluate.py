"""Direct numeric evaluation of derived expressions for ONE normalization group.

A deliberately simple tree walk (no code generation, no lambdify): element-level
symbols map to 1-D float64 arrays over the group, group-level symbols to
scalars, ``Mean(e)`` to ``np.mean``.  It is the reference the tests and
``derivgen check`` compare generated code against, so it shares nothing with
the emitters.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import sympy

from derivgen.derive.first import G, ModeDerivation
from derivgen.runtime.elementwise import numpy_function
from derivgen.runtime.validate import leading_count
from derivgen.spec.model import DY, N, X
from derivgen.symbolic import functions
from derivgen.symbolic.block import BlockMean
from derivgen.symbolic.reduce import GroupMax, GroupMin, Mean
from derivgen.symbolic.window import Window, offsets


def evaluate(
    expr: sympy.Expr,
    env: dict[sympy.Symbol, object],
    mean: Callable = np.mean,
    extreme: Callable | None = None,
    block: Callable | None = None,
) -> object:
    """``expr`` over the values in ``env``; ``mean`` reduces a Mean's argument (default: the
    whole array, one group; derivgen.tools.baseline passes a mean over the group axes),
    ``extreme(values, "max" | "min")`` a group max()/min() (default: over the whole array), and
    ``block(values, axes)`` a block mean over the axes of (O, G, Cg, S) its blocks span."""
    if expr.is_Symbol:
        try:
            return env[expr]
        except KeyError:
            raise KeyError(f"no value for symbol {expr}") from None
    if expr.is_number:  # 2, 1/2, pi, sqrt(pi)
        return float(expr)
    if isinstance(expr, BlockMean):
        if block is None:
            raise TypeError(f"a block mean needs the group's shape: {expr}")
        return block(evaluate(expr.body, env, mean, extreme, block), expr.axes)
    if isinstance(expr, Mean):
        return mean(evaluate(expr.args[0], env, mean, extreme, block))
    if isinstance(expr, Window):  # one group: the elements in order, none past the ends
        n = len(env[X])
        u = np.broadcast_to(np.asarray(evaluate(expr.body, env, mean, extreme, block), dtype=np.float64), (n,))
        near = offsets(int(evaluate(expr.size, env, mean, extreme, block)), expr.transposed)
        return np.array([sum(u[i + d] for d in near if 0 <= i + d < n) for i in range(n)], dtype=np.float64)
    if isinstance(expr, GroupMax):  # GroupMin is one too
        values = evaluate(expr.args[0], env, mean, extreme, block)
        kind = "min" if isinstance(expr, GroupMin) else "max"
        if extreme is not None:
            return extreme(values, kind)
        return np.min(values) if kind == "min" else np.max(values)
    if expr.is_Add:
        return sum(evaluate(a, env, mean, extreme, block) for a in expr.args)
    if expr.is_Mul:
        out = 1.0
        for a in expr.args:
            out = out * evaluate(a, env, mean, extreme, block)
        return out
    if expr.is_Pow:
        base = evaluate(expr.base, env, mean, extreme, block)
        exponent = expr.exp
        root = functions.half_power_sign(expr)  # x**(1/2) or x**(-1/2): the table's square root
        if root:
            sqrt = getattr(np, functions.half_power().numpy)(base)
            return sqrt if root > 0 else 1.0 / sqrt
        if exponent.is_Integer:
            return base ** int(exponent)
        return np.power(base, float(exponent) if exponent.is_number else evaluate(exponent, env, mean, extreme, block))
    fn = functions.of_node(expr)
    if fn is not None:  # the table's NumPy function
        return numpy_function(fn)(*(evaluate(a, env, mean, extreme, block) for a in expr.args))
    raise TypeError(f"cannot evaluate {type(expr).__name__}: {expr}")


class GroupEvaluator:
    """Forward and closed-form backward of one mode on a single group."""

    def __init__(self, mode: ModeDerivation):
        self.mode = mode
        self.spec = mode.spec

    def forward(
        self, x: np.ndarray, params: dict, scalars: dict, block: Callable | None = None
    ) -> tuple[np.ndarray, dict]:
        """y over the group's elements ``x``, and the environment (statistics, coordinates) the
        backward reads. ``params`` by name (arrays over the group, or scalars); ``scalars`` the
        options, inputs and buffers by name (one value each); ``block(values, axes)`` the block
        means of a layer with block statistics."""
        mode, spec = self.mode, self.spec
        env = self._env(x, params, scalars)
        for st in mode.statistics:  # with the auxiliaries the engine named
            env[st.symbol] = evaluate(st.expr, env)
        for b in mode.blocks:  # one value per block, held per element
            env[b.symbol] = evaluate(b.expr, env, block=block) * np.ones_like(x)
        if spec.normalized is not None:
            env[spec.normalized.symbol] = evaluate(mode.normalized_expr, env) * np.ones_like(x)
        for w in spec.windows:
            env[w.symbol] = evaluate(w.expr, env)
        if mode.coordinate is not None:  # the backward's coordinate (x̂, or the centred x - μ)
            env[mode.coordinate.symbol] = evaluate(mode.coordinate_expr, env) * np.ones_like(x)
        y = evaluate(spec.output, env) * np.ones_like(x)
        return y, env

    def backward(self, dy: np.ndarray, env: dict) -> tuple[np.ndarray, dict[str, object], dict[str, float]]:
        """The closed forms at cotangent ``dy``: (dx, parameter gradients by name, input gradients
        by name). A per-element parameter's gradient is per element (sum it over the groups);
        a scalar one's is this group's whole share."""
        mode = self.mode
        env = dict(env)
        env[DY] = dy
        if mode.g is not None:
            env[G] = evaluate(mode.g, env) * np.ones_like(dy)
        dx = evaluate(mode.dx, env) * np.ones_like(dy)
        dparams = {}
        for p in self.spec.params:
            grad = mode.grads[p.name]
            elem = evaluate(grad.element, env) * np.ones_like(dy)
            # a scalar parameter: its whole gradient from this group; per channel: per element
            dparams[p.name] = float(np.sum(elem) + evaluate(grad.group, env)) if p.scalar else elem
        dinputs = {k: float(evaluate(v, env)) for k, v in mode.dinputs.items()}
        return dx, dparams, dinputs

    def _env(self, x: np.ndarray, params: dict, scalars: dict) -> dict:
        """The symbols' values before the statistics: x, N, the parameters and the scalars given."""
        env: dict = {X: np.asarray(x, dtype=np.float64), N: float(len(x))}
        for p in self.spec.params:
            v = np.asarray(params[p.name], dtype=np.float64)
            env[p.symbol] = float(v.reshape(-1)[0]) if p.scalar else v
        for item in (*self.spec.options, *self.spec.inputs, *self.spec.buffers):
            if item.name in scalars:
                env[item.symbol] = float(scalars[item.name])
        for m in self.spec.masks:
            p = scalars.get(m.option, self.spec.symbols[m.option].default)
            env[m.symbol] = (np.arange(len(x)) < leading_count(float(p), len(x))).astype(np.float64)
        return env
