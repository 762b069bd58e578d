"""C text of stored values: the element types, loads and stores with their conversions."""

from __future__ import annotations

from derivgen.symbolic.naming import derived

CTYPES = {"f32": "float", "f64": "double", "bf16": "dg_bf16"}
# the arithmetic type of each storage type: bfloat16 is read and written as bfloat16 and
# computed in float (as PyTorch's CPU kernels do), rounding to nearest even on store
ATYPES = {"float": "float", "double": "double", "dg_bf16": "float"}


def output_array(name: str) -> str:
    """The C array an output beside y is written to: ``h_Out`` for output h (the output's own
    name may be the value it returns, an element temporary of the same sweep)."""
    return derived(name, "Out")


def c_load(text: str, T: str, to: str = "double") -> str:
    """C text reading one stored element ``text`` of type T as ``to``."""
    if T == "dg_bf16":
        v = f"Dg_from_bf16({text})"
        return v if to == "float" else f"({to}){v}"
    return text if to == T else f"({to}){text}"


def mask_load(option: str, to: str = "double") -> str:
    """C text of ``leading(option)`` at feature ``Ch`` as ``to``: Ch < ⌊option·N⌋, written
    Ch + 1 <= option·N in double (no cast of a large product to an integer)."""
    return f"({to})((double)(Ch + 1) <= {option} * (double)N)"


def c_store(text: str, T: str) -> str:
    """C text converting the value ``text`` to the stored type T."""
    if T == "dg_bf16":
        return f"Dg_to_bf16((float)({text}))"
    return f"({T})({text})"
