"""Stage 1, specs: a layer as data.

* :mod:`~derivgen.spec.model`: the TOML spec format, parsed and validated into a frozen
  :class:`Spec` (parameters, options, statistics, the output, modes, buffers);
* :mod:`~derivgen.spec.expr`: the restricted expression parser (an ``ast`` walk over
  a whitelist; nothing is evaluated);
* :mod:`~derivgen.spec.reserved`: the identifiers the targets reserve;
* ``catalogue/``: the built-in layers, one TOML file each (their code is committed in
  ``generated/``);
* ``zoo/``: published layers written as specs, loadable by name like the catalogue
  (generated on demand).
"""

from derivgen.spec.expr import ExprError, parse_expr
from derivgen.spec.model import (
    DY,
    N,
    Named,
    Spec,
    SpecError,
    Statistic,
    X,
    catalogue_names,
    load_catalogue,
    load_spec_file,
    parse_spec,
    zoo_names,
)

__all__ = [
    "DY",
    "ExprError",
    "N",
    "Named",
    "Spec",
    "SpecError",
    "Statistic",
    "X",
    "catalogue_names",
    "load_catalogue",
    "load_spec_file",
    "parse_expr",
    "parse_spec",
    "zoo_names",
]
