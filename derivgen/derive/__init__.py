"""Stage 2, derivation: a :class:`~derivgen.spec.Spec` in, closed forms out, in general N.

* :mod:`~derivgen.derive.first`: the first order's entry, ``derive_mode`` -- reverse mode
  through the forward program and its group reductions, simplified by targeted rewrites
  into ``ModeDerivation`` (dx, parameter and input gradients, the run-time reductions they
  need). Its steps: :mod:`~derivgen.derive.program` (the statistics as a program, with the
  auxiliaries the engine names), :mod:`~derivgen.derive.reverse` (the coordinate and the
  adjoints, latest statistic first), :mod:`~derivgen.derive.closed_forms` (the adjoints in
  closed form, in the fewest run-time means), :mod:`~derivgen.derive.core` (a layer whose
  statistics read a core value h = f(x, t): derived in h, then the chain rule);
* :mod:`~derivgen.derive.coordinate`: the normalized coordinate (x̂) the closed forms are
  written in;
* :mod:`~derivgen.derive.rewrite`: the targeted rewrites both orders share (``tidy``,
  ``closed_form``, ``fewest_closed_forms``), over :mod:`~derivgen.derive.terms` (what keeps
  ``tidy``'s work bounded: ``factor_terms`` remembering its sub-expressions, a large sum
  expanded with its denominators factored);
* :mod:`~derivgen.derive.second`: the second order's entry, ``derive_second`` -- the double
  backward (:mod:`~derivgen.derive.double_backward`) and the JVP
  (:mod:`~derivgen.derive.jvp`) from their seeds (:mod:`~derivgen.derive.seeds`);
* :mod:`~derivgen.derive.results`: the data handed on, ``ModeDerivation`` and ``SecondOrder``.

Inside the stage, imports go one way: program, results, terms, rewrite, coordinate; reverse,
closed_forms, core, first; seeds, double_backward, jvp, second.
Results are frozen data; nothing here keeps an engine after it returns.
"""

from derivgen.derive.first import DerivationError, ModeDerivation, derive_mode
from derivgen.derive.second import SecondOrder, derive_second

__all__ = ["DerivationError", "ModeDerivation", "SecondOrder", "derive_mode", "derive_second"]
