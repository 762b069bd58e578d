"""The derivation engine: reverse mode through group reductions, in general N.

For one mode of a spec (statistics s_1..s_K, normalized coordinate x̂, output
y) it derives, as a careful person does by hand:

1. the statistics as a *program* (:class:`~derivgen.derive.program.Program`): every
   group mean the statistics are not linear in, and every square root, power, exp,
   log, abs or tanh of group values inside a larger statistic, is named as an
   auxiliary statistic. The engine then knows every mean the forward
   computes, and every derivative is rational in named values
   (d√u/du = 1/(2√u) is 1/(2·a) for the named a = √u) -- so the closed form
   is the same whether a user writes one statistic or three;
2. the adjoint of every statistic, latest first (∂L/∂s_k), through the
   partial derivatives of the program, with the terms that vanish by the
   definitions of the statistics recorded with their reasons
   (∂σ²/∂μ ∝ Σ(x-μ) = 0) and the ones that look like they vanish but do
   not recorded as kept;
3. ∂L/∂x and the gradients of per-channel parameters: element-level, with
   per-group coefficients; rewritten in the normalized coordinate x̂ and in
   g = ∂L/∂y · ∂y/∂x̂, where they collapse to compact closed forms with few
   group reductions; per-group inputs and scalar parameters that enter the
   statistics get per-group gradients.

No ``sympy.simplify``: only linearity of means, known statistics (from
:mod:`derivgen.symbolic.reduce`), substitution of x̂, ``expand`` and ``factor`` on
small per-group coefficients, ``factor_terms``. The result is plain data
(:class:`ModeDerivation`); the document for people is built from it in
:mod:`derivgen.explain.steps`.

This module is the entry (:func:`derive_mode`); the work is done in
:mod:`~derivgen.derive.program` (step 1), :mod:`~derivgen.derive.reverse` (steps 2 and 3),
:mod:`~derivgen.derive.closed_forms` with the rewrites of :mod:`~derivgen.derive.rewrite`,
and :mod:`~derivgen.derive.core` (a layer whose statistics read a core value h = f(x, t));
the results are :mod:`~derivgen.derive.results`' types.
"""

from __future__ import annotations

from derivgen.derive.closed_forms import Deriver
from derivgen.derive.core import _through_core
from derivgen.derive.results import DerivationError, G, ModeDerivation, ParamGrad, Partial, Reduction
from derivgen.spec.model import Spec

__all__ = ["DerivationError", "G", "ModeDerivation", "ParamGrad", "Partial", "Reduction", "derive_mode"]


def derive_mode(spec: Spec, mode_name: str | None = None) -> ModeDerivation:
    """The first-order derivation of one mode of ``spec`` (the first mode by default)."""
    try:
        if spec.core is not None:
            return _through_core(spec, mode_name)
        return Deriver(spec, spec.mode(mode_name)).run()
    except DerivationError:
        raise
    except (TypeError, ValueError, AttributeError, NotImplementedError, RecursionError) as exc:
        raise DerivationError(
            f"{spec.source}: the engine cannot derive this layer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else 'no detail'})"
        ) from None
