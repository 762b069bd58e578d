"""A mode's C kernels planned for one element type: the forward and backward (the sweep
planner, :mod:`~derivgen.codegen.c.sweep`), the second order (:mod:`~derivgen.codegen.c.second`),
with the window functions and block arrays they share, as one
:class:`~derivgen.codegen.c.types.KernelPlan`."""

from __future__ import annotations

from derivgen.codegen.c.blocks import BlockSlots
from derivgen.codegen.c.ctext import CTYPES
from derivgen.codegen.c.second import second_plan
from derivgen.codegen.c.sweep import CPlanner
from derivgen.codegen.c.types import KernelPlan
from derivgen.codegen.c.windows import WindowFunctions
from derivgen.codegen.ir import ModeIR, SecondIR
from derivgen.codegen.printers import SpecPrinter


def plan_kernel(printer: SpecPrinter, ir: ModeIR, second: dict[str, SecondIR], ctype: str) -> KernelPlan:
    """Every C kernel of one mode (its first-order ``ir``, its ``second``-order IRs by kind)
    for the element type ``ctype``; bfloat16 has no second-order kernels."""
    sfx = {v: k for k, v in CTYPES.items()}[ctype]
    windows = WindowFunctions(printer, f"{printer.spec.name}_{ir.mode}_{sfx}", ctype)
    slots = BlockSlots()
    planner = CPlanner(printer, ir, ctype, windows, slots)
    forward, backward = planner.forward(), planner.backward()
    seconds = (
        None if ctype == "dg_bf16" else {k: second_plan(printer, s, ctype, windows, slots) for k, s in second.items()}
    )
    return KernelPlan(
        mode=ir.mode,
        ctype=ctype,
        forward=forward,
        backward=backward,
        second=seconds,
        windows=tuple(windows.texts),
    )
