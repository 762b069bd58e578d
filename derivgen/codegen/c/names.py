"""The one naming table of the C kernels: what each symbol of a mode's expressions is called
in C, and where a value the element code reads is loaded from.

Element loads (:class:`Load`): x as ``Xv`` from ``x[Idx]``, ∂L/∂y as ``Dyv`` from
``dy[Idx]``, a tensor input or an output's cotangent a as ``a_V`` from ``a[Idx]`` (a
trailing layout's ``sample`` tensor, read at its own shape, from ``a[Tb + (Idx - Off)]``:
``Tb`` its sample's first value, ``Idx - Off`` the feature; a channel layout's from
``a[Tn + Ch]`` with the parameters; a channel layout's ``position`` tensor from ``a[Pi]``,
``Pi`` the element's sample and position; ``derivgen.runtime.abi.native``), a
per-channel parameter p as ``p_V`` from ``p[Ch]``, a position mask m as ``m_V`` computed
from its option and N at ``Ch``, and the second order's seeds (``Seed_x[Idx]``,
``<t>_Seed[Idx]``, ``<p>_Seed[Ch]``) under their own names. Group values
(:func:`group_names`): the group size ``N``, buffers and scalar parameters as ``b_G``.
The first-order planner (sweep.py), the second order (second.py) and the window functions
(windows.py) read names here; the templates read them from the plan (``GroupSelect.x``).
Every name is in derivgen's own namespace (an upper-case letter; see
:mod:`derivgen.symbolic.naming`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from derivgen.codegen.c.ctext import c_load, mask_load
from derivgen.symbolic.naming import derived

if TYPE_CHECKING:
    from derivgen.codegen.ir import SecondIR
    from derivgen.spec.model import Spec

X = "Xv"  # x at the element: the element code's, and the group selections' of the templates
# a tensor read at its own shape (derivgen.runtime.abi.native): a trailing layout's per-sample
# one at its sample's first value Tb (the sweeps define it per group, the trailing backward per
# unit of rows) plus the feature; a channel layout's per-(sample, channel) one at its sample's
# first value Tn (defined per sample) plus the channel, with the parameters
NATIVE_INDEX = "Tb + (Idx - Off)"
CHANNEL_INDEX = "Tn + Ch"
# a channel layout's per-position tensor, (N, 1, *spatial): at the element's sample n and
# position s, Pi = n * S + s, which the templates define at every element that reads one
# (from the block's Tp = n * S in the NCHW kernels, from the row in the channels-last ones)
POSITION_INDEX = "Pi"


def native_names(spec: Spec) -> list[str]:
    """The tensor inputs the kernels read at their own shape (the "sample" and "position"
    ones: ``derivgen.runtime.abi.native``), in spec order."""
    return [t.name for t in spec.tensors if t.shape in ("sample", "position")]


def summed_names(spec: Spec) -> list[str]:
    """The tensor inputs whose gradients the backward kernel sums itself, stored at their
    own shape (the "sample" ones: ``derivgen.runtime.abi.sums_own``), in spec order."""
    return [t.name for t in spec.tensors if t.shape == "sample"]


def position_names(spec: Spec) -> list[str]:
    """The tensor inputs read at ``Pi`` (a channel layout's "position" ones), in spec order."""
    return [t.name for t in spec.tensors if t.shape == "position"]


@dataclass(frozen=True)
class Load:
    """One value the element code reads, loaded as ``local``: from ``source[index]`` at the
    element (``index`` "Idx") or at its channel ("Ch"), or, for a mask (``index`` ""),
    computed from its option ``source`` and N."""

    local: str
    source: str
    index: str

    @property
    def at_element(self) -> bool:
        """Loaded at the element (x's index, or a native tensor's), not per channel or computed."""
        return "Idx" in self.index or self.index == POSITION_INDEX

    @property
    def reads(self) -> tuple[str, ...]:
        """The group values a mask reads (its option and N); none for an array's element."""
        return () if self.index else (self.source, "N")

    def value(self, T: str, to: str = "double") -> str:
        """C text of the value, of the stored type ``T``, as ``to``."""
        return c_load(f"{self.source}[{self.index}]", T, to) if self.index else mask_load(self.source, to)

    def line(self, T: str, to: str = "double") -> str:
        """Its declaration: ``const to local = value;``."""
        return f"const {to} {self.local} = {self.value(T, to)};"


def load_table(spec: Spec, arrays: Sequence[str], seeds: SecondIR | None = None) -> dict[str, Load]:
    """The element loads of a kernel by symbol name, in the order the kernels declare them
    (at the element: x, ∂L/∂y, x's seed, ``arrays``, the tensors' seeds; at the channel: the
    parameters, their seeds, the masks); ``arrays`` are those of x's shape besides x and ∂L/∂y
    (tensor inputs, outputs' cotangents), ``seeds`` a second-order kernel's IR."""
    chan = [p.name for p in spec.params if not p.scalar]
    table = {"x": Load(X, "x", "Idx"), "dy": Load("Dyv", "dy", "Idx")}
    if seeds is not None:
        table[seeds.seed_x] = Load(seeds.seed_x, "Seed_x", "Idx")
    own = dict.fromkeys(native_names(spec), NATIVE_INDEX if spec.layout == "trailing" else CHANNEL_INDEX)
    own.update(dict.fromkeys(position_names(spec), POSITION_INDEX))
    table.update({a: Load(derived(a, "V"), a, own.get(a, "Idx")) for a in arrays})
    if seeds is not None:
        table.update({sd: Load(sd, t + "_Seed", "Idx") for t, sd in seeds.seed_tensors.items()})
    table.update({p: Load(derived(p, "V"), p, "Ch") for p in chan})
    if seeds is not None:
        table.update({seeds.seed_params[p]: Load(seeds.seed_params[p], p + "_Seed", "Ch") for p in chan})
    table.update({m.name: Load(derived(m.name, "V"), m.option, "") for m in spec.masks})
    return table


def locals_of(table: dict[str, Load]) -> dict[str, str]:
    """Symbol name -> the C name it is loaded as."""
    return {n: ld.local for n, ld in table.items()}


def group_names(spec: Spec, buffers: bool = True) -> dict[str, str]:
    """The group values every sweep may read, symbol name -> C name: N, the buffers (with
    ``buffers``) and the scalar parameters (one value for the whole tensor)."""
    names = {"N": "N"}
    if buffers:
        names.update({b.name: derived(b.name, "G") for b in spec.buffers})
    names.update({p.name: derived(p.name, "G") for p in spec.params if p.scalar})
    return names
