"""The C target: each mode's kernels planned per element type (sweeps, split-reduction
levels, layouts, windows, block passes, second order), computed once per layer."""

from derivgen.codegen.c.plan import ATYPES, CTYPES, c_load, c_store, plan_kernel

__all__ = ["ATYPES", "CTYPES", "c_load", "c_store", "plan_kernel"]
