"""Windows over neighbouring elements of a group, as symbolic objects.

``Window(u, k, 1)`` is, at element i of a group, the sum of the element values ``u`` over
the k consecutive elements around i: elements i - ⌊k/2⌋ .. i + ⌊(k-1)/2⌋, with the ones
past either end of the group counted as zero (``torch.nn.LocalResponseNorm``'s zero
padding). ``Window(u, k, -1)`` is its transpose, the sum over i - ⌊(k-1)/2⌋ .. i + ⌊k/2⌋:
for any element values a and b, Σ_i a_i·Window(b, k, 1)_i = Σ_i Window(a, k, -1)_i·b_i,
which is how reverse mode carries an adjoint back through a window. For odd k the window
is symmetric and its own transpose.

The group's elements are ordered as they lie along the group's one axis (a trailing
layout's features, the channels at one position); ``u`` may hold element values (x, ∂L/∂y,
per-channel parameters, other windows) and group values (statistics, options), which are
the same at every element of the window. ``k`` is a positive integer or an integer option.
"""

from __future__ import annotations

import sympy
from sympy import Add, Mul

from derivgen.symbolic.reduce import SumFacts


class Window(SumFacts, sympy.Function):
    """Σ of ``u`` over a window of ``k`` neighbours, forward (``t = 1``) or transposed (``t = -1``)."""

    nargs = 3

    @classmethod
    def eval(cls, u: sympy.Expr, k: sympy.Expr, t: sympy.Expr) -> sympy.Expr | None:
        """Zero for a zero argument; otherwise never evaluated on construction."""
        if u == 0:
            return sympy.S.Zero
        return None

    @property
    def body(self) -> sympy.Expr:
        """The element values summed."""
        return self.args[0]

    @property
    def size(self) -> sympy.Expr:
        """k: an integer or an integer option."""
        return self.args[1]

    @property
    def transposed(self) -> bool:
        """Is this the transpose (the window reverse mode carries adjoints through)?"""
        return self.args[2] == -1

    def transpose(self, u: sympy.Expr) -> sympy.Expr:
        """The transposed window of the same size over ``u``."""
        return Window(u, self.size, -self.args[2])

    def _latex(self, printer: sympy.printing.latex.LatexPrinter) -> str:
        if hasattr(printer, "_print_Window"):  # a printer's own spelling (derivgen.explain)
            return printer._print_Window(self)
        name = r"\operatorname{window}^{\top}" if self.transposed else r"\operatorname{window}"
        return f"{name}_{{{printer._print(self.size)}}}\\left({printer._print(self.body)}\\right)"

    def _sympystr(self, printer: sympy.printing.str.StrPrinter) -> str:
        if hasattr(printer, "_print_Window"):
            return printer._print_Window(self)
        name = "windowT" if self.transposed else "window"
        return f"{name}({printer._print(self.body)}, {printer._print(self.size)})"


def offsets(k: int, transposed: bool) -> range:
    """The offsets d of the elements i + d a window of size ``k`` at i sums."""
    lo, hi = k // 2, (k - 1) // 2
    return range(-hi, lo + 1) if transposed else range(-lo, hi + 1)


def windows(e: sympy.Expr) -> set[Window]:
    """The windows in ``e`` (outermost and nested)."""
    return e.atoms(Window)


def pull(e: sympy.Expr, element: set[sympy.Symbol] | frozenset[sympy.Symbol]) -> sympy.Expr:
    """``e`` with each window's factors that are one value per group taken out of it and its
    sums split (a window is linear): Window(c·u + d·v) = c·Window(u) + d·Window(v) for c, d
    free of the ``element`` symbols and of windows. A body with a term that is one value per
    group stays one window: Window(c) counts the elements of the window inside the group,
    which varies near its ends, and is no group value."""

    def split(w: Window) -> sympy.Expr:
        body = pull(w.body, element)
        parts = []
        for term in Add.make_args(sympy.expand(body, deep=False, mul=True, multinomial=False)):
            const, vary = [], []
            for f in Mul.make_args(term):
                (vary if f.free_symbols & element or f.has(Window) else const).append(f)
            if not vary:
                return Window(body, w.size, w.args[2])
            parts.append((Mul(*const), Mul(*vary)))
        return Add(*[c * Window(v, w.size, w.args[2]) for c, v in parts])

    if not e.has(Window):
        return e
    return e.replace(lambda a: isinstance(a, Window), split)
