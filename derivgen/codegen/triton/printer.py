"""The Triton target's printer: SymPy expressions as the text of ``triton.jit`` kernels.

The JAX printing of :mod:`derivgen.codegen.jax.printer` (term order, spec names as they are,
a ``step`` or ``indicator`` of a difference as a comparison, which no fused multiply-add
can move), with every function of :mod:`derivgen.symbolic.functions` called as
``_tt.<its triton_name>`` (``derivgen.triton._target``: ``triton.jit`` functions of
``triton.language`` primitives) and powers spelled for Triton, which has no ``**`` on
tensors: integer powers as products (negative ones as reciprocals), square roots as
``_tt.sqrt``, any other power as ``_tt.pow``. Group means never reach it: the IR has
written them as sums over N. A window (:mod:`derivgen.symbolic.window`) prints as a call
of the ``triton.jit`` function the planner made for it (``window_call``;
:mod:`derivgen.codegen.triton.plan`), which sums its body over the neighbouring elements.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy
from sympy.printing.precedence import PRECEDENCE

from derivgen.codegen.jax.printer import _Jax
from derivgen.spec.model import Spec
from derivgen.symbolic import functions
from derivgen.symbolic.naming import ordered_names
from derivgen.symbolic.window import Window


class _Triton(_Jax):
    def __init__(self, names, window_call: Callable[[Window], str] | None = None):
        super().__init__(names)
        self.window_call = window_call

    def _print_Window(self, expr):
        if self.window_call is None:
            raise NotImplementedError(f"a window needs the planner's window functions (codegen.triton.plan): {expr}")
        return self.window_call(expr)

    def _print_Symbol(self, expr):
        return expr.name  # leading(p) too: the kernels load it (codegen.triton.plan)

    def _spell(self, fn: functions.Elementary, args: tuple) -> str:
        return f"_tt.{fn.triton_name}({self.stringify(args, ', ')})"

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        if expr.is_number:  # sqrt(2), exp(1): a constant, not a function of a Python number
            return _float(expr)
        return super()._print_elementary(fn, expr).replace("numpy.", "_tt.")

    def _print_Pi(self, expr):
        return "3.141592653589793"

    def _print_Mean(self, expr):
        raise NotImplementedError("the Triton kernels take group means as sums over N (codegen.ir)")

    def _print_Pow(self, expr, rational=False):
        b, e = expr.base, expr.exp
        if expr.is_number and not expr.is_Rational:
            return _float(expr)
        if e.is_Integer and e != 0:
            base = self.parenthesize(b, PRECEDENCE["Mul"])
            prod = "*".join([base] * abs(int(e)))
            return f"({prod})" if e > 0 else f"(1.0/({prod}))"
        root = functions.half_power_sign(expr)
        if root:
            text = self._spell(functions.half_power(), (b,))
            return text if root > 0 else f"(1.0/{text})"
        return f"_tt.pow({self._print(b)}, {self._print(e)})"


def _float(e: sympy.Expr) -> str:
    """A constant as a float literal (Triton's functions take tensors, not Python numbers)."""
    return repr(float(sympy.N(e, 17)))


def triton_expr(e: sympy.Expr, spec: Spec | None = None, window_call: Callable[[Window], str] | None = None) -> str:
    """Triton text for ``e``: ``_tt.<function>`` calls, spec names as they are, each window
    as the text ``window_call`` gives it."""
    return _Triton(ordered_names(spec), window_call).doprint(sympy.sympify(e))
