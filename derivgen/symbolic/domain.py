"""What the engine knows about signs: real symbols, and which group-level
values are non-negative or positive where the layer is defined.

Every quantity in a spec is real. A statistic is declared *non-negative* or
*positive* when its definition says so on the layer's domain (where every
value is real and finite):

* a square root or any non-integer power is non-negative (its base must be);
  an even power too; an elementary function (``exp``, ``abs``, ``tanh`` ...) is
  what its entry's ``sign`` rule in :mod:`derivgen.functions` says;
* a negative power or a quotient of a non-negative value is positive: it is
  defined only where the value is not zero;
* sums, products and means of non-negative values are non-negative, positive
  if a term (sum) or every factor (product) is positive;
* options with ``min > 0`` are positive, with ``min = 0`` non-negative.

SymPy then cancels ``Abs(sd)/sd`` and ``sqrt(s**2)`` by itself, and the
closed forms stay rational in the statistics.
"""

from __future__ import annotations

import sympy

from . import functions
from .functions import NONNEG, POSITIVE, REAL
from .reduce import Mean

__all__ = ["NONNEG", "POSITIVE", "REAL", "domain_error", "level_of_symbol", "sign_level", "symbol"]


def symbol(name: str, level: int = REAL) -> sympy.Symbol:
    """A real symbol, non-negative or positive at ``level``."""
    if level >= POSITIVE:
        return sympy.Symbol(name, positive=True)
    if level == NONNEG:
        return sympy.Symbol(name, nonnegative=True)
    return sympy.Symbol(name, real=True)


def level_of_symbol(s: sympy.Symbol) -> int:
    """What the assumptions of ``s`` say it is: POSITIVE, NONNEG or REAL."""
    if s.is_positive:
        return POSITIVE
    if s.is_nonnegative:
        return NONNEG
    return REAL


def sign_level(e: sympy.Expr) -> int:
    """POSITIVE, NONNEG or REAL: what ``e`` is known to be on the layer's domain."""
    if e.is_number and e.is_real:  # 2, pi, sqrt(pi)
        return POSITIVE if e.is_positive else (NONNEG if e.is_zero else REAL)
    if e.is_Symbol:
        return level_of_symbol(e)
    if isinstance(e, Mean):
        return sign_level(e.args[0])
    if e.is_Add:
        levels = [sign_level(a) for a in e.args]
        if min(levels) < NONNEG:
            return REAL
        return POSITIVE if max(levels) == POSITIVE else NONNEG
    if e.is_Mul:
        levels = [sign_level(a) for a in e.args]
        return min(levels) if min(levels) >= NONNEG else REAL
    if e.is_Pow:
        b, q = e.args
        lb = sign_level(b)
        if q.is_Integer and q.is_even:
            return POSITIVE if lb == POSITIVE or (q < 0) else NONNEG
        if q.is_negative and lb >= NONNEG:
            return POSITIVE  # defined only where the base is not zero
        if q.is_Integer:
            return lb if lb >= NONNEG else REAL
        # a non-integer power: the base must be non-negative, and so is the value
        return POSITIVE if q.is_negative or lb == POSITIVE else NONNEG
    fn = functions.of_node(e)
    if fn is not None:
        return fn.sign(*(sign_level(a) for a in e.args))
    return REAL


def domain_error(e: sympy.Expr) -> str | None:
    """Why ``e`` is undefined everywhere (a square root of a negative value, a
    logarithm of a non-positive one, a division by zero), or None."""
    if e.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo) or e.has(sympy.I):
        return "the expression is undefined (a division by zero or a non-real constant)"
    for node in sympy.preorder_traversal(e):
        if node.is_Pow and not node.exp.is_Integer and node.exp.is_number and node.base.is_negative:
            return f"a non-integer power of a negative value: {node}"
        why = _outside_domain(node)
        if why is not None:
            return why
    return None


def _outside_domain(node: sympy.Expr) -> str | None:
    """Why a table function's node is undefined everywhere (its argument is known never
    to be what the function requires), or None."""
    fn = functions.of_node(node)
    if fn is None:
        return None
    arg = node.args[0]
    if fn.requires == POSITIVE and arg.is_nonpositive:
        return f"the {fn.kind} of a value that is never positive: {node}"
    if fn.requires == NONNEG and arg.is_negative:
        return f"the {fn.kind} of a negative value: {node}"
    return None
