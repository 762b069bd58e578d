"""timm's own layer classes, from the installed timm, without timm's package ``__init__``.

timm's ``__init__`` (and ``timm.layers``' and ``timm.data``'s) import torchvision. PyPI has no
torchvision built for the CPU wheel of torch this project pins (its wheels link CUDA
libtorch), so the Makefile installs timm without dependencies and the tests load the layer
files themselves: ``timm`` and ``timm.layers`` are made empty packages over timm's installed
folders, so ``import timm.layers.norm`` runs timm's ``layers/norm.py`` and the files it
imports, and nothing else. The classes are timm's, byte for byte.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest
from conftest import IN_CI


def timm_class(module: str, name: str):
    """timm's class ``name`` from ``timm/layers/<module>.py``; a skip where timm is not installed
    (a failure under CI=true)."""
    found = importlib.util.find_spec("timm") if "timm" not in sys.modules else sys.modules["timm"].__spec__
    if found is None or not found.submodule_search_locations:
        if IN_CI:
            pytest.fail("python module timm is not installed (required under CI=true)")
        pytest.skip("timm not installed")
    root = next(iter(found.submodule_search_locations))
    for pkg, path in (("timm", root), ("timm.layers", os.path.join(root, "layers"))):
        if pkg not in sys.modules:
            stub = types.ModuleType(pkg)
            stub.__path__ = [path]
            stub.__spec__ = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
            stub.__spec__.submodule_search_locations = [path]
            sys.modules[pkg] = stub
    return getattr(importlib.import_module(f"timm.layers.{module}"), name)
