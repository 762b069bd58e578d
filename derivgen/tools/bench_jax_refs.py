"""Independent JAX references for the derivgen.jax tests: each catalogue layer's forward
written by hand in plain jax.numpy, and a tree walk of any spec's own expressions
(statistics, normalized coordinate, output) with ``Mean`` as a mean over the group's axes.
Neither uses derivgen's derivation or generated code; JAX's autodiff of them is the
reference for the derived JVP and VJP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special
import sympy

from derivgen.spec.model import DY, N, X  # noqa: F401  (symbols of the spec language)
from derivgen.symbolic import functions
from derivgen.symbolic.block import BlockMean
from derivgen.symbolic.reduce import Mean

try:  # group maxima and minima (statistics of their own), where the engine has them
    from derivgen.symbolic.reduce import GroupMax, GroupMin
except ImportError:  # pragma: no cover
    GroupMax = GroupMin = ()

# the elementary functions by name, written out here (not derivgen.jax's lookup of the table)
FUNCTIONS = {
    "sigmoid": jax.nn.sigmoid,
    "erf": jax.scipy.special.erf,
    "stop_gradient": jax.lax.stop_gradient,
    "step": lambda t: jnp.heaviside(t, 0.5),
    "indicator": lambda t: jnp.heaviside(t, 1.0),
}


def _moments(x, axes):
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=axes, keepdims=True)
    return mean, var


def layernorm(x, gamma, beta, eps=1e-5):
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    mean, var = _moments(x, axes)
    return (x - mean) / jnp.sqrt(var + eps) * gamma + beta


def rmsnorm(x, gamma, eps=1e-6):
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    return x / jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps) * gamma


def _channel(p, x):
    return p.reshape((1, -1) + (1,) * (x.ndim - 2))


def batchnorm(x, gamma, beta, eps=1e-5, training=True, running_mean=None, running_var=None, momentum=0.1):
    """y, and the running buffers' new values (torch's rule: unbiased variance)."""
    axes = (0, *range(2, x.ndim))
    if training:
        mean, var = _moments(x, axes)
        n = x.size // x.shape[1]
        new = None
        if running_mean is not None:
            new = (
                (1 - momentum) * running_mean + momentum * mean.reshape(-1),
                (1 - momentum) * running_var + momentum * var.reshape(-1) * n / (n - 1),
            )
    else:
        mean, var, new = _channel(running_mean, x), _channel(running_var, x), (running_mean, running_var)
    return (x - mean) / jnp.sqrt(var + eps) * _channel(gamma, x) + _channel(beta, x), new


def instancenorm(x, gamma, beta, eps=1e-5):
    mean, var = _moments(x, tuple(range(2, x.ndim)))
    return (x - mean) / jnp.sqrt(var + eps) * _channel(gamma, x) + _channel(beta, x)


def groupnorm(x, gamma, beta, num_groups, eps=1e-5):
    g = x.reshape(x.shape[0], num_groups, -1)
    mean, var = _moments(g, (2,))
    return ((g - mean) / jnp.sqrt(var + eps)).reshape(x.shape) * _channel(gamma, x) + _channel(beta, x)


def online_layernorm(x, gamma, beta, prev_mean, prev_std, alpha, eps=0.0):
    n = x.shape[-1]
    row_mean = jnp.mean(x, axis=-1, keepdims=True)
    pm = jnp.reshape(prev_mean, jnp.shape(prev_mean) + (1,)) if jnp.ndim(prev_mean) else prev_mean
    ps = jnp.reshape(prev_std, jnp.shape(prev_std) + (1,)) if jnp.ndim(prev_std) else prev_std
    mean = alpha * row_mean + (1 - alpha) * pm
    sample_std = jnp.sqrt(jnp.sum((x - mean) ** 2, axis=-1, keepdims=True) / (n - 1) + eps)
    std = alpha * sample_std + (1 - alpha) * ps
    return gamma * (x - mean) / std + beta


# ------------------------------------------------------------------ any spec


def evaluate(expr: sympy.Expr, env: dict, mean, select=None, block=None):
    """``expr`` over ``env`` (symbol -> array or number), Mean atoms by ``mean``, group maxima
    and minima by ``select(op, value)``, block means by ``block(value, axes of (O, G, Cg, S))``."""
    if isinstance(expr, BlockMean):
        return block(evaluate(expr.body, env, mean, select, block), expr.axes)
    if expr.is_Symbol:
        return env[expr]
    if expr.is_number:
        return math.pi if expr == sympy.pi else float(expr)
    if GroupMax and isinstance(expr, (GroupMax, GroupMin)):  # GroupMin is a kind of GroupMax
        return select("min" if isinstance(expr, GroupMin) else "max", evaluate(expr.args[0], env, mean, select, block))
    if isinstance(expr, Mean):
        return mean(evaluate(expr.args[0], env, mean, select, block))
    if expr.is_Add:
        out = 0.0
        for a in expr.args:
            out = out + evaluate(a, env, mean, select, block)
        return out
    if expr.is_Mul:
        out = 1.0
        for a in expr.args:
            out = out * evaluate(a, env, mean, select, block)
        return out
    if expr.is_Pow:
        base = evaluate(expr.base, env, mean, select, block)
        if expr.exp.is_Integer:
            return base ** int(expr.exp)
        if expr.exp.is_number:
            return jnp.power(base, float(expr.exp))
        return jnp.power(base, evaluate(expr.exp, env, mean, select, block))  # an option's power: x**(-beta)
    fn = functions.of_node(expr)
    if fn is not None:
        f = FUNCTIONS.get(fn.name) or getattr(jnp, fn.name)
        return f(*(evaluate(a, env, mean, select, block) for a in expr.args))
    raise TypeError(f"cannot evaluate {type(expr).__name__}: {expr}")


def window(u, k: int, shape: tuple, reduce_axes: tuple):
    """``window(u, k)`` over the group's one axis of length > 1 (the whole group when it has
    one element): out[i] = Σ_j B[i, j] u[j] with B[i, j] = 1 for i - ⌊k/2⌋ <= j <= i + ⌊(k-1)/2⌋
    (torch.nn.LocalResponseNorm's zero-padded window), as a matrix product."""
    u = jnp.broadcast_to(u, shape)
    axes = [a for a in reduce_axes if shape[a] != 1]
    if not axes:
        return u
    (axis,) = axes
    i = jnp.arange(shape[axis])
    band = ((i[None, :] >= i[:, None] - k // 2) & (i[None, :] <= i[:, None] + (k - 1) // 2)).astype(u.dtype)
    return jnp.moveaxis(jnp.tensordot(band, jnp.moveaxis(u, axis, 0), axes=1), 0, axis)


def spec_forward(spec, mode: str, x4, params4: dict, values: dict, reduce_axes: tuple, axes4=(0, 1, 2, 3)):
    """y of ``spec``'s mode ``mode`` for x as a view whose groups span ``reduce_axes``;
    parameters as broadcastable views, ``values`` the options, inputs and buffers by name;
    ``axes4`` the view's axis of each axis of (O, G, Cg, S) (-1: a unit axis left out)."""
    return spec_outputs(spec, mode, x4, params4, values, reduce_axes, axes4)[0]


def spec_outputs(
    spec, mode: str, x4, params4: dict, values: dict, reduce_axes: tuple, axes4=(0, 1, 2, 3), tensors4=None
) -> tuple:
    """(y, the outputs beside y...) of ``spec``'s mode, as :func:`spec_forward`; ``tensors4`` the
    tensor inputs beside x by name, as views broadcasting against x's; the spec's element values
    (``[values]``: a residual sum, a gated x) are computed from them before the statistics."""

    def mean(e):
        return jnp.mean(jnp.broadcast_to(e, x4.shape), axis=reduce_axes, keepdims=True)

    def select(op, e):
        f = jnp.max if op == "max" else jnp.min
        return f(jnp.broadcast_to(e, x4.shape), axis=reduce_axes, keepdims=True)

    def block(e, axes):  # a block mean: over the block's axes of the 4-D view
        mine = tuple(axes4[a] for a in axes if axes4[a] >= 0)
        return jnp.mean(jnp.broadcast_to(e, x4.shape), axis=mine, keepdims=True)

    n = 1
    for a in reduce_axes:
        n *= x4.shape[a]
    env = {X: x4, N: float(n)}
    for t in spec.tensors:
        env[t.symbol] = tensors4[t.name]
    for p in spec.params:
        env[p.symbol] = params4[p.name]
    for item in (*spec.options, *spec.inputs, *spec.buffers):
        if item.name in values:
            env[item.symbol] = values[item.name]
    for m in spec.masks:  # leading(p): the first int(p*n) elements of a group, in memory order
        p = values.get(m.option, spec.symbols[m.option].default)
        shape = tuple(x4.shape[a] if a in reduce_axes else 1 for a in range(x4.ndim))
        env[m.symbol] = (jnp.arange(n) < int(p * n)).astype(float).reshape(shape)
    for v in spec.values:  # element values before the statistics (h = x + residual)
        env[v.symbol] = evaluate(v.expr, env, mean, select, block)
    for w in getattr(spec, "windows", ()):  # window(e, k): a banded 0/1 matrix along the group's axis
        env[w.symbol] = window(
            evaluate(w.body, env, mean, select, block),
            int(values[str(w.size)]) if w.size.is_Symbol else int(w.size),
            x4.shape,
            reduce_axes,
        )
    for st in (*spec.mode(mode).statistics, *getattr(spec.mode(mode), "blocks", ())):
        env[st.symbol] = evaluate(st.expr, env, mean, select, block)
    if spec.normalized is not None:
        env[spec.normalized.symbol] = evaluate(spec.normalized_expr, env, mean, select, block)
    outs = (spec.output, *(o.expr for o in spec.outputs))
    return tuple(jnp.broadcast_to(evaluate(e, env, mean, select, block), x4.shape) for e in outs)
