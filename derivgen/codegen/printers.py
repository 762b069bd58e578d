"""Printers of the generated code: SymPy expressions as NumPy and C text.

One :class:`SpecPrinter` per spec carries the spec's naming to every printer (term
order); the code generator builds it once per layer and passes it explicitly.

SymPy's own printers (``NumPyPrinter``, ``C99CodePrinter``) with our term
order (sums as people write them), our names (a symbol prints as its code
name), ``Mean`` as each target's group reduction, small integer powers as
products, float element arithmetic that adds group-level terms as
hi + lo pairs, and the elementary functions (square roots included) spelled as
their entries in :mod:`derivgen.symbolic.functions` say.
"""

from __future__ import annotations

import struct

import sympy
from sympy.codegen.ast import float32, float64, real
from sympy.printing.c import C99CodePrinter
from sympy.printing.numpy import NumPyPrinter

from derivgen.spec.expr import leading_option
from derivgen.spec.model import N, Spec
from derivgen.symbolic import functions
from derivgen.symbolic.functions import SpellsFunctions, call
from derivgen.symbolic.naming import _Ordered, code_text, ordered_names

_N_INV = 1 / N  # a mean's divisor, as SymPy writes s/N: s*N**-1


class _NumPy(SpellsFunctions, _Ordered, NumPyPrinter):
    def __init__(self, names, torch_module: bool = False):
        super().__init__({"fully_qualified_modules": True, "allow_unknown_functions": False})
        self.names = names
        self.torch_module = torch_module

    def _print_Mean(self, expr):
        a = expr.args[0]
        if a.is_Pow and a.exp == 2:  # mean(e**2): one pass over e
            return f"_mean_sq({self._print(a.base)})"
        if _plain_pair(a, sympy.Mul):  # mean(a*b): no temporary product
            left, right = (self._print(f) for f in a.args)
            return f"_mean_prod({left}, {right})"
        return f"_mean({self._print(a)})"

    def _print_Symbol(self, expr):
        opt = leading_option(expr)
        if opt is not None and self.torch_module:  # the PyTorch target binds no mask arrays
            return f"torch.leading_mask(x, {opt})"
        return expr.name

    def _print_GroupMax(self, expr):
        return f"_max({self._print(expr.args[0])})"

    def _print_Window(self, expr):
        """``window_sum(u, k, transposed, x)``: along the group's axis, shaped like x."""
        fn = "torch.window_sum" if self.torch_module else "runtime.window_sum"
        return f"{fn}({self._print(expr.body)}, {self._print(expr.size)}, {expr.transposed}, x)"

    def _print_GroupMin(self, expr):
        return f"_min({self._print(expr.args[0])})"

    def _print_BlockMean(self, expr):
        """``block_mean(u, axes, x)``: the mean of u over the axes of the 4-D view one block
        spans, shaped like x."""
        fn = "torch.block_mean" if self.torch_module else "runtime.block_mean"
        return f"{fn}({self._print(expr.body)}, {expr.axes!r}, x)"

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        return self._spell(fn, expr.args)

    def _spell(self, fn: functions.Elementary, args: tuple) -> str:
        """``numpy.<fn.numpy>(args)`` or ``runtime.<fn.numpy>(args)``; the PyTorch printing
        (``torch_module``) names every function ``torch.<fn.name>`` (derivgen.torch._target)."""
        path = f"torch.{fn.name}" if self.torch_module else functions.numpy_path(fn)
        return f"{path}({self.stringify(args, ', ')})"

    def _print_Pi(self, expr):
        return "torch.pi" if self.torch_module else "numpy.pi"

    def _print_Pow(self, expr, rational=False):
        root = functions.half_power_sign(expr)
        if rational or not root:
            return super()._print_Pow(expr, rational)
        text = self._spell(functions.half_power(), (expr.base,))
        return text if root > 0 else f"{self._print(sympy.S.One)}/{text}"


def np_expr(e: sympy.Expr, spec: Spec | None = None) -> str:
    """NumPy text for ``e``: ``_np.<function>`` calls, ``_mean``/``_mean_sq``/``_mean_prod`` for
    group means, spec names as they are."""
    return _NumPy(ordered_names(spec)).doprint(e).replace("numpy.", "_np.").replace("runtime.", "_rt.")


def torch_expr(e: sympy.Expr, spec: Spec | None = None) -> str:
    """PyTorch text: the NumPy printing with the functions of ``derivgen.torch._target``
    (imported as ``_t``), which take tensors and plain numbers alike."""
    return _NumPy(ordered_names(spec), torch_module=True).doprint(e).replace("torch.", "_t.").replace("numpy.", "_t.")


def _plain_pair(e: sympy.Expr, kind) -> bool:
    """``e`` is a sum or product (``kind``) of exactly two operands that print as
    themselves: no number, and no reciprocal (a/b prints as a division, which
    splitting would turn into a reciprocal and a product, rounding twice)."""
    return (
        isinstance(e, kind)
        and len(e.args) == 2
        and not any(f.is_Number or (f.is_Pow and f.exp.is_negative) for f in e.args)
    )


def np_store(target: str, e: sympy.Expr, spec: Spec | None = None) -> str:
    """``target = e``; when ``e`` is a plain sum or product of two operands, the
    ufunc writes straight into ``target`` (converting to its dtype) instead of
    forming a float64 temporary and copying it. Anything else is assigned as
    printed, so the arithmetic is always exactly the printed expression."""
    if _plain_pair(e, sympy.Mul) or _plain_pair(e, sympy.Add):
        ufunc = "_np.multiply" if e.is_Mul else "_np.add"
        args = e.as_ordered_factors() if e.is_Mul else _NumPy(ordered_names(spec))._as_ordered_terms(e)
        return f"{ufunc}({np_expr(args[0], spec)}, {np_expr(args[1], spec)}, out={target})"
    return f"{target} = {np_expr(e, spec)}"


def np_sum(e: sympy.Expr, axes: str, spec: Spec | None = None) -> str:
    """NumPy text for the sum of ``e`` over ``axes`` (keeping dimensions); a
    product of two factors is summed without forming it; a zero gradient is 0.0."""
    if e == 0:
        return "0.0"
    if _plain_pair(e, sympy.Mul):
        a, b = (np_expr(f, spec) for f in e.args)
        return f"_rt.sum_prod({a}, {b}, {axes})"
    return f"_np.sum({np_expr(e, spec)}, axis={axes}, keepdims=True)"


C_INT_POWER_MAX = 16  # the largest |n| the C printers write b**n for as products


def c_int_power(b: str, n: int) -> str:
    """C text of ``b`` (printed, parenthesized as a factor) to the integer power 2 <= n <= 16 as
    products: b*b, b*b*b, b*b*b*b as written (left to right), and from 5 on by squaring,
    b**n = (b**(n//2))**2 (times b when n is odd), whose repeated operand the compiler
    computes once. Each product rounds once; the relative error is at most (n - 1) units of
    rounding to first order whatever the order of the products (docs/numerics.md)."""
    if n <= 4:
        return "*".join([b] * n)
    half = f"({c_int_power(b, n // 2)})"
    return f"{half}*{half}*{b}" if n % 2 else f"{half}*{half}"


def half_integer(e: sympy.Expr) -> int:
    """n when ``e`` is n/2 for an odd n with 3 <= |n| <= 2*C_INT_POWER_MAX + 1 (a power the C
    printers write as a square root times products), else 0."""
    if e.is_Rational and e.q == 2 and 3 <= abs(e.p) <= 2 * C_INT_POWER_MAX + 1:
        return int(e.p)
    return 0


class TileRead(str):
    """The C text of a window's value read from a tile the kernel computed before the loop
    (derivgen.codegen.c.windows.WindowFunctions.tiles), where any other text a printer's
    ``windows`` gives is a call of a window function."""


class _C(SpellsFunctions, _Ordered, C99CodePrinter):
    def __init__(self, ctype: str, rename: dict[str, str], names, windows=None, scalar: bool = False):
        alias = float32 if ctype == "float" else float64
        super().__init__({"type_aliases": {real: alias}, "math_macros": {}})  # no M_SQRT2: strict C99
        self.ctype = ctype
        self.rename = rename
        self.names = names
        self.windows = windows  # Window -> C call text (derivgen.codegen.c.windows.WindowFunctions)
        self.printed: set[str] = set()  # what the symbols printed as, for the planner
        # the code runs element by element (a window function's loop over the neighbours, or an
        # expression calling a window function: no loop around it vectorizes)
        self.scalar = scalar

    def doprint(self, expr, assign_to=None):
        text = super().doprint(expr, assign_to)
        # there a double power calls the one out-of-line copy of Dg_pow (Dg_pow_call): inlined,
        # its few hundred operations only make the kernel's file slower to compile
        return text.replace("Dg_pow(", "Dg_pow_call(") if self.scalar else text

    def _print_Window(self, expr):
        """A call of the kernel's function summing the window's body over the neighbours, or
        its tile's value (a double; a float sweep rounds it once)."""
        if self.windows is None:
            raise ValueError(f"no C function for {expr}: the planner gives the printer its windows")
        text = self.windows(expr)
        if not isinstance(text, TileRead):
            self.scalar = True
        return f"(float){text}" if self.ctype == "float" else text

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        return self._spell(fn, expr.args)

    def _spell(self, fn: functions.Elementary, args: tuple) -> str:
        """The entry's C spelling for this printer's element type."""
        return call(fn.c(self.ctype), *(self._print(a) for a in args))

    def _print_Pi(self, expr):
        # a literal: M_PI is not strict C99
        return "3.14159265f" if self.ctype == "float" else "3.1415926535897932"

    def _print_Symbol(self, expr):
        text = self.rename.get(expr.name, expr.name)
        self.printed.add(text)
        return text

    def _print_Mul(self, expr):
        # a sum over the group divided by its size (a mean): Dg_per multiplies by 1/N when N is
        # a power of two, which gives the quotient's very bits without a division's latency
        # on the chain from a row's sums to its next sweep (derivgen-kernels.h)
        if len(expr.args) == 2 and _N_INV in expr.args:
            (s,) = [a for a in expr.args if a != _N_INV]
            if s.is_Symbol:
                return f"Dg_per({self._print(s)}, {self._print(N)}, Inv_N)"
        # a constant factor with an irrational number (2/sqrt(pi) of erf's derivative) is one
        # literal, its value rounded once to the element type: C would divide by sqrt(pi) in
        # every element (a constant divisor is not a multiplication unless it is a power of two)
        if any(a.is_number and not a.is_Rational for a in expr.args):
            rest = [a for a in expr.args if not a.is_number]
            value = float(sympy.Mul(*(a for a in expr.args if a.is_number)).evalf(30))
            if self.ctype == "float":  # rounded to float from the double (irrational: never a tie)
                value = struct.unpack("f", struct.pack("f", value))[0]
            lit = sympy.Float(value, 17)
            return self._print(lit) if not rest else super()._print_Mul(sympy.Mul(lit, *rest, evaluate=False))
        return super()._print_Mul(expr)

    def _print_Pow(self, expr):
        # integer powers as products: no pow() call, so the loops vectorize (docs/numerics.md
        # bounds the rounding: |n| - 1 products at most, each rounding once)
        if expr.exp.is_Integer and 2 <= abs(int(expr.exp)) <= C_INT_POWER_MAX:
            b = self.parenthesize(expr.base, sympy.printing.precedence.PRECEDENCE["Mul"])
            prod = c_int_power(b, abs(int(expr.exp)))
            return f"({prod})" if expr.exp > 0 else f"({self._print(sympy.S.One)}/({prod}))"
        root = functions.half_power_sign(expr)
        if root:
            text = self._spell(functions.half_power(), (expr.base,))
            return text if root > 0 else f"{self._print(sympy.S.One)}/{text}"
        n = half_integer(expr.exp)
        if n:
            # b**(n/2) as sqrt(b) times the integer power b**((|n| - 1)/2): no pow call, a
            # correctly rounded root and products (docs/numerics.md bounds the rounding)
            b = self.parenthesize(expr.base, sympy.printing.precedence.PRECEDENCE["Mul"])
            k = (abs(n) - 1) // 2
            prod = f"{self._spell(functions.half_power(), (expr.base,))}*{b if k == 1 else f'({c_int_power(b, k)})'}"
            return f"({prod})" if n > 0 else f"({self._print(sympy.S.One)}/({prod}))"
        if expr.exp != -1 and expr.exp != sympy.Rational(1, 3):
            # pow and powf are libm calls no loop vectorizes; Dg_pow and Dg_powf are inline
            # (derivgen-kernels.h)
            fn = "Dg_powf" if self.ctype == "float" else "Dg_pow"
            return f"{fn}({self._print(expr.base)}, {self._print(expr.exp)})"
        return super()._print_Pow(expr)


class _CFloatElem(_C):
    """Element arithmetic in float: a group-level addend h (double) enters a sum as
    ``(elements + h_hi) + h_lo`` with h_hi = (float)h, h_lo = (float)(h - h_hi), so
    x - mean is exact to float precision even when mean is 1e4 and x - mean is 1; a product
    ``hoisted`` with its group factors as one constant q prints as ``q*elements``."""

    def __init__(self, rename, names, hoisted, mask_rename=None, windows=None):
        super().__init__("float", rename, names, windows)
        self.hoisted = hoisted  # Add node -> (element part, hoisted name)
        self.mask_rename = mask_rename  # the names in double (masks compare as the forward did)

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        if self.mask_rename is None or fn.name not in ("step", "indicator"):
            return super()._print_elementary(fn, expr)
        # a mask compares in double, from the element values widened and the group values as
        # the forward computed them: a group maximum's tie test sees the very values it chose
        printer = _C("double", self.mask_rename, self.names)
        text = call(fn.c("float"), *(printer.doprint(a) for a in expr.args))
        self.printed.update(printer.printed)
        return text

    def _print_Mul(self, expr):
        if expr in self.hoisted:  # the group factors as one constant (floats.float_prelude)
            elem, q = self.hoisted[expr]
            self.printed.add(q)
            return f"{q}*{self.parenthesize(elem, sympy.printing.precedence.PRECEDENCE['Mul'])}"
        return super()._print_Mul(expr)

    def _print_Add(self, expr, order=None):
        if expr in self.hoisted:  # a float group value (a maximum of x) has no low half
            elem, h, lo = self.hoisted[expr]
            self.printed.update((f"{h}_hi", f"{h}_lo") if lo else (f"{h}_hi",))
            return f"({self._print(elem)} + {h}_hi + {h}_lo)" if lo else f"({self._print(elem)} + {h}_hi)"
        return super()._print_Add(expr, order)


class SpecPrinter:
    """The printers of one spec's generated code: NumPy, PyTorch, C and comment text,
    with the spec's term order. Built once per layer and passed to whatever prints."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.names = ordered_names(spec)

    def numpy(self, e: sympy.Expr) -> str:
        """NumPy text (``_np.``)."""
        return np_expr(e, self.spec)

    def torch(self, e: sympy.Expr) -> str:
        """PyTorch text (``_t.``)."""
        return torch_expr(e, self.spec)

    def np_store(self, target: str, e: sympy.Expr) -> str:
        """NumPy statement storing ``e`` into ``target`` (see :func:`np_store`)."""
        return np_store(target, e, self.spec)

    def np_sum(self, e: sympy.Expr, axes: str) -> str:
        """NumPy text summing ``e`` over ``axes`` (see :func:`np_sum`)."""
        return np_sum(e, axes, self.spec)

    def code(self, e: sympy.Expr) -> str:
        """Plain text for comments of generated code."""
        return code_text(e, self.spec)

    def c(self, e: sympy.Expr, ctype: str, rename: dict[str, str] | None = None, windows=None) -> str:
        """C text in ``ctype`` arithmetic, symbols printed by ``rename`` (or as themselves),
        windows as the calls ``windows`` gives."""
        return self.c_reads(e, ctype, rename, windows)[0]

    def c_reads(
        self, e: sympy.Expr, ctype: str, rename: dict[str, str] | None = None, windows=None, scalar: bool = False
    ) -> tuple[str, frozenset[str]]:
        """C text as :meth:`c`, and what its symbols printed as (the names it reads); ``scalar``:
        the text runs element by element (see ``_C.scalar``)."""
        printer = _C(ctype, rename or {}, self.names, windows, scalar)
        return printer.doprint(e), frozenset(printer.printed)

    def c_float_reads(
        self,
        e: sympy.Expr,
        rename: dict[str, str],
        hoisted: dict,
        mask_rename: dict[str, str] | None = None,
        windows=None,
    ) -> tuple[str, frozenset[str]]:
        """Float element arithmetic (group-level addends of the ``hoisted`` sums as hi + lo
        pairs; see :class:`_CFloatElem`), and the names it reads; masks (step, indicator)
        print in double with ``mask_rename``."""
        printer = _CFloatElem(rename, self.names, hoisted, mask_rename, windows)
        return printer.doprint(e), frozenset(printer.printed)
