"""Stage 4, explanation: derivations for people.

* :mod:`~derivgen.explain.steps`: the derivation as numbered steps (frozen ``Step`` records);
* :mod:`~derivgen.explain.document`: steps, closed forms and proofs laid out as LaTeX,
  Markdown or text. Rendering runs nothing: proofs arrive as data.
"""

from derivgen.explain.document import FORMATS, ModeDocument, latex_expr, render, text_expr
from derivgen.explain.steps import Step, build_steps

__all__ = ["FORMATS", "ModeDocument", "Step", "build_steps", "latex_expr", "render", "text_expr"]
