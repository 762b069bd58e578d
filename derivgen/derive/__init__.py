"""Stage 2, derivation: a :class:`~derivgen.spec.Spec` in, closed forms out, in general N.

* :mod:`~derivgen.derive.first`: reverse mode through the forward program and its group
  reductions, simplified by targeted rewrites into ``ModeDerivation`` (dx, parameter and
  input gradients, the run-time reductions they need);
* :mod:`~derivgen.derive.coordinate`: the normalized coordinate (x̂) the closed forms are
  written in;
* :mod:`~derivgen.derive.second`: the double backward and the JVP, ``SecondOrder``.

Results are frozen data; nothing here keeps an engine after it returns.
"""

from derivgen.derive.first import DerivationError, ModeDerivation, derive_mode
from derivgen.derive.second import SecondOrder, derive_second

__all__ = ["DerivationError", "ModeDerivation", "SecondOrder", "derive_mode", "derive_second"]
