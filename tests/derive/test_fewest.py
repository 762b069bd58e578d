"""The fewest run-time means (derivgen.symbolic.fewest): what merges, what may not, and that
every merge is exact."""

from __future__ import annotations

import sympy

from derivgen.symbolic.fewest import _ratio, fewest_means
from derivgen.symbolic.reduce import Mean, means

x, dy, gamma, rho = sympy.symbols("x dy gamma rho", real=True)  # element values (gamma per channel)
a, b, c = sympy.symbols("a b c", real=True)  # one value per group
s = sympy.Symbol("s", positive=True)
ELEMENT = {x, dy, gamma, rho}


def merge(exprs, retidy=None):
    return fewest_means(
        exprs,
        lambda es: sorted({m for e in es for m in means(e)}, key=sympy.default_sort_key),
        lambda m: m.args[0],
        Mean,
        lambda f: not (f.free_symbols & ELEMENT),
        retidy=retidy,
    )


def same(e1, e2) -> bool:
    """Equal once every mean is written out by linearity (what the merge must keep)."""

    def lin(e):
        return sympy.expand(
            e.replace(
                lambda t: isinstance(t, Mean),
                lambda m: sum(
                    sympy.Mul(*[f for f in sympy.Mul.make_args(t) if not f.free_symbols & ELEMENT])
                    * sympy.Function("M")(sympy.Mul(*[f for f in sympy.Mul.make_args(t) if f.free_symbols & ELEMENT]))
                    for t in sympy.Add.make_args(sympy.expand(m.args[0]))
                ),
            )
        )

    return sympy.simplify(lin(e1) - lin(e2)) == 0


def test_means_with_proportional_coefficients_are_one_mean_of_the_sum():
    # an instance-layer norm's <dy·γ> - <dy·γ·ρ>: one mean, <dy·γ·(1 - ρ)>
    dx = dy * gamma / s - (Mean(dy * gamma) - Mean(dy * gamma * rho)) / s
    dp = x * (Mean(dy * gamma) - Mean(dy * gamma * rho))
    out = merge([dx, dp])
    assert len({m for e in out for m in means(e)}) == 1
    (m,) = means(out[0])
    assert m.args[0] == dy * gamma * (1 - rho)
    assert same(out[0], dx) and same(out[1], dp)


def test_a_taylor_softmax_needs_one_mean():
    dx = (x + 1) * (dy - (Mean(dy) + Mean(dy * x) + Mean(dy * x**2) / 2) / s) / s
    (out,) = merge([dx])
    (m,) = means(out)
    assert sympy.cancel(m.args[0] / (dy * (1 + x + x**2 / 2))).is_Number  # (the engine spells it as f)
    assert same(out, dx)


def test_a_factor_that_varies_within_the_group_is_not_taken_out():
    # γ is per channel: <dy·γ> and <dy> are two means however the coefficients look
    dx = a * Mean(dy * gamma) + a * Mean(dy) * x
    out = merge([dx])
    assert len(means(out[0])) == 2


def test_no_ratio_divides_by_what_may_vanish():
    assert _ratio({x: a}, {x: a * rho}) is None  # 1/ρ
    assert _ratio({x: a * rho}, {x: a}) == rho
    assert _ratio({x: 2 * s}, {x: s}) == 2


def test_fewer_directions_than_means_give_one_mean_per_direction():
    dx = a * Mean(dy) + x * (b * Mean(dy * gamma) + c * Mean(dy * x))
    assert merge([dx]) == [dx]  # no direction merge without a layout to rebuild in
    (out,) = merge([dx], retidy=lambda e: e)
    assert len(means(out)) == 2
    assert same(out, dx)


def test_no_mean_moves_into_another_mean():
    # x·(<x>·<dy> + <dy·x>) by directions would be x·<<x>·dy + dy·x>: a mean inside a mean
    dx = x * (Mean(x) * Mean(dy) + Mean(dy * x))
    (out,) = fewest_means(
        [dx],
        lambda es: sorted({m for e in es for m in means(e) if m.has(dy)}, key=sympy.default_sort_key),
        lambda m: m.args[0],
        Mean,
        lambda f: not (f.free_symbols & ELEMENT) or not f.has(dy) and isinstance(f, Mean),
        retidy=lambda e: e,
    )
    assert not any(m.args[0].has(Mean) for m in means(out))
    assert same(out, dx)
