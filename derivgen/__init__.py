"""derivgen: backward passes of normalization layers, derived symbolically,
proven, and generated as NumPy, C and PyTorch code."""

from derivgen.api import derive, load, load_spec, names, zoo
from derivgen.derive.first import ModeDerivation
from derivgen.spec.from_torch import from_torch
from derivgen.spec.model import Spec, SpecError

__all__ = ["ModeDerivation", "Spec", "SpecError", "derive", "from_torch", "load", "load_spec", "names", "zoo"]
__version__ = "0.1.0"
