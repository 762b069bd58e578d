"""The independent JAX references of the derivgen.jax tests: they live in
derivgen/tools/bench_jax_refs.py, shared with ``derivgen bench --zoo --jax`` (a tool may not import
the tests); the tests import them under this name."""

from derivgen.tools.bench_jax_refs import *
