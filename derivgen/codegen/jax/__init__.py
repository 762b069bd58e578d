"""The JAX target's printer: SymPy expressions as ``jax.numpy`` text."""

from derivgen.codegen.jax.printer import jax_expr

__all__ = ["jax_expr"]
