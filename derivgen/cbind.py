"""The import path generated C bindings use (``from derivgen.cbind import CKernel``).

The binding itself lives in :mod:`derivgen.runtime.cbind`; this name is kept
because the committed generated modules import it.
"""

from derivgen.runtime.cbind import CKernel

__all__ = ["CKernel"]
