"""Derivations for people: LaTeX, Markdown and plain text.

A document (:func:`render`) lays out each mode's steps, closed forms and proof from data
computed beforehand (:class:`~derivgen.explain.records.ModeDocument`); expressions print
with :mod:`~derivgen.explain.printers`, prose in LaTeX with :mod:`~derivgen.explain.tex`,
and the second-order section is :mod:`~derivgen.explain.second_order`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from derivgen.derive.results import ModeDerivation
from derivgen.explain.printers import (  # noqa: F401 (the tests import _decimal_text and _decimals from here)
    _decimal_text,
    _decimals,
    _mode_title,
    latex_expr,
    mode_names,
    text_expr,
)
from derivgen.explain.records import ModeDocument
from derivgen.explain.second_order import render_second
from derivgen.explain.tex import _tex_escape, _tex_mixed
from derivgen.prove.proof import ModeProof
from derivgen.spec.model import Spec

__all__ = [
    "FORMATS",
    "ModeDocument",
    "check_format",
    "closed_forms_latex",
    "latex_expr",
    "mode_names",
    "render",
    "text_expr",
]


PREAMBLE = r"""\documentclass[11pt]{article}
\usepackage[utf8]{inputenc}
\usepackage[T1]{fontenc}
\usepackage{amsmath,amssymb}
\usepackage[margin=2.2cm]{geometry}
\allowdisplaybreaks
"""


FORMATS = ("latex", "markdown", "text")


def check_format(fmt: str) -> None:
    """Raise ValueError unless ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be latex, markdown or text, got {fmt!r}")


def render(spec: Spec, modes: list[ModeDocument], fmt: str = "latex", standalone: bool = False) -> str:
    """The derivation document of a layer in LaTeX, Markdown or text, from data computed
    beforehand; a "Second order" section follows when the modes carry their second order."""
    check_format(fmt)
    second = render_second(spec, modes, fmt) if any(m.second is not None for m in modes) else ""
    if fmt == "latex":
        body = _render_latex(spec, modes) + second
        if standalone:
            return (
                PREAMBLE
                + f"\\title{{{_tex_escape(spec.title)}: the backward pass, derived}}\n\\author{{derivgen}}\n\\date{{}}\n"
                f"\\begin{{document}}\n\\maketitle\n{body}\\end{{document}}\n"
            )
        return body
    if fmt == "markdown":
        return _render_markdown(spec, modes) + second
    return _render_text(spec, modes) + second


def closed_forms_latex(spec: Spec, steps: Mapping[str, tuple], modes: Mapping[str, ModeDerivation]) -> str:
    """The closed forms of each mode (g, ∂L/∂x, the parameters' and the inputs' gradients, from
    its ``steps``) as one LaTeX ``aligned`` block: what a notebook shows for a derivation."""
    lines = []
    for name, mode_steps in steps.items():
        if len(steps) > 1:
            lines.append(rf"&\text{{{_mode_title(modes[name], len(steps))}}}")
        for step in mode_steps:
            if step.title not in ("Closed form", "Parameter gradients", "Gradients of the per-group inputs"):
                continue
            for eq in step.equations:
                if eq.rhs is not None and not eq.lhs_latex.startswith(r"\sum"):
                    lines.append(f"{eq.lhs_latex} &= {latex_expr(eq.rhs, spec, extra=mode_names(modes[name]))}")
    return r"\begin{aligned}" + " \\\\ ".join(lines) + r"\end{aligned}"


def _latex_notes(step) -> list[str]:
    """The notes of a step's equations as a LaTeX list (none: nothing)."""
    if not any(eq.note for eq in step.equations):
        return []
    out = [r"\begin{itemize}"]
    for eq in step.equations:
        if eq.note:
            note = _tex_mixed(eq.note_latex) if eq.note_latex else _tex_escape(eq.note)
            out.append(rf"\item ${eq.lhs_latex}$: {note}")
    out.append(r"\end{itemize}")
    return out


def _latex_step(step, spec: Spec, mode: ModeDerivation, heading: str) -> list[str]:
    """One step in LaTeX under ``heading`` (a sectioning command): prose, an align* block, the notes."""
    out = [f"{heading}{{{_tex_escape(step.title)}}}"]
    if step.prose:
        out.append(_tex_escape(step.prose))
    if step.equations:
        lines = []
        for eq in step.equations:
            if eq.rhs is None:
                lines.append(eq.lhs_latex.replace(" = ", " &= ", 1))
            else:
                lines.append(f"{eq.lhs_latex} &{_rel(eq, 'latex')} " + latex_expr(eq.rhs, spec, extra=mode_names(mode)))
        out += [r"\begin{align*}", " \\\\\n".join(lines), r"\end{align*}"]
        out += _latex_notes(step)
    out.append("")
    return out


def _render_latex(spec: Spec, modes: list[ModeDocument]) -> str:
    out = []
    if spec.summary:
        out.append(_tex_escape(spec.summary) + "\n")
    for note in spec.notes:
        out.append(r"\paragraph{Note.} " + _tex_escape(note) + "\n")
    for doc in modes:
        mode = doc.derivation
        mt = _mode_title(mode, len(modes))
        if mt:
            out.append(rf"\section{{{mt}}}")
        for step in doc.steps:
            out += _latex_step(step, spec, mode, r"\subsection*" if mt else r"\section*")
        out.append(_proof_latex(doc.proof))
    return "\n".join(out) + "\n"


def _rel(eq: object, kind: str) -> str:
    """An equation's relation ("=" unless the step says otherwise, as a buffer update's ←)."""
    return getattr(eq, f"rel_{kind}", "=")


def _proof_lines(proof: ModeProof | None) -> list[str]:
    if proof is None:
        return ["Not checked against brute force (run with proofs enabled)."]
    return [f"N = {r.n}: {r.status} ({r.method}, {r.seconds:.2f} s)" for r in proof.results]


def _proof_latex(proof: ModeProof | None) -> str:
    items = "\n".join(r"\item " + _tex_escape(line) for line in _proof_lines(proof))
    return (
        r"\section*{Proof against brute force}"
        "\n"
        "For each N the layer is built from N explicit scalar symbols, differentiated with "
        "sympy.diff, and the difference from the closed form above is reduced to zero in exact rational "
        "arithmetic (``proven''); where that does not finish within its budget of work it is evaluated in "
        "80-digit arithmetic at random rational points (``checked numerically'').\n"
        r"\begin{itemize}"
        "\n" + items + "\n"
        r"\end{itemize}"
        "\n"
    )


def _render_markdown(spec: Spec, modes: list[ModeDocument]) -> str:
    out = [f"# {spec.title}: the backward pass, derived", ""]
    if spec.summary:
        out += [spec.summary, ""]
    for note in spec.notes:
        out += [f"> **Note.** {note}", ""]
    for doc in modes:
        mode = doc.derivation
        mt = _mode_title(mode, len(modes))
        if mt:
            out += [f"## {mt}", ""]
        h = "###" if mt else "##"
        for step in doc.steps:
            out += [f"{h} {step.title}", ""]
            if step.prose:
                out += [step.prose, ""]
            for eq in step.equations:
                if eq.rhs is None:
                    out.append(f"$$ {eq.lhs_latex} $$")
                else:
                    rhs = latex_expr(eq.rhs, spec, extra=mode_names(mode))
                    out.append(f"$$ {eq.lhs_latex} {_rel(eq, 'latex')} {rhs} $$")
                if eq.note:
                    out.append(f"*{eq.note}*")
                out.append("")
        out += [f"{h} Proof against brute force", ""]
        out += [f"- {line}" for line in _proof_lines(doc.proof)] + [""]
    return "\n".join(out)


def _render_text(spec: Spec, modes: list[ModeDocument]) -> str:
    out = [f"{spec.title}: the backward pass, derived", "=" * (len(spec.title) + 30)]
    if spec.summary:
        out += [spec.summary]
    for note in spec.notes:
        out += [f"Note: {note}"]
    for doc in modes:
        mode = doc.derivation
        mt = _mode_title(mode, len(modes))
        if mt:
            out += ["", f"## {mt}"]
        for step in doc.steps:
            out += ["", f"{step.title}", "-" * len(step.title)]
            if step.prose:
                out += [step.prose]
            for eq in step.equations:
                rhs = (
                    "" if eq.rhs is None else f" {_rel(eq, 'text')} " + text_expr(eq.rhs, spec, extra=mode_names(mode))
                )
                out.append("  " + eq.lhs_text + rhs)
                if eq.note:
                    out.append(f"      ({eq.note})")
        out += ["", "Proof against brute force", "-------------------------"]
        out += [f"  {line}" for line in _proof_lines(doc.proof)]
    return "\n".join(out) + "\n"
