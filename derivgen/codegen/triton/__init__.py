"""The Triton target: its printer and its kernels' plans (the same IR as the C, laid out
as tiles of a group)."""

from derivgen.codegen.triton.plan import plan_triton
from derivgen.codegen.triton.printer import triton_expr

__all__ = ["plan_triton", "triton_expr"]
