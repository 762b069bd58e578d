"""Stage 1, specs: a layer as data.

* :mod:`~derivgen.spec.model`: the frozen :class:`Spec` and the types it is made of
  (parameters, options, statistics, modes, buffers, tensor inputs, outputs), the format's
  tables (layouts, tensor shapes, the names a spec may not declare);
* :mod:`~derivgen.spec.parse`: the TOML spec format parsed and validated into a
  :class:`Spec` (:func:`parse_spec`; the fields and the sections that declare names in
  :mod:`~derivgen.spec.declare`);
* :mod:`~derivgen.spec.library`: the built-in layers by name (``catalogue/``, ``zoo/``) and
  specs read from files;
* :mod:`~derivgen.spec.expr`: the restricted expression parser (an ``ast`` walk over
  a whitelist; nothing is evaluated);
* :mod:`~derivgen.spec.reserved`: the identifiers the targets reserve;
* ``catalogue/``: the built-in layers, one TOML file each (their code is committed in
  ``generated/``);
* ``zoo/``: published layers written as specs, loadable by name like the catalogue
  (generated on demand).
"""

from derivgen.spec.expr import ExprError, parse_expr
from derivgen.spec.library import catalogue_names, load_catalogue, load_spec_file, zoo_names
from derivgen.spec.model import DY, N, Named, Spec, SpecError, Statistic, X, reserved_reason
from derivgen.spec.parse import parse_spec

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
    "reserved_reason",
    "zoo_names",
]
