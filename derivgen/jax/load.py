"""A layer's generated JAX module (``generated/jax/<layer>.py``), emitted into derivgen's cache
from its spec on first use and imported from there (catalogue layers, spec files, Specs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from derivgen.api import load_spec, materialize
from derivgen.spec.model import Spec

_MODULES: dict = {}  # Spec and content digest -> module


def spec_of(name_or_spec: str | Path | Spec) -> Spec:
    """A catalogue name, a spec file or a Spec, as a Spec."""
    return name_or_spec if isinstance(name_or_spec, Spec) else load_spec(name_or_spec)


def module(name_or_spec: str | Path | Spec) -> ModuleType:
    """The generated JAX module of a layer (derived, emitted and imported once per spec)."""
    spec = spec_of(name_or_spec)
    if spec in _MODULES:
        return _MODULES[spec]
    root, digest = materialize(spec, "jax")
    if digest not in _MODULES:
        modname = f"derivgen_generated_jax_{spec.name}_{digest}"
        mspec = importlib.util.spec_from_file_location(modname, root / f"{spec.name}.py")
        mod = importlib.util.module_from_spec(mspec)
        sys.modules[modname] = mod
        mspec.loader.exec_module(mod)
        _MODULES[digest] = mod
    _MODULES[spec] = _MODULES[digest]
    return _MODULES[spec]
