"""derivgen: backward passes of normalization layers, derived symbolically,
proven, and generated as NumPy and C."""

from derivgen.api import derive, load, load_spec, names
from derivgen.derive.first import ModeDerivation
from derivgen.spec.model import Spec, SpecError

__all__ = ["derive", "names", "load", "load_spec", "Spec", "SpecError", "ModeDerivation"]
__version__ = "0.1.0"
