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
