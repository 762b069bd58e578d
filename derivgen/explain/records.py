"""The plain records the explanation is made of: a derivation step (:class:`Step`) and its
displayed equations (:class:`Equation`), with ∂num/∂den spelled in LaTeX and text, and what a
document shows of one mode (:class:`ModeDocument`), computed before rendering.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from derivgen.derive.results import ModeDerivation, SecondOrder
from derivgen.prove.proof import ModeProof


@dataclass(frozen=True)
class Equation:
    """One displayed equation: ``lhs = rhs`` (rhs a SymPy expression or None)."""

    lhs_latex: str
    lhs_text: str
    rhs: sympy.Expr | None = None
    note: str = ""
    note_latex: str = ""  # the note with its mathematics in LaTeX (optional)
    rel_latex: str = "="  # the relation between the sides: "=", or "\\leftarrow" for an update
    rel_text: str = "="


@dataclass(frozen=True)
class Step:
    """One step of a derivation: a title, its prose and its equations."""

    title: str
    prose: str
    equations: tuple[Equation, ...] = ()


def partial_latex(num: str, den: str) -> str:
    """∂num/∂den in LaTeX."""
    return rf"\frac{{\partial {num}}}{{\partial {den}}}"


def partial_text(num: str, den: str) -> str:
    """∂num/∂den in text."""
    return f"∂{num}/∂{den}"


@dataclass(frozen=True)
class ModeDocument:
    """What a document shows of one mode, all computed before rendering: the derivation, its
    steps (:func:`derivgen.explain.steps.build_steps`), its proof (None: not checked) and, for
    the second-order section, the second order and its proof."""

    derivation: ModeDerivation
    steps: tuple
    proof: ModeProof | None = None
    second: SecondOrder | None = None
    second_proof: ModeProof | None = None
