"""The independent PyTorch references of the multi-tensor zoo layers: they live in
derivgen/tools/bench_multi_refs.py, shared with ``derivgen bench --zoo`` (a tool may not import
the tests); the tests import them under this name."""

from derivgen.tools.bench_multi_refs import *
from derivgen.tools.bench_multi_refs import _rstd_rms  # noqa: F401
