"""The JAX target's printer: SymPy expressions as ``jax.numpy`` text.

The NumPy printing of :mod:`derivgen.codegen.printers` (term order, ``Mean`` as
``_mean``/``_mean_sq``/``_mean_prod``, group maxima as ``_max``/``_min``, square roots and
every other entry of :mod:`derivgen.symbolic.functions` by its NumPy name, whether NumPy
or derivgen.runtime has it), with the functions of ``derivgen.jax._target`` (imported as
``_j``): that module resolves each table entry's name to a JAX function when first used,
so a function added to the table needs nothing here.
"""

from __future__ import annotations

import sympy

from derivgen.codegen.printers import _NumPy
from derivgen.spec.model import Spec
from derivgen.symbolic.naming import ordered_names


def jax_expr(e: sympy.Expr, spec: Spec | None = None) -> str:
    """JAX text for ``e``: ``_j.<numpy name>(...)`` calls, the group means as the other
    targets print them, spec names as they are."""
    return _NumPy(ordered_names(spec)).doprint(e).replace("numpy.", "_j.").replace("runtime.", "_j.")
