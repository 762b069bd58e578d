"""The JAX target's printer: SymPy expressions as ``jax.numpy`` text.

The NumPy printing of :mod:`derivgen.codegen.printers` (term order, ``Mean`` as
``_mean``/``_mean_sq``/``_mean_prod``, group maxima as ``_max``/``_min``, square roots and
every other entry of :mod:`derivgen.symbolic.functions` by its NumPy name, whether NumPy
or derivgen.runtime has it), with the functions of ``derivgen.jax._target`` (imported as
``_j``): that module resolves each table entry's name to a JAX function when first used,
so a function added to the table needs nothing here.

One exception: a ``step`` or ``indicator`` of a difference, ``indicator(a - b)``, prints as
the comparison of a with b (``_j.indicator_cmp(a, b)``). XLA's CPU code contracts
``a*c - b`` into a fused multiply-add, which does not round ``a*c`` first: the difference
of a value and the group maximum it attains is then not exactly zero, and the equality
``indicator(x**2 - max)*indicator(max - x**2)`` would lose the element that attains it.
A comparison is not contracted.

A window, ``window(u, k)`` (:mod:`derivgen.symbolic.window`), prints as the layout's
window sum along the group's axis, ``_L.window(u, k, transposed)`` (derivgen.jax.layout):
k is an option, a Python number when the function is traced, so the window's slices are
static.
"""

from __future__ import annotations

import sympy

from derivgen.codegen.printers import _NumPy
from derivgen.spec.expr import leading_option
from derivgen.spec.model import Spec
from derivgen.symbolic import functions
from derivgen.symbolic.naming import ordered_names

COMPARED = ("step", "indicator")  # table entries of one argument t, functions of the sign of t


class _Jax(_NumPy):
    def _print_Symbol(self, expr):
        opt = leading_option(expr)
        if opt is not None:  # the JAX target binds no mask arrays: one from the layout
            return f"numpy.leading_mask(_L, {opt})"
        return super()._print_Symbol(expr)

    def _print_Window(self, expr):
        """``_L.window(u, k, transposed)``: the sum over the window along the group's axis."""
        return f"_L.window({self._print(expr.body)}, {self._print(expr.size)}, {expr.transposed})"

    def _print_BlockMean(self, expr):
        """``_L.block_mean(u, axes)``: the mean over the element's block (axes of (O, G, Cg, S))."""
        return f"_L.block_mean({self._print(expr.body)}, {expr.axes!r})"

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        (arg,) = expr.args if len(expr.args) == 1 else (None,)
        if fn.name in COMPARED and isinstance(arg, sympy.Add):
            pos = [t for t in arg.args if not t.could_extract_minus_sign()]
            neg = [-t for t in arg.args if t.could_extract_minus_sign()]
            a, b = sympy.Add(*pos), sympy.Add(*neg)
            return f"numpy.{fn.name}_cmp({self._print(a)}, {self._print(b)})"
        return super()._print_elementary(fn, expr)


def jax_expr(e: sympy.Expr, spec: Spec | None = None) -> str:
    """JAX text for ``e``: ``_j.<numpy name>(...)`` calls, the group means as the other
    targets print them, spec names as they are."""
    return _Jax(ordered_names(spec)).doprint(e).replace("numpy.", "_j.").replace("runtime.", "_j.")
