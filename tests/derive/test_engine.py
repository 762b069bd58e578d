"""The derivation engine: compact closed forms, minimal reductions, the
vanishing terms recorded with their reasons, and the online path kept."""

import pytest
import sympy

import derivgen
from derivgen.derive.first import G
from derivgen.symbolic.reduce import Mean

xhat, rstd = sympy.symbols("xhat rstd")
rstd = sympy.Symbol("rstd", real=True)


def _plain(e):
    """The same expression over plain symbols (the engine's carry assumptions: real, positive)."""
    return e.xreplace({s: sympy.Symbol(s.name) for s in e.free_symbols})


def _same(a, b):
    return sympy.expand(_plain(a) - _plain(b)) == 0


@pytest.mark.parametrize("name", ["layernorm", "instancenorm", "groupnorm", "batchnorm"])
def test_centered_layers_reach_the_textbook_form(name):
    d = derivgen.derive(name)
    expected = rstd * (G - Mean(G) - xhat * Mean(G * xhat))
    assert _same(d.dx, expected), d.dx
    assert sorted(r.name for r in d.reductions) == ["Mean_g", "Mean_g_xhat"]
    assert _same(d.train.g, sympy.Symbol("dy") * sympy.Symbol("gamma"))


def test_rmsnorm_needs_one_reduction():
    d = derivgen.derive("rmsnorm")
    assert _same(d.dx, rstd * (G - xhat * Mean(G * xhat)))
    assert [r.name for r in d.reductions] == ["Mean_g_xhat"]


def test_batchnorm_eval_backward_is_elementwise():
    md = derivgen.derive("batchnorm").modes["eval"]
    assert md.reductions == ()
    assert _same(md.dx, G * rstd)


def test_parameter_gradients():
    d = derivgen.derive("layernorm")
    dy = sympy.Symbol("dy")
    assert {k: _plain(v) for k, v in d.dparams.items()} == {"gamma": dy * xhat, "beta": dy}


def test_vanishing_terms_are_recorded_with_reasons():
    d = derivgen.derive("layernorm")
    whats = " | ".join(w for w, _ in d.vanishing)
    assert "∂σ²/∂μ" in whats
    assert "Σ_j x̂_j" in whats
    assert any("negligible" in why and "exactly zero" in why for _, why in d.vanishing)
    assert d.kept == []


def test_online_layernorm_keeps_the_sum_of_deviations_path():
    d = derivgen.derive("online_layernorm")
    # with alpha < 1, <x - mu_t> = x̄ - mu_t is not zero: the engine keeps it
    assert d.kept, "the <x - mu_t> path must be kept"
    assert "row_mean" in {s.name for s in d.dx.free_symbols}
    assert set(d.dinputs) == {"prev_mean", "prev_std"}
    assert len(d.reductions) == 2


def test_online_with_alpha_one_is_layernorm_with_unbiased_std():
    d = derivgen.derive("online_layernorm")
    alpha, std, s, N, mean, row_mean = sympy.symbols("alpha std sample_std N mean row_mean")
    dx1 = _plain(d.dx).subs(alpha, 1).subs({s: std, mean: row_mean})  # alpha = 1: s = σₜ, μₜ = x̄
    # unbiased: std = sqrt(N/(N-1) var) => the x̂ coefficient carries N/(N-1)
    expected = (G - Mean(G) - N / (N - 1) * xhat * Mean(G * xhat)) / std
    assert _same(dx1, expected), dx1
    # and the gradients to the previous moments vanish
    for v in d.dinputs.values():
        assert sympy.expand(_plain(v).subs(alpha, 1).subs(mean, row_mean)) == 0


def test_derivation_has_the_steps_people_expect():
    d = derivgen.derive("batchnorm")
    titles = [s.title for s in d.steps]
    for t in [
        "Definitions",
        "Local partial derivatives",
        "Partial derivatives of the statistics",
        "Gradients with respect to the statistics",
        "Closed form",
        "Parameter gradients",
        "Running buffers (not differentiated)",
    ]:
        assert t in titles
    assert set(d.modes) == {"train", "eval"}


def test_no_simplify_in_the_main_path(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("sympy.simplify called")

    monkeypatch.setattr(sympy, "simplify", boom)
    from derivgen.api import _derive_spec

    _derive_spec.cache_clear()
    for n in derivgen.names():
        derivgen.derive(n)
