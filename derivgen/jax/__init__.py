"""derivgen layers in JAX: functions whose derivatives are the derived closed forms, and Flax modules.

    import derivgen.jax as dj
    f = dj.function("layernorm")              # f(x, gamma, beta, eps=1e-5) -> y
    jax.jacfwd(f)(x, gamma, beta)             # forward mode runs the derived JVP
    norm = dj.nnx.LayerNorm(1024, rngs=nnx.Rngs(0))   # flax.nnx.LayerNorm's twin

Each layer's forward is a ``jax.custom_jvp`` whose rule is the JVP derivgen derived
(``generated/jax/<layer>.py``); JAX transposes it for reverse mode, so ``grad``,
``vjp``, ``jacfwd``, ``jacrev``, ``hessian``, ``jit`` and ``vmap`` all work. JAX is an
optional dependency (``pip install jax flax``, or ``pip install '/path/to/derivgen[jax]'``); the Flax modules
(:mod:`derivgen.jax.nnx`) need Flax too.
"""

try:
    import jax as _jax  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised where JAX is missing
    raise ImportError(
        "derivgen.jax needs JAX, an optional dependency: pip install jax flax (or pip install '/path/to/derivgen[jax]')"
    ) from e

from derivgen.jax.layer import Function, compute_dtype, function
from derivgen.jax.layout import JaxLayout, make_layout
from derivgen.jax.load import module

__all__ = ["Function", "JaxLayout", "compute_dtype", "function", "make_layout", "module", "nnx"]


def __getattr__(name: str):
    """``derivgen.jax.nnx`` on first use (it needs Flax, an optional dependency)."""
    if name == "nnx":
        import importlib

        return importlib.import_module("derivgen.jax.nnx")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
