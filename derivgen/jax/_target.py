"""What the generated JAX modules (``generated/jax/<layer>.py``) call: the elementary functions.

The printed expressions name their functions ``_j.sqrt``, ``_j.exp``, ``_j.sigmoid`` ...
(each entry's NumPy name in :mod:`derivgen.symbolic.functions`, whether NumPy or
derivgen.runtime has it). Each resolves, when first used, to a JAX function found by the
entry's names: a ``jax`` spelling if the entry has one, else its NumPy name, its own name
and its PyTorch name (with the PyTorch spelling's extra constants: heaviside's value at
zero) in ``jax.numpy``, ``jax.nn``, ``jax.scipy.special`` and ``jax.lax``. A function added
to the table works here without a change.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.scipy.special

from derivgen.runtime.validate import leading_count
from derivgen.symbolic import functions

pi = math.pi
SPACES = (jnp, jax.nn, jax.scipy.special, jax.lax)


def step_cmp(a, b):
    """step(a - b) by comparison: 1 where a > b, 1/2 where a == b, 0 where a < b."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    dt = jnp.result_type(a, b, jnp.float32)
    return jnp.where(a > b, 1.0, jnp.where(a == b, 0.5, 0.0)).astype(dt)


def indicator_cmp(a, b):
    """indicator(a - b) by comparison: 1 where a >= b, else 0."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    dt = jnp.result_type(a, b, jnp.float32)
    return jnp.where(a >= b, 1.0, 0.0).astype(dt)


def equal_cmp(a, b):
    """indicator(a - b)·indicator(b - a) by one comparison: 1 where a == b, else 0."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    dt = jnp.result_type(a, b, jnp.float32)
    return jnp.where(a == b, 1.0, 0.0).astype(dt)


def leading_mask(L, p):
    """``leading(p)`` in a trailing layout ``L`` (derivgen.jax.layout): 1 on the first
    ⌊p·N⌋ features, 0 on the rest, in a parameter's view."""
    n = math.prod(L.param_view)
    return (jnp.arange(n) < leading_count(float(p), n)).astype(float).reshape(L.param_view)


def jax_function(fn: functions.Elementary) -> Callable:
    """The JAX function for the table entry ``fn``."""
    extra = tuple(getattr(fn, "torch_extra", ()))
    names = [(getattr(fn, "jax", None), ()), (fn.numpy, ()), (fn.name, ()), (fn.torch, extra)]
    for name, consts in names:
        if not name:
            continue
        name = name.removeprefix("jnp.")  # a spelling written out in full
        for space in SPACES:
            f = getattr(space, name, None)
            if callable(f):
                return (lambda *a, f=f, c=consts: f(*a, *c)) if consts else f
    raise AttributeError(f"no JAX function for the elementary function {fn.name!r} (tried {[n for n, _ in names]})")


def _entry(name: str) -> functions.Elementary | None:
    """The table entry printed as ``name`` (its NumPy name, or its own)."""
    by_numpy = getattr(functions, "of_numpy_name", None)
    fn = by_numpy(name) if by_numpy is not None else None
    return fn if fn is not None else functions.TABLE.get(name)


def __getattr__(name: str) -> Callable:
    """``_j.<name>``: the table entry's JAX function (looked up once, then kept)."""
    fn = _entry(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    f = jax_function(fn)
    globals()[name] = f
    return f
