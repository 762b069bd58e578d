"""derivgen: backward passes of normalization layers, derived symbolically,
proven, and generated as NumPy and C."""

from .api import derive, load, load_spec, names
from .engine import ModeDerivation
from .spec import Spec, SpecError

__all__ = ["derive", "names", "load", "load_spec", "Spec", "SpecError", "ModeDerivation"]
__version__ = "0.1.0"
