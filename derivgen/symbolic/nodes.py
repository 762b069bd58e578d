"""The SymPy functions of our own behind entries of the table of functions
(:mod:`derivgen.symbolic.functions`): the selections ``maximum``, ``minimum``, ``clip``, their
masks ``step`` and ``indicator``, ``stop_gradient``, ``sigmoid`` and ``softplus``.

This is a bottom-layer module: it imports SymPy only.
"""

from __future__ import annotations

import sympy

# ------------------------------------------------------------------ selections, sigmoid, erf
#
# SymPy has no sigmoid, no stop-gradient and no step with PyTorch's convention at a tie, so
# these are SymPy functions of our own: each evaluates at numbers, knows its sign, and gives
# its partial derivatives (fdiff) as PyTorch's autograd defines them -- masks where the
# function selects, zero for a stop-gradient.


def _num(v: sympy.Expr) -> bool:
    """A real number SymPy can order (an integer, rational, float, pi ...)."""
    return bool(v.is_number and v.is_real)


class Step(sympy.Function):
    """step(t): 1 where t > 0, 0 where t < 0, 1/2 at t = 0 -- the share of a gradient a
    selection passes to one side of a tie (``torch.maximum``, ``torch.amax``)."""

    is_real = True
    is_nonnegative = True

    @classmethod
    def eval(cls, t):
        if t.is_positive:
            return sympy.S.One
        if t.is_negative:
            return sympy.S.Zero
        if t.is_zero:
            return sympy.S.Half
        return None

    def fdiff(self, argindex=1):
        return sympy.S.Zero  # zero off the kink (PyTorch's masks are constants of autograd)


class Indicator(sympy.Function):
    """indicator(t): 1 where t >= 0, else 0 -- the mask of a closed interval (``torch.clamp``)."""

    is_real = True
    is_nonnegative = True

    @classmethod
    def eval(cls, t):
        if t.is_nonnegative:
            return sympy.S.One
        if t.is_negative:
            return sympy.S.Zero
        return None

    def fdiff(self, argindex=1):
        return sympy.S.Zero


class _Selection(sympy.Function):
    """maximum(a, b) or minimum(a, b) (``larger``), elementwise: the gradient goes to the
    selected argument, split evenly at a tie (``torch.maximum``, ``torch.minimum``)."""

    nargs = 2
    is_real = True
    larger = True

    @classmethod
    def eval(cls, a, b):
        if a == b:
            return a
        d = a - b if cls.larger else b - a  # a is selected where d > 0
        if d.is_nonnegative:
            return a
        if d.is_nonpositive:
            return b
        return None

    def fdiff(self, argindex=1):
        a, b = self.args
        d = a - b if self.larger else b - a
        return Step(d) if argindex == 1 else Step(-d)

    def _eval_is_nonnegative(self):
        pick = any if self.larger else all
        return True if pick(a.is_nonnegative for a in self.args) else None

    def _eval_is_positive(self):
        pick = any if self.larger else all
        return True if pick(a.is_positive for a in self.args) else None


class Maximum(_Selection):
    """maximum(a, b): the gradient to the larger, split evenly at a tie (``torch.maximum``)."""

    larger = True


class Minimum(_Selection):
    """minimum(a, b): the gradient to the smaller, split evenly at a tie (``torch.minimum``)."""

    larger = False


class Clip(sympy.Function):
    """clip(e, lo, hi) = minimum(maximum(e, lo), hi): the gradient passes to e on the closed
    interval lo <= e <= hi, to lo below it and to hi above it; with lo >= hi, where y is hi
    whatever e is, ``torch.clamp``'s convention: lo gets nothing, hi gets everything when
    lo > hi and what lies above it when lo = hi (then e gets what lies at lo = hi)."""

    nargs = 3
    is_real = True

    @classmethod
    def eval(cls, e, lo, hi):
        if _num(e) and _num(lo) and _num(hi):
            return Minimum(Maximum(e, lo), hi)
        return None

    def fdiff(self, argindex=1):
        e, lo, hi = self.args
        if argindex == 1:
            return Indicator(e - lo) * Indicator(hi - e)
        if argindex == 2:
            return (1 - Indicator(e - lo)) * (1 - Indicator(lo - hi))
        return 1 - Indicator(hi - e) * Indicator(hi - lo)

    def _eval_is_positive(self):
        _, lo, hi = self.args
        return True if (lo.is_positive and hi.is_positive) else None

    def _eval_is_nonnegative(self):
        _, lo, hi = self.args
        return True if (lo.is_nonnegative and hi.is_nonnegative) else None


class StopGradient(sympy.Function):
    """stop_gradient(e): the value of e, through which no derivative flows (``.detach()``)."""

    is_real = True

    @classmethod
    def eval(cls, e):
        if e.is_number:
            return e
        return None

    def fdiff(self, argindex=1):
        return sympy.S.Zero

    def _eval_is_positive(self):
        return self.args[0].is_positive

    def _eval_is_nonnegative(self):
        return self.args[0].is_nonnegative

    def _eval_evalf(self, prec):
        return self.args[0]._eval_evalf(prec)


class Sigmoid(sympy.Function):
    """sigmoid(u) = 1/(1 + exp(-u)); its derivative is sigmoid·(1 - sigmoid)."""

    is_real = True
    is_positive = True

    @classmethod
    def eval(cls, u):
        if u.is_zero:
            return sympy.S.Half
        if u.is_Float:
            return 1 / (1 + sympy.exp(-u))
        return None

    def fdiff(self, argindex=1):
        return self * (1 - self)

    def _eval_rewrite_as_exp(self, u, **kwargs):
        return 1 / (1 + sympy.exp(-u))

    def _eval_evalf(self, prec):
        return (1 / (1 + sympy.exp(-self.args[0])))._eval_evalf(prec)


class Softplus(sympy.Function):
    """softplus(u) = log(1 + exp(u)); its derivative is sigmoid(u)."""

    is_real = True
    is_positive = True

    @classmethod
    def eval(cls, u):
        if u.is_zero:
            return sympy.log(2)
        if u.is_Float:
            return sympy.log(1 + sympy.exp(u))
        return None

    def fdiff(self, argindex=1):
        return Sigmoid(self.args[0])

    def _eval_rewrite_as_log(self, u, **kwargs):
        return sympy.log(1 + sympy.exp(u))

    def _eval_evalf(self, prec):
        return sympy.log(1 + sympy.exp(self.args[0]))._eval_evalf(prec)
