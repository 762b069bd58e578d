"""The JAX target's printer (SymPy expressions as ``jax.numpy`` text) and planner (how each
mode's JVP and VJP are written for XLA)."""

from derivgen.codegen.jax.plan import plan_jax
from derivgen.codegen.jax.printer import jax_expr, jax_monomial

__all__ = ["jax_expr", "jax_monomial", "plan_jax"]
