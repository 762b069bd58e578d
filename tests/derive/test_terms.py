"""derive.terms: the remembered factor_terms is SymPy's, and a large sum expanded with its
denominators factored keeps its value."""

import random

import pytest
import sympy

from derivgen.derive import rewrite
from derivgen.derive.terms import expand_factored, factor_terms, size
from derivgen.symbolic.reduce import Mean, expand

a, b, c, n, v, eps, x = sympy.symbols("a b c n v epsilon x", real=True)
N = sympy.Symbol("N", positive=True)

CASES = [
    -a - b,
    -2 * a - 2 * b,
    a / 2 + 1,
    x + x * (2 + 4 * a) ** 3,
    sympy.exp(-(x + 2)) + a * sympy.exp(-(x + 2)),
    2 * a * Mean(x * b + x * c) + 4 * a * Mean(x) ** 2 * (b + c),
    (6 * a * n + 6 * a * v) / (2 * N * n * v**2 - 2 * n * v**2) + 3 * a * b / (N * n * v**2 - n * v**2),
    sympy.sqrt(a * x + a * b) * (c * x + c) + sympy.Abs(2 * a - 2 * b) * sympy.Rational(3, 4),
    sympy.Tuple(2 * a + 2 * b, a * x - a),
]


@pytest.mark.parametrize("e", CASES, ids=range(len(CASES)))
def test_remembered_factor_terms_is_sympys(e):
    seen: dict = {}
    assert factor_terms(e, seen) == sympy.factor_terms(e)
    assert factor_terms(e, seen) == sympy.factor_terms(e)  # again, from what it remembered
    assert factor_terms(sympy.Add(e, 1) if not isinstance(e, sympy.Tuple) else e, seen) == sympy.factor_terms(
        sympy.Add(e, 1) if not isinstance(e, sympy.Tuple) else e
    )


def _large(count: int) -> sympy.Expr:
    """Many terms over a few denominators written multiplied out, as a second order's closed
    forms with masked statistics are."""
    rnd = random.Random(7)
    dens = [expand((N - 1) ** i * n**j * (eps + v) ** k) for i, j, k in [(1, 1, 2), (2, 2, 4), (3, 3, 4), (1, 2, 3)]]
    mono = [a, b, c, a * b, a * c, b * c, a**2, N, N**2, N * a]
    terms = [
        rnd.randint(1, 9) * rnd.choice(mono) * x ** rnd.randint(0, 2) * Mean(x ** rnd.randint(1, 2)) / rnd.choice(dens)
        for _ in range(count)
    ]
    return sympy.Add(*terms)


def test_a_large_sum_keeps_its_value_with_its_denominators_factored(monkeypatch):
    monkeypatch.setattr(rewrite, "LARGE", 1000)  # tidy's large path, on a sum small enough to test
    e = _large(40)
    assert size(e) > rewrite.LARGE
    out = expand_factored(e)
    assert (N - 1) in out.atoms(sympy.Add) or (1 - N) in out.atoms(sympy.Add)
    tidied = rewrite.tidy(e, {x})
    assert size(tidied) < size(e) / 4
    rnd = random.Random(3)
    for _ in range(3):
        point = {s: sympy.Rational(rnd.randint(2, 40), rnd.randint(1, 9)) for s in (a, b, c, n, v, eps, x, N)}
        point |= {m: sympy.Rational(rnd.randint(1, 40), 7) for m in e.atoms(Mean)}
        want = e.xreplace(point)
        assert out.xreplace(point) == want
        assert tidied.xreplace(point) == want
