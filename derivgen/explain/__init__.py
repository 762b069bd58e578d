"""Stage 4, explanation: derivations for people.

* :mod:`~derivgen.explain.steps`: the derivation as numbered steps (frozen ``Step`` records),
  with :mod:`~derivgen.explain.gradients` (the closed form and the gradients' steps) and
  :mod:`~derivgen.explain.reasons` (display names; which terms vanish, and why);
* :mod:`~derivgen.explain.records`: ``Step``, ``Equation``, ``ModeDocument``;
* :mod:`~derivgen.explain.document`: steps, closed forms and proofs laid out as LaTeX,
  Markdown or text, with :mod:`~derivgen.explain.second_order` (the second-order section).
  Rendering runs nothing: proofs arrive as data;
* :mod:`~derivgen.explain.printers`: expressions in LaTeX and text with display names;
  :mod:`~derivgen.explain.tex`: prose as LaTeX text.
"""

from derivgen.explain.document import FORMATS, ModeDocument, latex_expr, render, text_expr
from derivgen.explain.steps import Step, build_steps

__all__ = ["FORMATS", "ModeDocument", "Step", "build_steps", "latex_expr", "render", "text_expr"]
