"""The numeric check, where the symbolic budget is spent: a difference evaluated in 80-digit
arithmetic at random rational points (:func:`_zero_numeric`) drawn within the options'
declared bounds (:class:`_Sampler`). A difference checked so is reported "checked
numerically", never "proven".
"""

from __future__ import annotations

import random

import sympy

from derivgen.spec.model import Spec

NUMERIC_DIGITS = 80


class _Sampler:
    """Random rational points for the numeric check: an option strictly inside its
    declared [min, max] (1/100 steps of the interval), or up to 0.1 above its min
    (below its max) where only one bound is declared; any other symbol up to 0.1
    above zero where it is declared non-negative, else in about [-3, 3]."""

    def __init__(self, rng: random.Random, bounds: dict[str, tuple] | None = None):
        self.rng = rng
        self.bounds = bounds or {}  # symbol name -> (min, max), either None

    @classmethod
    def for_spec(cls, spec: Spec, seed: int) -> _Sampler:
        """Points within the declared bounds of ``spec``'s options, seeded with ``seed``."""
        return cls(random.Random(seed), {o.name: (_exact(o.min), _exact(o.max)) for o in spec.options})

    def value(self, s: sympy.Symbol) -> sympy.Rational:
        """One random value for ``s`` (one draw from the generator)."""
        lo, hi = self.bounds.get(s.name, (None, None))
        if lo is not None and hi is not None:
            return lo + (hi - lo) * sympy.Rational(self.rng.randint(1, 99), 100)
        if lo is not None:
            return lo + sympy.Rational(self.rng.randint(1, 100), 1000)
        if hi is not None:
            return hi - sympy.Rational(self.rng.randint(1, 100), 1000)
        if s.is_nonnegative:
            return sympy.Rational(self.rng.randint(1, 100), 1000)
        return sympy.Rational(self.rng.randint(-300, 300), 97)


def _exact(v: float | None) -> sympy.Rational | None:
    """A declared bound as the rational its shortest decimal form names (1e-05 -> 1/100000)."""
    return None if v is None else sympy.Rational(repr(float(v)))


def _zero_numeric(diff: sympy.Expr, points: _Sampler, trials: int = 3) -> bool:
    """Evaluation in 80-digit arithmetic at random rational points (|difference| < 1e-40
    is zero: cancellation of terms up to ~1e35 stays below that; exact rational
    arithmetic would be exact but grows without bound inside tanh and exp -- a minute
    where this takes seconds), drawn within each option's declared bounds (see
    :class:`_Sampler`). A point where either side is undefined (NaN: two equal values
    at N = 2 make a deviation zero, and a root of it has no derivative there) is drawn
    again, up to 3 times per trial; a difference that is undefined everywhere is not zero."""
    done = tries = 0
    while done < trials:
        tries += 1
        if tries > 4 * trials:
            return False
        vals = {
            s: sympy.Float(points.value(s), NUMERIC_DIGITS) for s in sorted(diff.free_symbols, key=lambda s: s.name)
        }
        v = diff.xreplace(vals).evalf(NUMERIC_DIGITS)
        if v.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo):
            continue
        if not v.is_number or abs(v) > sympy.Float("1e-40", 60):
            return False
        done += 1
    return True
