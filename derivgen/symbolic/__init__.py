"""Stage 0, symbolic building blocks every later stage shares.

* :mod:`~derivgen.symbolic.reduce`: the group mean ``Mean`` as a SymPy function and
  ``ReductionAlgebra``, which knows the statistics' means (linearity, known values);
* :mod:`~derivgen.symbolic.functions`: the table of elementary functions (one entry
  per function: derivative, sign and domain rules, every target's spelling);
* :mod:`~derivgen.symbolic.domain`: signs and domains of expressions;
* :mod:`~derivgen.symbolic.naming`: how symbols are shown to people and named in code.

Nothing here imports another derivgen stage.
"""

from derivgen.symbolic.functions import TABLE, Elementary, register, unregister
from derivgen.symbolic.reduce import Mean, ReductionAlgebra, expand, hide_means, means

__all__ = ["TABLE", "Elementary", "Mean", "ReductionAlgebra", "expand", "hide_means", "means", "register", "unregister"]
