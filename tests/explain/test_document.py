"""Derivations for people: every format renders; standalone LaTeX compiles."""

import subprocess

import pytest
from conftest import require_tool

import derivgen


@pytest.mark.parametrize("fmt", ["latex", "markdown", "text"])
def test_formats_render(fmt):
    out = derivgen.derive("layernorm", prove=(2,)).render(fmt)
    assert "Closed form" in out
    assert "proven" in out


def test_text_shows_the_compact_form_and_the_zero_term():
    out = derivgen.derive("layernorm").render("text")
    assert "∂L/∂x = ρ·(g - mean(g) - x̂·mean(g·x̂))" in out
    assert "negligible" in out and "exactly zero" in out


@pytest.mark.parametrize("name", derivgen.names())
def test_standalone_latex_compiles(name, tmp_path):
    exe = require_tool("pdflatex")
    tex = derivgen.derive(name, prove=(2, 3)).render("latex", standalone=True)
    (tmp_path / "d.tex").write_text(tex, encoding="utf-8")
    r = subprocess.run(
        [exe, "-interaction=nonstopmode", "-halt-on-error", "d.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-2000:]
    assert (tmp_path / "d.pdf").stat().st_size > 10_000


def test_second_order_latex_compiles(tmp_path):
    """The second-order section's prose (δx, ẋ, γ̇, L₂) and a zoo layer's (τ, ‖x‖, ₛ) set as
    ASCII LaTeX, and pdflatex takes them."""
    exe = require_tool("pdflatex")
    docs = [derivgen.derive("layernorm", prove=()).render("latex", standalone=True, order=2)]
    docs += [derivgen.derive(n, prove=()).render("latex", standalone=True) for n in ("frn", "weight_norm", "adain")]
    for k, tex in enumerate(docs):
        assert tex.isascii(), sorted({c for c in tex if not c.isascii()})
        (tmp_path / f"d{k}.tex").write_text(tex, encoding="utf-8")
        r = subprocess.run(
            [exe, "-interaction=nonstopmode", "-halt-on-error", f"d{k}.tex"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout[-2000:]


def test_prose_unicode_becomes_ascii_latex():
    from derivgen.explain.document import _tex_escape

    assert _tex_escape("σ² of x̂") == r"$\sigma^{2}$ of $\hat{x}$"
    assert _tex_escape("ẋ, γ̇ and L₂ = Σ δx") == r"$\dot{x}$, $\dot{\gamma}$ and L$_{2}$ = $\Sigma$ $\delta$x"
    assert _tex_escape("‖x‖ — “π”") == r"$\|$x$\|$ --- ``$\pi$''"
    assert _tex_escape("a ⊕ b").isascii()  # anything else by its name, never a raw character


def test_scalar_parameters_carry_no_element_subscript():
    from conftest import ROOT

    tex = derivgen.derive(ROOT / "examples" / "dynamic_tanh.toml").render("latex")
    assert r"\alpha" in tex and r"{\alpha}_i" not in tex
    assert r"{\gamma}_i" in tex  # a per-feature parameter keeps it


def test_buffer_updates_reductions_and_the_coordinate_read_as_written():
    text = derivgen.derive("batchnorm").render("text")
    assert "running_mean ← μ" in text and "← =" not in text
    assert "needs 2 reductions per group: mean(g), mean(g·x̂)." in text
    assert "needs no reduction over the group." in text and "0 reduction" not in text
    tex = derivgen.derive("batchnorm").render("latex")
    assert r"\hat{\mu} &\leftarrow \mu \mathrm{momentum}" in tex


def test_options_print_by_their_names():
    """An option whose display would abbreviate its name (momentum: m) is printed as the user
    passes it; Greek letters (eps: ε) and a spec's own ``text`` stay."""
    text = derivgen.derive("batchnorm", prove=()).render("text")
    assert "running_mean ← μ·momentum + running_mean·(1 - momentum)" in text
    assert "·m " not in text and "(1 - m)" not in text
    assert "ρ = 1/sqrt(σ² + ε)" in text


def test_the_second_order_lists_its_reductions_and_names_nothing_it_does_not_use():
    """No named reductions (Mean_dx) beside equations that spell the means out; "no
    reduction" rather than "0 reductions ... one sweep for them"; the DiracDelta note only
    for a layer with |u|. (The text is read, so the second order is rendered unproven:
    its proofs have their own tests, tests/derive/test_second.py.)"""
    derived = {name: derivgen.derive(name, prove=()) for name in ("layernorm", "batchnorm", "l1_batchnorm", "frn")}
    texts = {}
    for name, abs_note in (("layernorm", False), ("batchnorm", False), ("l1_batchnorm", True), ("frn", False)):
        for fmt in ("text", "markdown", "latex"):
            out = texts[name, fmt] = derived[name].render(fmt, order=2, second_sizes=())
            second = out[out.index("Second order") :]
            assert "Mean_" not in second, (name, fmt)
            assert "0 reductions" not in second and "sweep for them and" in second, (name, fmt)
            assert ("DiracDelta" in second) == abs_note, (name, fmt)
    text = texts["layernorm", "text"]
    assert "7 reductions per group (mean(δx), mean(g), mean(δx·g)," in text
    assert "tangents ẋ, γ̇, β̇: 2 reductions per group (mean(ẋ), mean(ẋ·x̂))." in text
    eval_mode = texts["batchnorm", "text"].split("Second order (evaluation mode)")[1]
    assert "to no reduction over the group: one sweep for the outputs" in eval_mode
    assert "β̇: no reduction over the group." in eval_mode
    l1_eval = texts["l1_batchnorm", "text"].split("(evaluation mode)")[-1]
    assert "DiracDelta" not in l1_eval  # the running statistics take no |u|


SPEC_WITH_ABS_AND_A_DECIMAL = """
name = "madnorm"
title = "Mean absolute deviation norm"
summary = "test."
[layout]
kind = "trailing"
[params]
gamma = { role = "scale" }
[options]
epsl = { default = 1e-5 }
[statistics]
mean = { expr = "mean(x)" }
mad = { expr = "1.2533141373155003*mean(abs(x - mean)) + abs(epsl)" }
[normalized]
name = "xhat"
expr = "(x - mean)/mad"
[output]
y = "gamma*xhat"
"""


def test_absolute_values_decimals_and_articles(tmp_path):
    path = tmp_path / "madnorm.toml"
    path.write_text(SPEC_WITH_ABS_AND_A_DECIMAL)
    d = derivgen.derive(path)
    text = d.render("text")
    assert "Abs(" not in text and "|epsl|" in text and "mean(|mean - x|)" in text
    assert "1.2533141373155003·mean(|mean - x|)" in text
    assert "12533141373155003" not in text and "10000000000000000" not in text
    assert "Σ xhat" in text or "x̂" not in text  # the coordinate under the spec's own name only
    assert "1.2533141373155003" in d.render("latex")
    assert " a a" not in text and " a e" not in text and " a i" not in text


def test_decimal_text_is_exact():
    import sympy

    from derivgen.explain.document import _decimal_text, _decimals

    assert _decimal_text(sympy.Rational(12533141373155003, 10**16)) == "1.2533141373155003"
    r = sympy.Rational(12533141373155003, 10**16) ** 2
    assert sympy.Rational(_decimal_text(r)) == r
    x = sympy.Symbol("x")
    assert _decimals(x / 3 + sympy.Rational(1, 10)) == x / 3 + sympy.Rational(1, 10)  # short ones stay


def test_the_worked_example_names_do_not_collide_with_g():
    from conftest import ROOT

    text = derivgen.derive(ROOT / "examples" / "scalenorm.toml").render("text")
    assert "∂L/∂x = ρ·s·(" in text and "∂L/∂y·g" not in text and "g·g" not in text


def test_a_derivation_renders_itself_in_a_notebook():
    d = derivgen.derive("batchnorm")
    md = d._repr_markdown_()
    assert md.startswith("# Batch normalization: the backward pass, derived")
    tex = d._repr_latex_()
    assert tex.startswith(r"$$\begin{aligned}") and tex.endswith(r"\end{aligned}$$")
    assert r"\text{Training mode}" in tex and r"\text{Evaluation mode}" in tex
    assert r"\frac{\partial L}{\partial x_i} &= \rho" in tex


def test_articles():
    from derivgen.explain.steps import _articles

    assert _articles("a absolute value in s") == "an absolute value in s"
    assert _articles("a square root in a exp") == "a square root in an exp"


@pytest.mark.parametrize(
    "written, text, latex",
    [
        ("sqrt(1.5707963267948966)*x", "sqrt(1.5707963267948966)·x", r"\sqrt{1.5707963267948966} {x}_i"),
        ("x/sqrt(1.5707963267948966)", "x/sqrt(1.5707963267948966)", r"\frac{{x}_i}{\sqrt{1.5707963267948966}}"),
        ("x/1.2533141373155003", "x/1.2533141373155003", r"\frac{{x}_i}{1.2533141373155003}"),
        ("-1.2533141373155003*x + 1", "1 - 1.2533141373155003·x", r"1 - 1.2533141373155003 {x}_i"),
        ("0.5*x", "x/2", r"\frac{{x}_i}{2}"),
    ],
)
def test_constants_print_as_written(written, text, latex):
    import sympy

    from derivgen.explain.document import latex_expr, text_expr
    from derivgen.spec.expr import parse_expr

    x = sympy.Symbol("x")
    e = parse_expr(written, {"x": x}, group_size=sympy.Symbol("N"))
    assert text_expr(e) == text
    assert latex_expr(e) == latex


def test_pi_prints_as_pi():
    import sympy

    from derivgen.explain.document import latex_expr, text_expr
    from derivgen.spec.expr import parse_expr

    x = sympy.Symbol("x")
    e = parse_expr("x*pi", {"x": x}, group_size=sympy.Symbol("N"))
    assert text_expr(e) == "π·x" and latex_expr(e) == r"\pi {x}_i"


def test_an_equality_mask_reads_as_an_equality_and_g_is_defined_before_use():
    """indicator(|x| - m)·indicator(m - |x|) prints [|x| = m] (text and LaTeX); the statistics'
    gradients that use g come after g's definition."""
    d = derivgen.derive("absmax_scale", prove=())
    text = d.render("text")
    assert "[|x| = m]" in text and "indicator" not in text
    assert r"\left[\left|{x}\right| = m\right]" in d.render("latex")
    frn = derivgen.derive("frn", prove=()).render("text")
    stats = frn.split("Gradients with respect to the statistics")[1]
    assert stats.index("g = ∂L/∂y·γ·step(") < stats.index("mean(g·x̂)")
