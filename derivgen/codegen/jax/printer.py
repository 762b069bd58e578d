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

The product of the two, ``indicator(a - b)*indicator(b - a)`` (the elements that attain a
group maximum), prints as one comparison, ``_j.equal_cmp(a, b)``: XLA's CPU code wrote each
indicator to memory before multiplying them, two x-sized arrays where one comparison needs
none.

A window, ``window(u, k)`` (:mod:`derivgen.symbolic.window`), prints as the layout's
window sum along the group's axis, ``_L.window(u, k, transposed)`` (derivgen.jax.layout):
k is an option, a Python number when the function is traced, so the window's slices are
static.

In the JVP's tangents, an element monomial prints with the layer's parameters last
(:func:`jax_monomial`, ``K*xhat*gamma``) where a parameter's gradient sums over other axes
than the group's (trailing layouts, and groups of one position's channels). JAX transposes
a product from its last factor inward, so reverse mode then multiplies the cotangent by the
parameter first (dy*gamma, the g of the derived backward), and the parameter's gradient
reads dy*xhat by itself; with ``K*gamma*xhat`` both reductions read the product dy*xhat,
which XLA's CPU code then writes to memory, an x-sized array more. Where the two sums share
axes (a channel's parameter, groups over positions), the shared product is what lets XLA sum
it over the positions once for both, and the order stays as SymPy prints it.
"""

from __future__ import annotations

import sympy
from sympy.printing.precedence import PRECEDENCE, precedence

from derivgen.codegen.printers import _NumPy
from derivgen.spec.expr import leading_option
from derivgen.spec.model import Spec
from derivgen.symbolic import functions
from derivgen.symbolic.naming import ordered_names

COMPARED = ("step", "indicator")  # table entries of one argument t, functions of the sign of t


class EqualCmp(sympy.Function):
    """``indicator(a - b)*indicator(b - a)``: 1 where a == b, else 0 (printed, never derived)."""

    nargs = 2


def _sides(d: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(a, b) with d = a - b: the terms of d that print positive, and the others negated."""
    pos = [t for t in sympy.Add.make_args(d) if not t.could_extract_minus_sign()]
    neg = [-t for t in sympy.Add.make_args(d) if t.could_extract_minus_sign()]
    return sympy.Add(*pos), sympy.Add(*neg)


def _equalities(e: sympy.Expr) -> sympy.Expr:
    """``e`` with each product ``indicator(d)*indicator(-d)`` as ``EqualCmp(a, b)``, d = a - b."""
    indicator = functions.TABLE["indicator"]
    if not any(functions.of_node(a) is indicator for a in e.atoms(sympy.Function)):
        return e

    def one(m: sympy.Expr) -> sympy.Expr:
        factors = list(sympy.Mul.make_args(m))
        for i, f in enumerate(factors):
            if functions.of_node(f) is not indicator:
                continue
            for k in range(i + 1, len(factors)):
                g = factors[k]
                if functions.of_node(g) is indicator and g.args[0] == -f.args[0]:
                    factors[i], factors[k] = EqualCmp(*_sides(f.args[0])), sympy.S.One
                    return sympy.Mul(*factors)
        return m

    return e.replace(lambda a: a.is_Mul, one)


class _Jax(_NumPy):
    def _print_EqualCmp(self, expr):
        """``_j.equal_cmp(a, b)``: a == b, compared."""
        return f"numpy.equal_cmp({self._print(expr.args[0])}, {self._print(expr.args[1])})"

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
    return _Jax(ordered_names(spec)).doprint(_equalities(e)).replace("numpy.", "_j.").replace("runtime.", "_j.")


def jax_monomial(m: sympy.Expr, spec: Spec) -> str:
    """JAX text for the element monomial ``m`` of a JVP's tangent, with the spec's non-scalar
    parameters as its last factors where their gradients sum over other axes than the group's
    (see the module's docstring); else as :func:`jax_expr`."""
    if spec.layout != "trailing" and spec.reduce != "position":
        return jax_expr(m, spec)
    late = {p.symbol for p in spec.params if not p.scalar}
    number, product = m.as_coeff_Mul()
    factors = sympy.Mul.make_args(product)
    params = [f for f in factors if f.free_symbols and f.free_symbols <= late]
    if not params or len(params) == len(factors):
        return jax_expr(m, spec)
    rest = sympy.Mul(*(f for f in factors if f not in params))

    def factor(e: sympy.Expr) -> str:
        text = jax_expr(e, spec)
        return f"({text})" if precedence(e) < PRECEDENCE["Mul"] else text

    text = "*".join([factor(rest), *(factor(p) for p in params)])
    if number == 1:
        return text
    return f"-{text}" if number == -1 else f"{factor(number)}*{text}"
