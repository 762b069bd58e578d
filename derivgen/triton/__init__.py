"""derivgen layers as Triton kernels: the Triton target's run-time side (stage 7, beside
:mod:`derivgen.torch`, whose CUDA operators use it).

    import derivgen
    ln = derivgen.load("layernorm", backend="triton")   # generated/triton/layernorm.py
    y, cache = ln.forward(x, gamma, beta, eps=1e-5)      # torch tensors
    grads = ln.backward(dy, cache)                       # Grads(dx, dgamma, dbeta)

Each layer's kernels are generated from the same IR as the C kernels
(:mod:`derivgen.codegen.triton.plan`, ``templates/triton.py.j2``); :mod:`~derivgen.triton.launch`
launches them (the geometry of a group, tiles, programs), :mod:`~derivgen.triton.calls` calls
them with the NumPy and C modules' calling convention, :mod:`~derivgen.triton.ops`
is the CUDA implementation of the ``derivgen::`` operators, and :mod:`~derivgen.triton._target`
holds the functions the kernels call. Triton is an optional dependency
(``pip install triton``, or the extra of derivgen's source: ``pip install '/path/to/derivgen[triton]'``).

Where no CUDA device exists, importing this package sets ``TRITON_INTERPRET=1`` (unless the
variable is set already, or Triton was imported before), before Triton is imported:
Triton reads it when ``triton.jit`` decorates a function (its own reductions included),
and its interpreter then runs the kernels on CPU tensors with NumPy. That is how the tests run them; it is slow, and says nothing about
speed on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("triton") is None:  # pragma: no cover - exercised where Triton is missing
    raise ImportError(
        "derivgen.triton needs Triton, an optional dependency: pip install triton (or pip install '/path/to/derivgen[triton]')"
    )

if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
    import torch as _torch  # importing torch does not import triton

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton.language decorates its own functions

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # kernels run by Triton's interpreter
VERSION = triton.__version__

__all__ = ["INTERPRETED", "VERSION", "tl", "triton"]  # the generated modules import Triton from here
