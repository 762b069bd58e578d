"""The restricted expression parser: accepts the spec language, rejects code."""

import time

import pytest
import sympy

from derivgen.spec.expr import ExprError, parse_expr
from derivgen.symbolic.reduce import Mean

x, mu, eps = sympy.symbols("x mu eps")
N = sympy.Symbol("N")
NAMES = {"x": x, "mu": mu, "eps": eps, "N": N}


def p(text, **kw):
    return parse_expr(text, NAMES, group_size=N, **kw)


def test_arithmetic_and_functions():
    assert p("(x - mu)**2 / 2") == (x - mu) ** 2 / 2
    assert p("1/sqrt(mu + eps)") == 1 / sympy.sqrt(mu + eps)
    assert p("exp(x) + log(eps) - abs(x)") == sympy.exp(x) + sympy.log(eps) - sympy.Abs(x)
    assert p("-x + +mu") == -x + mu


def test_numbers_are_exact_rationals():
    assert p("0.1") == sympy.Rational(1, 10)
    assert p("1e-5") == sympy.Rational(1, 100000)


def test_reductions():
    assert p("mean(x)") == Mean(x)
    assert p("sum(x*x)") == N * Mean(x**2)
    with pytest.raises(ExprError, match="group reduction"):
        p("mean(x)", allow_reductions=False)


@pytest.mark.parametrize(
    "bad, why",
    [
        ("__import__('os').system('echo hi')", "only calls"),
        ("x.__class__", "Attribute"),
        ("lambda: 1", "Lambda"),
        ("[x for x in mu]", "ListComp"),
        ("x[0]", "Subscript"),
        ("'text'", "numeric constants"),
        ("open('f')", "unknown function"),
        ("sqrt(x, 2)", "exactly one"),
        ("sqrt(x=1)", "no keyword arguments: one positional argument"),
        ("clip(x, lo=0, hi=1)", "no keyword arguments: 3 positional arguments"),
        ("y + 1", "unknown name 'y'"),
        ("x ** 10**10", "exponent"),
        ("x if mu else eps", "IfExp"),
        ("x < mu", "Compare"),
        ("x // 2", "unsupported operator"),
        ("(x", "bad syntax"),
        ("", "empty"),
        ("sqrt", "used as a value"),
        ("x / 0", "division by zero"),
        ("True", "numeric"),
    ],
)
def test_rejects(bad, why):
    with pytest.raises(ExprError, match=why.replace("(", r"\(").replace("[", r"\[")):
        p(bad)


def test_rejects_huge_input_quickly():
    t0 = time.perf_counter()
    for bad in ["x+" * 5000 + "x", "(" * 500 + "x" + ")" * 500, "+".join(["x"] * 600)]:
        with pytest.raises(ExprError):
            p(bad)
    assert time.perf_counter() - t0 < 2.0


def test_group_values_come_out_of_a_group_maximum():
    from derivgen.symbolic.reduce import GroupMax, GroupMin, Mean

    assert p("max(x - mean(x))") == GroupMax(x) - Mean(x)
    assert p("min(x**2 + mu + 1)") == GroupMin(x**2) + mu + 1
    assert p("max(abs(x) + 1)") == GroupMax(abs(x)) + 1
    assert p("max(mu*x)") == GroupMax(mu * x)  # a factor stays: its sign would decide max or min
