"""What the generated JAX modules (``generated/jax/<layer>.py``) call: the elementary functions.

The printed expressions name their functions ``_j.sqrt``, ``_j.exp`` ... (each entry's
NumPy name in :mod:`derivgen.symbolic.functions`). Each resolves, when first used, to
the ``jax.numpy`` function of that name, else ``jax.scipy.special``'s or ``jax.lax``'s
(``erf``), else the entry's PyTorch name in ``jax.numpy``: a function added to the
table works here without a change.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.scipy.special

from derivgen.symbolic import functions

pi = math.pi


def jax_function(fn: functions.Elementary) -> Callable:
    """The JAX function for the table entry ``fn`` (a ``jax`` spelling if the entry has one)."""
    names = [getattr(fn, "jax", None), fn.numpy, fn.torch, fn.name]
    for name in (n for n in names if n):
        name = name.removeprefix("jnp.")  # a spelling written out in full
        for space in (jnp, jax.scipy.special, jax.lax):
            f = getattr(space, name, None)
            if callable(f):
                return f
    raise AttributeError(f"no JAX function for the elementary function {fn.name!r} (tried {names})")


def __getattr__(name: str) -> Callable:
    """``_j.<numpy name>``: the table entry's JAX function (looked up once, then kept)."""
    fn = functions.of_numpy_name(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    f = jax_function(fn)
    globals()[name] = f
    return f
