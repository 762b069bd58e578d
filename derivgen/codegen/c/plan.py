"""Plans of the C kernels: a mode's IR as C statements, for one element type.

The kernel template (templates/kernel.c.j2) lays out the loops -- groups,
blocks, runs of contiguous values, DG_LANES lanes -- and this module fills
them: what each sweep over a group loads, computes, stores and sums, and the
per-group values between sweeps. :func:`plan_kernel` computes a mode's whole
plan for one element type once, before rendering, as plain data
(:class:`KernelPlan`); the templates only lay it out. Every line records the
names it reads (as the printer printed them), so which group values a sweep
needs is known from the plan, never read back from the C text. Every name it
makes is in derivgen's own namespace (an upper-case letter; see
:mod:`derivgen.symbolic.naming`): element loads
``Xv``, ``Dyv``, ``gamma_V``; group values of buffers and scalar parameters
``b_G``; float copies ``rstd_F``; hi/lo pairs ``H0_hi``; common
subexpressions ``Cse0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import sympy
from sympy import Add

from derivgen.codegen.ir import Assign, Loop, ModeIR, SecondIR, Select, needed_temps
from derivgen.codegen.printers import SpecPrinter
from derivgen.symbolic.block import BLOCK_AXES, BlockMean, outermost
from derivgen.symbolic.naming import derived
from derivgen.symbolic.window import Window

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


@dataclass(frozen=True)
class CDecl:
    """A per-group declaration before a sweep: ``const ctype name = expr;``."""

    ctype: str
    name: str
    expr: str
    reads: frozenset[str]  # the names the expression reads

    @property
    def line(self) -> str:
        """The declaration as one C statement."""
        return f"const {self.ctype} {self.name} = {self.expr};"


@dataclass(frozen=True)
class CLoop:
    """One sweep over the elements of a group, as data for the C template.

    The template emits it with DG_LANES independent double lanes for every sum (so
    the compiler vectorizes without reassociating: no -ffast-math, and the
    summation order is fixed), and loads each parameter once per channel in
    NCHW layouts.
    """

    uses_params: bool
    prelude: tuple[CDecl, ...]  # per-group declarations before the sweep (float copies, hi/lo)
    param_loads: tuple[str, ...]  # const double gamma_V = (double)gamma[Ch];
    elem_loads: tuple[str, ...]  # x, dy, then element temporaries, in order
    stores: tuple[tuple[str, str], ...]  # (output array, value): dx, (float)(...)
    group_sums: tuple[tuple[str, str], ...]  # (accumulator, expression) summed over the group
    param_sums: tuple[tuple[int, str], ...]  # (parameter slot, expression) summed per channel
    scalar_param_sums: tuple[tuple[int, str], ...]  # (slot, accumulator): scalar params
    param_pend: tuple[tuple[int, str], ...]  # param_sums in element arithmetic
    outputs: tuple[str, ...]  # full-size arrays written (y, dx)
    prefetch: tuple[str, ...]  # full-size arrays read ahead (first sweep only)
    reads: frozenset[str]  # the names the element code (all but param_pend) reads
    pend_reads: frozenset[str] = frozenset()  # the names param_pend reads
    other_reads: frozenset[str] = frozenset()  # the names the element code reads but for param_sums
    calls_windows: bool = False  # the element code calls a window function
    # full-size arrays the second sweep over a group reads ahead in the group after it, at the
    # positions it reads in this one (where a group is longer than the first sweep's read-ahead)
    ahead_next: tuple[str, ...] = ()
    # the per-channel parameter sums of a float or bfloat16 kernel's channel runs (NCHW and
    # channels-last) go into float lanes of DG_PEND lane blocks, in element arithmetic
    # (param_pend), then into double lanes; the position layout's kernels keep them in double
    float_lanes: bool = False
    # the block passes (block statistics: BlockPass) the element code reads, dependencies first,
    # and those of them no earlier sweep of the kernel computed for the group (``fresh``)
    blocks: tuple[BlockPass, ...] = ()
    fresh: tuple[BlockPass, ...] = ()

    # Runs whose iterations carry no lane sums may start their lane blocks anywhere, so a
    # long streaming run peels a scalar head up to a 64-byte boundary of its single output
    # and streams whole blocks straight from registers ("direct"; short ones are written
    # in place); runs with lane sums compute into a cache-resident tile that is streamed
    # out afterwards, keeping the lane of every element.
    def _direct(self, channel_lanes: bool) -> bool:
        return len(self.outputs) == 1 and not self.group_sums and not (channel_lanes and self.param_sums)

    @property
    def direct_run(self) -> bool:
        """Written in place along the channel axis (S == 1), or with no parameters."""
        return self._direct(False)

    @property
    def direct_nchw(self) -> bool:
        """Written in place in runs of S values of one channel (NCHW)."""
        return self._direct(True)

    @property
    def needs_tile(self) -> bool:
        """Some run of this sweep computes into a tile that is streamed out afterwards."""
        if not self.outputs:
            return False
        return not (self.direct_run and self.direct_nchw) if self.uses_params else not self.direct_run


def _live(prelude: list[CDecl], reads: frozenset[str]) -> tuple[CDecl, ...]:
    """The prelude declarations that code reading ``reads`` uses, directly or through
    another kept declaration (H0 through H0_hi); the rest would be unused variables."""
    keep: list[CDecl] = []
    used = set(reads)
    for decl in reversed(prelude):
        if decl.name in used:
            keep.insert(0, decl)
            used |= decl.reads
    return tuple(keep)


# ---- block statistics (derivgen.symbolic.block) ------------------------------
#
# A block mean mean(u, kind) is one value per block of its kind inside the group (an
# instance: a (sample, channel)'s positions; a sample; a channel over the samples). Before
# a sweep reads one, a block pass walks the group once and leaves the block's mean of u in
# an array of the thread's scratch, ``Bm<k>_A``, one double per block of the group; the
# sweep's element code reads it at its block, ``Bm<k>``, as it reads a per-channel
# parameter (a block spans the positions, so its value is one per (block index, channel)).
# A block mean inside u is a pass of its own, run first. The passes sum u in double, in
# DG_LANES lanes per run of S positions, runs added in order: the sums do not depend on the
# thread count.


@dataclass(frozen=True)
class BlockPass:
    """One block mean as a pass over the group, for the C template (kernel.c.j2, block_pass)."""

    slot: int  # its array: Bm<slot>_A
    comment: str
    count: str  # C: the blocks one group holds
    size: str  # C: the elements one block holds (a double)
    index: str  # C: the block of the element (Blk, Ch)
    chan_loads: tuple[str, ...]  # per channel: parameters, masks, the block values u reads
    elem_loads: tuple[str, ...]  # per element: x, dy, seeds, temporaries
    body: str  # u, in double
    deps: tuple[int, ...]  # the slots u reads, directly or through another pass


def block_index(axes: tuple[int, ...]) -> tuple[str, str, str]:
    """C text of a block kind's (index of the element's block, blocks per group, elements per
    block) in a channel kernel's loops: sample blocks ``Blk`` (O, when the group spans the
    samples), channel ``Ch - Gi * Cg`` of the group; ``axes`` those of the (O, G, Cg, S) view
    one block spans (every kind spans the positions S)."""
    per_o, per_c = 0 not in axes, 2 not in axes
    chan = "(Ch - Gi * Cg)"
    index = {(True, True): f"Blk * Cg + {chan}", (True, False): "Blk", (False, True): chan, (False, False): "0"}
    count = {(True, True): "Blocks * Cg", (True, False): "Blocks", (False, True): "Cg", (False, False): "1"}
    size = "*".join(f for f, on in (("Blocks", not per_o), ("Cg", not per_c), ("S", True)) if on)
    return index[(per_o, per_c)], count[(per_o, per_c)], f"(double)({size})"


class BlockSlots:
    """The block arrays of one mode's kernels for one element type: one slot per distinct
    block mean (its body, with the block means inside it hidden, and its kind)."""

    def __init__(self) -> None:
        self.keys: dict[tuple, int] = {}

    def slot(self, body: sympy.Expr, kind: str) -> int:
        """The slot of mean(body, kind), made on first use."""
        return self.keys.setdefault((body, kind), len(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


def hide_block_means(e: sympy.Expr, make) -> sympy.Expr:
    """``e`` with each outermost block mean replaced by ``make(body, kind)`` (a symbol), its
    body's block means replaced first."""
    if not e.has(BlockMean):
        return e
    return e.xreplace({b: make(hide_block_means(b.body, make), b.kind) for b in outermost(e)})


def block_slots_read(names: Iterable[str]) -> list[int]:
    """The block slots among the symbol names ``names`` (Bm<k>)."""
    return sorted(int(n[2:]) for n in names if n.startswith("Bm") and n[2:].isdigit())


def block_load(slot: int, kind_axes: tuple[int, ...]) -> str:
    """The declaration of block value ``Bm<slot>`` (double) at the element's block."""
    index, _, _ = block_index(kind_axes)
    return f"const double Bm{slot} = Bm{slot}_A[{index}];"


class BlockPasses:
    """One planner's block passes: the block means of its expressions hidden as ``Bm<k>``
    symbols (slots shared by the mode's kernels), each pass planned once by ``plan(slot,
    body, kind, temps)`` (a BlockPass)."""

    def __init__(self, slots: BlockSlots, plan) -> None:
        self.slots, self.plan = slots, plan
        self.passes: dict[int, BlockPass] = {}
        self.axes: dict[int, tuple[int, ...]] = {}

    def hide(self, e: sympy.Expr, temps: list[tuple[str, sympy.Expr]]) -> sympy.Expr:
        """``e`` with its block means as Bm symbols, their passes planned with ``temps``."""

        def make(body: sympy.Expr, kind: str) -> sympy.Symbol:
            slot = self.slots.slot(body, kind)
            if slot not in self.passes:
                self.axes[slot] = BLOCK_AXES[kind]
                self.passes[slot] = self.plan(slot, body, kind, temps)
            return sympy.Symbol(f"Bm{slot}")

        return hide_block_means(e, make)

    def hide_temps(self, temps: Sequence[tuple[str, sympy.Expr]]) -> list[tuple[str, sympy.Expr]]:
        """Element temporaries with their block means hidden, each with the temporaries before it."""
        out: list[tuple[str, sympy.Expr]] = []
        for nm, te in temps:
            out.append((nm, self.hide(te, list(out))))
        return out

    def needed(self, names: Iterable[str]) -> tuple[BlockPass, ...]:
        """The passes that code reading ``names`` needs, dependencies first."""
        want: set[int] = set()
        todo = block_slots_read(names)
        while todo:
            k = todo.pop()
            if k not in want:
                want.add(k)
                todo.extend(self.passes[k].deps)
        return tuple(self.passes[k] for k in sorted(want))

    def loads(self, names: Iterable[str], by_channel: bool | None = None) -> list[str]:
        """The declarations of the block values among ``names``: all, or (``by_channel``)
        those whose block index reads the channel ``Ch`` (True) or not (False)."""
        return [
            block_load(k, self.axes[k])
            for k in block_slots_read(names)
            if by_channel is None or (2 not in self.axes[k]) == by_channel
        ]


def block_pass(
    slot: int, kind: str, comment: str, chan_loads, elem_loads, body: str, names: Iterable[str], passes: BlockPasses
) -> BlockPass:
    """A BlockPass of a body planned as ``chan_loads``, ``elem_loads`` and ``body`` reading ``names``."""
    index, count, size = block_index(BLOCK_AXES[kind])
    deps = tuple(p.slot for p in passes.needed(names) if p.slot != slot)
    return BlockPass(
        slot=slot,
        comment=comment,
        count=count,
        size=size,
        index=index,
        chan_loads=tuple(chan_loads),
        elem_loads=tuple(elem_loads),
        body=body,
        deps=deps,
    )


# ---- channels last (NHWC) -------------------------------------------------
#
# The NHWC kernels run the same sweeps over a block of groups in lockstep: for every
# position s of a run (and every channel of a group), the innermost loop walks the
# block's groups, which are adjacent in memory. Each group keeps its own DG_LANES
# lanes, filled in the same order as the NCHW kernels fill them (lane J gets the
# run's positions J, J + DG_LANES, ..., the remainder lane 0), so sums, statistics
# and outputs are the NCHW kernels' bits. Group-level values live in arrays
# ``Gv_<name>[Gi]``; the innermost loop declares the ones its code uses.


@dataclass(frozen=True)
class NhwcSweep:
    """A sweep's group-level needs in the NHWC kernels."""

    prelude_inputs: tuple[str, ...]  # group values the prelude reads
    inner_group: tuple[str, ...]  # group values the element code reads
    inner_prelude: tuple[tuple[str, str], ...]  # (type, name) of prelude values the element code reads


def _read_values(lp: CLoop, group_names: list[str], reads: frozenset[str]) -> tuple[tuple, tuple]:
    """The prelude declarations, as (C type, name), and the other group values of
    ``group_names`` that code reading ``reads`` uses."""
    pnames = {d.name for d in lp.prelude}
    prelude = tuple((d.ctype, d.name) for d in lp.prelude if d.name in reads)
    return prelude, tuple(n for n in group_names if n not in pnames and n in reads)


def nhwc_sweep(lp: CLoop, group_names: list[str]) -> NhwcSweep:
    """What a sweep reads of the group values ``group_names`` defined before it (with float
    lanes, what its parameter terms read in element arithmetic instead of the double sums)."""
    pnames = {d.name for d in lp.prelude}
    prelude_reads = frozenset().union(*(d.reads for d in lp.prelude))
    inner_prelude, inner_group = _read_values(
        lp, group_names, lp.other_reads | lp.pend_reads if lp.float_lanes else lp.reads
    )
    return NhwcSweep(
        prelude_inputs=tuple(n for n in group_names if n not in pnames and n in prelude_reads),
        inner_group=inner_group,
        inner_prelude=inner_prelude,
    )


# ---- rows in lockstep (trailing layouts) -----------------------------------
#
# A trailing layout's backward adds every element's parameter-gradient terms into per-feature
# partial sums: done row by row, each element costs a load and a store of each partial
# (float pend, flushed to double every DG_PEND rows). Its final sweep therefore runs over
# DG_ROWS rows in lockstep instead: each row's reduction sweep and group values come first,
# one row after another as before (the same bits for dx), the group values the final sweep
# reads are kept in arrays ``Rv_<name>[Rr]``, and then, block of DG_LANES features by
# block, the final sweep computes each row's dx and adds its terms into registers, which
# go into the thread's double partials once per block of rows.


@dataclass(frozen=True)
class RowSweep:
    """What a trailing layout's final backward sweep needs to run over rows in lockstep: the
    group values and prelude declarations its element code reads, as (C type, name)."""

    values: tuple[tuple[str, str], ...]


def row_sweep(lp: CLoop, group_names: list[str]) -> RowSweep | None:
    """The lockstep plan of a trailing layout's final backward sweep, or None where the
    per-row sweep stays: no per-feature parameter terms, several outputs or group sums in
    the sweep (no straight streaming), scalar parameter sums, or window calls (they read a
    row's neighbours through its offset)."""
    if not lp.param_pend or not lp.direct_run or lp.scalar_param_sums or lp.calls_windows:
        return None
    prelude, group = _read_values(lp, group_names, lp.reads | lp.pend_reads)
    return RowSweep(values=prelude + tuple(("double", n) for n in group))


# ---- a kernel's plan -------------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    """A sweep of a kernel: its loop, the accumulators it leaves, and its NHWC needs."""

    kind: ClassVar[str] = "sweep"
    loop: CLoop
    accs: tuple[str, ...]
    nhwc: NhwcSweep
    rows: RowSweep | None = None  # a trailing layout's final backward sweep over rows in lockstep


@dataclass(frozen=True)
class GroupValue:
    """A per-group value between sweeps: ``const double name = expr;``."""

    kind: ClassVar[str] = "assign"
    name: str
    expr: str
    comment: str
    reads: tuple[str, ...]  # the group values defined before it that it reads, in order


@dataclass(frozen=True)
class GroupSelect:
    """A group maximum or minimum of the forward: ``name = op`` over the elements of the
    group's run (trailing layouts: one contiguous row), ``expr`` the element value (double)."""

    kind: ClassVar[str] = "select"
    name: str
    op: str  # "max" or "min"
    expr: str
    comment: str
    reads: tuple[str, ...]


@dataclass(frozen=True)
class SplitLevel:
    """A level of the split reduction: its sweep (None: no sums), the statistics it
    assigns, and the statistics of the earlier levels."""

    sweep: Sweep | None
    assigns: tuple[GroupValue, ...]
    known: tuple[str, ...]


@dataclass(frozen=True)
class ForwardPlan:
    """The forward kernel: sweeps and statistics in order, the buffer updates, the output sweep."""

    steps: tuple[Sweep | GroupValue | GroupSelect, ...]
    final: Sweep
    updates: tuple[tuple[str, str], ...]  # (buffer, C expression)
    update_reads: tuple[str, ...]  # the group values the updates read
    levels: tuple[SplitLevel, ...]

    @property
    def block_slots(self) -> tuple[int, ...]:
        """The block arrays (Bm<k>_A) the forward's sweeps read."""
        sweeps = [st.loop for st in self.steps if isinstance(st, Sweep)] + [self.final.loop]
        return tuple(sorted({p.slot for lp in sweeps for p in lp.blocks}))


@dataclass(frozen=True)
class BackwardPlan:
    """The backward kernel: the reduction sweep (None: no reductions), the group values, the output sweep."""

    reduction: Sweep | None
    group: tuple[GroupValue, ...]
    final: Sweep

    @property
    def block_slots(self) -> tuple[int, ...]:
        """The block arrays (Bm<k>_A) the backward's sweeps read."""
        sweeps = ([self.reduction.loop] if self.reduction else []) + [self.final.loop]
        return tuple(sorted({p.slot for lp in sweeps for p in lp.blocks}))


@dataclass(frozen=True)
class SecondPlan:
    """A second-order kernel (derivgen.derive.second): one reduction sweep, one output sweep per
    group, all arithmetic in double (float and bfloat16 values are widened on load), sums
    in DG_LANES lanes; the template (kernel.c.j2, second_kernel) lays out the loops."""

    elem1: tuple[str, ...]  # sweep 1: element loads and temporaries
    chan1: tuple[str, ...]  # sweep 1: per-channel loads
    sums: tuple[tuple[str, str], ...]  # (accumulator, C expression)
    group: tuple[tuple[str, str, str], ...]  # (name, C expression, comment) per group between the sweeps
    elem2: tuple[str, ...]
    chan2: tuple[str, ...]
    stores: tuple[tuple[str, str], ...]  # (output array, C expression in double)
    param_sums: tuple[tuple[int, str], ...]  # (parameter slot, C expression)
    inputs: tuple[tuple[str, str], ...]  # (input, group variable)
    param_groups: tuple[tuple[int, str], ...]  # (parameter slot, group variable)
    seed_group: tuple[tuple[str, str], ...]  # (name, declaration): per-group loads of input seeds, scalar seeds
    blocks1: tuple[BlockPass, ...] = ()  # the block passes before the reduction sweep
    blocks2: tuple[BlockPass, ...] = ()  # and those before the output sweep (the others' arrays kept)

    @property
    def block_slots(self) -> tuple[int, ...]:
        """The block arrays (Bm<k>_A) the kernel's passes fill."""
        return tuple(sorted({p.slot for p in (*self.blocks1, *self.blocks2)}))


@dataclass(frozen=True)
class KernelPlan:
    """Every C kernel of one mode for one element type, planned once before rendering."""

    mode: str
    ctype: str
    forward: ForwardPlan
    backward: BackwardPlan
    second: dict[str, SecondPlan] | None  # "bb", "jvp"; None for bfloat16 (no second-order kernels)
    windows: tuple[str, ...] = ()  # the static functions the kernels call for window(e, k), in order


def hide_windows(e: sympy.Expr) -> sympy.Expr:
    """``e`` with each window replaced by a symbol of no name a temporary has: what a sweep
    itself reads (a window's body is read by its function, at the neighbours)."""
    if not e.has(Window):
        return e
    found = sorted(e.atoms(Window), key=sympy.default_sort_key)  # each its own symbol: none cancel
    return e.xreplace({w: sympy.Symbol(f"Window_call{k}") for k, w in enumerate(found)})


@dataclass(frozen=True)
class _WindowFunction:
    name: str
    arrays: tuple[str, ...]  # the arrays it reads, as the kernel names them
    groups: tuple[str, ...]  # the group values it reads, by their symbol names
    text: str

    def call(self, names: dict[str, str]) -> str:
        """Its call at element (Idx, Ch), the group values by the caller's ``names``."""
        args = [*self.arrays, *(names.get(g, g) for g in self.groups), "Idx - Ch * S", "S", "Cg", "Ch"]
        return f"{self.name}({', '.join(args)})"


class WindowFunctions:
    """The C functions of one mode's kernels for one element type that evaluate windows.

    A window at element ``Ch`` of its group (the channel index: a trailing layout's feature,
    or the channel at a position; element ``Idx = Base + Ch*S``) sums its body over the
    neighbours inside the group, in double, in offset order: the function reads x, ∂L/∂y,
    the parameters and the second order's seeds at each neighbour, recomputes the element
    temporaries the body needs there (a window inside it is a call of another function), and
    takes the group values as arguments. Recomputing costs k evaluations of the body per
    element (k² for a window inside a window) and keeps every kernel one pass per sweep."""

    def __init__(self, printer: SpecPrinter, prefix: str, ctype: str):
        self.printer, self.prefix, self.ctype = printer, prefix, ctype
        self.done: dict[tuple, _WindowFunction] = {}
        self.texts: list[str] = []

    def function(self, w: Window, temps: list[tuple[str, sympy.Expr]], loads: dict[str, tuple]) -> _WindowFunction:
        """The function of ``w`` in a kernel whose element temporaries are ``temps`` and whose
        element ``loads`` are ``loads`` (symbol name -> (local name, array, index: "Idx" or
        "Ch"), or for a mask (local name, C expression, "", the group values it reads)),
        defined on first use."""
        # one function per window and what it reads (its temporaries, nested windows' too, and
        # the loads): the kernels that need the same one share it
        deps, names = needed_temps([w.body], temps)
        key = (w, tuple(deps), tuple(sorted((n, loads[n]) for n in names if n in loads)))
        if key in self.done:
            return self.done[key]
        needed, _ = needed_temps([hide_windows(w.body)], temps)  # what this body itself reads
        temp_names = {nm for nm, _ in needed}
        inner: list[_WindowFunction] = []

        def nested(v: Window) -> str:
            fn = self.function(v, temps, loads)
            inner.append(fn)
            return fn.call({})

        rename = {n: loads[n][0] for n in loads}
        rename.update({nm: nm for nm in temp_names})
        lines, reads = [], set()
        for nm, te in needed:
            text, r = self.printer.c_reads(te, "double", rename, nested)
            lines.append(f"const double {nm} = {text};")
            reads |= r
        body, r = self.printer.c_reads(w.body, "double", rename, nested)
        reads |= r
        used = {n for n in loads if loads[n][0] in reads}
        # a load's array (or a mask's option and N), and every other name read: a group value
        arrays = sorted({loads[n][1] for n in used if loads[n][2]})
        groups = {str(v) for e in [w.body, *(te for _, te in needed)] for v in hide_windows(e).free_symbols}
        groups = {g for g in groups - set(loads) - temp_names if not g.startswith("Window_call")}
        for n in used:
            if not loads[n][2]:  # a mask: computed from its option and N
                groups |= set(loads[n][3])
        size = w.size
        if size.is_Symbol:
            groups.add(str(size))
        for fn in inner:
            arrays = sorted(set(arrays) | set(fn.arrays))
            groups |= set(fn.groups)
        groups_t = tuple(sorted(groups))
        name = f"{self.prefix}_window{len(self.texts) + 1}"
        T = self.ctype
        params = [f"const {T} *restrict {a}" for a in arrays] + [f"double {g}" for g in groups_t]
        params += ["int64_t Base", "int64_t S", "int64_t Cg", "int64_t Ch0"]
        k = f"(int64_t){size}" if size.is_Symbol else str(int(size))
        before, after = ("(K - 1) / 2", "K / 2") if w.transposed else ("K / 2", "(K - 1) / 2")
        load_lines = []
        for n in sorted(used):
            local, src, index = loads[n][:3]
            load_lines.append(f"const double {local} = {c_load(f'{src}[{index}]', T) if index else src};")
        text = "\n".join(
            [
                (
                    f"/* {'the transposed window' if w.transposed else 'window'} of {self.printer.code(w.body)} over "
                    f"{size} neighbours, at element Ch0 of its group */"
                ),
                f"static double {name}({', '.join(params)})",
                "{",
                *(f"    (void){a};" for a in [*arrays, *groups_t, "Base", "S", "Cg", "Ch0"]),
                f"    const int64_t K = {k};",
                f"    const int64_t Lo = Ch0 - {before} < 0 ? 0 : Ch0 - {before};",
                f"    const int64_t Hi = Ch0 + {after} > Cg - 1 ? Cg - 1 : Ch0 + {after};",
                "    double Acc = 0.0;",
                "    for (int64_t Ch = Lo; Ch <= Hi; ++Ch) {",
                "        const int64_t Idx = Base + Ch * S;",
                "        (void)Idx;",
                *(f"        {line}" for line in load_lines + lines),
                f"        Acc += {body};",
                "    }",
                "    return Acc;",
                "}",
            ]
        )
        fn = _WindowFunction(name, tuple(arrays), groups_t, text)
        self.done[key] = fn
        self.texts.append(text)
        return fn


class CPlanner:
    """Turns a ModeIR into C statement strings for one element type."""

    def __init__(
        self,
        printer: SpecPrinter,
        ir: ModeIR,
        ctype: str,
        windows: WindowFunctions | None = None,
        slots: BlockSlots | None = None,
    ):
        spec = printer.spec
        self.blocks = BlockPasses(slots if slots is not None else BlockSlots(), self._block_pass)
        self.printer, self.spec, self.ir, self.ctype = printer, spec, ir, ctype
        self.windows = windows or WindowFunctions(printer, f"{spec.name}_{ir.mode}", ctype)
        self.atype = ATYPES[ctype]
        self.params = [p.name for p in spec.params]
        self.scalar = {p.name for p in spec.params if p.scalar}
        self.group_names: dict[str, str] = {"N": "N"}
        for b in spec.buffers:
            self.group_names[b.name] = derived(b.name, "G")
        for p in self.scalar:  # one value for the whole tensor: a group value
            self.group_names[p] = derived(p, "G")
        self.masks = {m.name: m.option for m in spec.masks}
        # arrays of x's shape read at the element beside x and dy: the tensor inputs, and the
        # cotangents of the outputs beside y
        self.arrays = [t.name for t in spec.tensors] + [o.cotangent.name for o in spec.outputs]
        self.elem_names: dict[str, str] = {
            "x": "Xv",
            "dy": "Dyv",
            **{p: derived(p, "V") for p in self.params if p not in self.scalar},
            **{m: derived(m, "V") for m in self.masks},
            **{a: derived(a, "V") for a in self.arrays},
        }

    def _block_pass(self, slot: int, body: sympy.Expr, kind: str, temps: list) -> BlockPass:
        """The pass leaving mean(body, kind) per block in Bm<slot>_A (body summed in double)."""
        lp = self.loop([body], temps, group_sums=[("Acc", body)], arith="double")
        names = {f"Bm{p.slot}" for p in lp.blocks}
        comment = f'Bm{slot} = mean({self.printer.code(body)}, "{kind}")'
        return block_pass(slot, kind, comment, lp.param_loads, lp.elem_loads, lp.group_sums[0][1], names, self.blocks)

    def g(self, e: sympy.Expr) -> tuple[str, frozenset[str]]:
        """A group-level expression (double), and the names it reads."""
        return self.printer.c_reads(e, "double", self.group_names)

    # ---- one sweep -----------------------------------------------------
    def _float_prelude(self, every, elem: set[str], enames: dict[str, str]) -> tuple[list[CDecl], dict]:
        """Float element arithmetic: group-level addends of mixed sums become hi/lo pairs
        (H0_hi + H0_lo), other group values float copies (rstd_F). Returns the prelude
        and the hoisted Add nodes; updates ``enames``."""
        prelude: list[CDecl] = []
        hoisted: dict = {}
        for e in every:
            for node in sympy.preorder_traversal(e):
                if node.is_Add and node not in hoisted:
                    ee = [t for t in node.args if {str(v) for v in t.free_symbols} & elem or t.has(Window)]
                    ge = [t for t in node.args if t not in ee]
                    if ge and ee:
                        h = f"H{len(hoisted)}"
                        hoisted[node] = (Add(*ee), h)
                        prelude.append(CDecl("double", h, *self.g(Add(*ge))))
                        prelude.append(CDecl("float", f"{h}_hi", f"(float){h}", frozenset({h})))
                        prelude.append(
                            CDecl("float", f"{h}_lo", f"(float)({h} - (double){h}_hi)", frozenset({h, f"{h}_hi"}))
                        )
        used: set[str] = set()

        def collect(node):
            if node in hoisted:  # only its element part is printed in float
                collect(hoisted[node][0])
            elif node.is_Symbol:
                if str(node) not in elem:
                    used.add(str(node))
            else:
                for a in node.args:
                    collect(a)

        for e in every:
            collect(e)
        for gname in sorted(used):
            src = self.group_names.get(gname, gname)
            f = src + "_F"  # rstd_F, Mean_g_F: an upper-case tag, derivgen's namespace
            prelude.append(CDecl("float", f, f"(float){src}", frozenset({src})))
            enames[gname] = f
        return prelude, hoisted

    def loop(
        self,
        exprs: list[sympy.Expr],
        temps: list[tuple[str, sympy.Expr]],
        *,
        stores: Iterable[tuple[str, sympy.Expr]] = (),
        group_sums: Iterable[tuple[str, sympy.Expr]] = (),
        param_sums: Sequence[tuple[int, sympy.Expr]] = (),
        arith: str = "double",
        outputs: Iterable[str] = (),
        first: bool = False,
        second: bool = False,
    ) -> CLoop:
        """Element sweep computing ``exprs``; ``temps`` are element temporaries available;
        ``stores`` are (output array, element expression) pairs.

        ``outputs`` are the full-size arrays the sweep writes (straight, streamed
        from registers, or through a cache-resident tile streamed out after each
        run: see the template); the ``first`` sweep of a function prefetches the
        arrays it reads, and the ``second`` reads them ahead in the next group.

        Loads and stores use the array type. Sums are always double. With
        ``arith="double"`` all arithmetic is double, so a float32 kernel centres
        and squares without rounding the statistics to float (mean offset 1e4)
        or overflowing (|x| ~ 1e30). ``arith="float"`` (output sweeps of float
        kernels) computes in float, adding group-level terms as hi + lo pairs.
        """
        ctype = self.ctype
        # block means are read as values one per block, left by their passes (BlockPass)
        temps = self.blocks.hide_temps(temps)
        exprs = [self.blocks.hide(e, temps) for e in exprs]
        stores = [(o, self.blocks.hide(e, temps)) for o, e in stores]
        group_sums = [(a, self.blocks.hide(e, temps)) for a, e in group_sums]
        param_sums = [(k, self.blocks.hide(e, temps)) for k, e in param_sums]
        needed, names = needed_temps([hide_windows(e) for e in exprs], temps)
        block_reads = [f"Bm{k}" for k in block_slots_read(names)]
        if block_reads:  # block values are double: the element code reading them is too
            arith = "double"
        chan = [p for p in self.params if p not in self.scalar]
        loads = {"x": ("Xv", "x", "Idx"), "dy": ("Dyv", "dy", "Idx")}
        loads.update({p: (derived(p, "V"), p, "Ch") for p in chan})
        loads.update({m: (derived(m, "V"), mask_load(o), "", (o, "N")) for m, o in self.masks.items()})

        called: list[Window] = []  # a sweep that calls a window function needs the channel index Ch
        window_reads: set[str] = set()  # and the group values the calls pass

        def windows(w: Window) -> str:
            called.append(w)
            fn = self.windows.function(w, list(temps), loads)
            window_reads.update(self.group_names.get(g, g) for g in fn.groups)
            return fn.call(self.group_names)

        elem = {"x", "dy", *chan, *self.masks, *block_reads, *self.arrays} | {nm for nm, _ in needed}
        enames = dict(self.group_names)
        enames.update(self.elem_names)
        enames.update({b: b for b in block_reads})
        prelude, hoisted = ([], {})
        if arith == "float":
            prelude, hoisted = self._float_prelude([te for _, te in needed] + list(exprs), elem, enames)
        body_reads: set[str] = set()
        pend_reads: set[str] = set()
        # masks compare in double: group values as computed, element values widened
        mask_names = {**self.group_names, **{k: f"((double){v})" for k, v in self.elem_names.items()}}
        mask_names.update({nm: f"((double){nm})" for nm, _ in needed})

        def element(e: sympy.Expr, into: set[str]) -> str:
            """Element arithmetic (temporaries, stored outputs) in the sweep's type."""
            if arith == "float":
                text, reads = self.printer.c_float_reads(e, enames, hoisted, mask_names, windows)
            else:
                text, reads = self.printer.c_reads(e, "double", enames, windows)
            into |= reads
            return text

        elem_loads = []
        if "x" in names:
            elem_loads.append(f"const {arith} Xv = {c_load('x[Idx]', ctype, arith)};")
        if "dy" in names:
            elem_loads.append(f"const {arith} Dyv = {c_load('dy[Idx]', ctype, arith)};")
        for a in self.arrays:
            if a in names:
                elem_loads.append(f"const {arith} {derived(a, 'V')} = {c_load(a + '[Idx]', ctype, arith)};")
        # a block value one per sample (index Blk) is read with the element; one per (sample,
        # channel) or per channel with the parameters, where the sweep knows the channel Ch
        elem_loads += self.blocks.loads(names, by_channel=False)
        for nm, te in needed:
            elem_loads.append(f"const {arith} {nm} = {element(te, body_reads)};")
            enames[nm] = nm
        # summands are double: float element values are widened before any arithmetic, so the
        # temporaries (x-hat, g) are the same values in every sweep and products do not overflow
        dnames = dict(self.group_names)
        dnames.update(self.elem_names)
        dnames.update({nm: nm for nm, _ in needed})
        dnames.update({b: b for b in block_reads})
        if arith != "double":
            dnames.update({k: f"((double){v})" for k, v in dnames.items() if k in elem})

        def summand(e: sympy.Expr, into: set[str] = body_reads) -> str:
            text, reads = self.printer.c_reads(e, "double", dnames, windows)
            into.update(reads)
            return text

        param_loads = [
            f"const {arith} {derived(p, 'V')} = {c_load(p + '[Ch]', ctype, arith)};" for p in chan if p in names
        ] + [f"const {arith} {derived(m, 'V')} = {mask_load(o, arith)};" for m, o in self.masks.items() if m in names]
        param_loads += self.blocks.loads(names, by_channel=True)
        chan_sums = [(k, e) for k, e in param_sums if self.params[k] not in self.scalar]
        scal_sums = [(k, e) for k, e in param_sums if self.params[k] in self.scalar]
        all_sums = list(group_sums) + [(f"Psum_{k}", e) for k, e in scal_sums]
        stored = tuple((o, c_store(element(e, body_reads), ctype)) for o, e in stores)
        sums = tuple((a, summand(e)) for a, e in all_sums)
        psum_reads: set[str] = set()
        chan_summands = tuple((k, summand(e, psum_reads)) for k, e in chan_sums)
        pend = tuple((k, element(e, pend_reads)) for k, e in chan_sums)
        body_reads |= window_reads
        other_reads = frozenset(body_reads)  # what the element code reads besides the parameter sums
        body_reads |= psum_reads
        passes = self.blocks.needed(names)
        return CLoop(
            uses_params=bool(param_loads) or bool(chan_sums) or bool(called),
            prelude=_live(prelude, frozenset(body_reads | pend_reads)),
            param_loads=tuple(param_loads),
            elem_loads=tuple(elem_loads),
            stores=stored,
            group_sums=sums,
            param_sums=chan_summands,
            scalar_param_sums=tuple((k, f"Psum_{k}") for k, _ in scal_sums),
            param_pend=pend,
            outputs=tuple(outputs),
            prefetch=tuple(a for a in ("x", "dy", *self.arrays) if a in names) if first else (),
            ahead_next=tuple(a for a in ("x", "dy", *self.arrays) if a in names) if second else (),
            reads=frozenset(body_reads),
            pend_reads=frozenset(pend_reads),
            other_reads=other_reads,
            calls_windows=bool(called),
            float_lanes=arith == "float" and bool(chan_sums) and self.spec.reduce != "position",
            blocks=passes,
            fresh=passes,
        )

    def _sweep(self, lp: CLoop, accs, names: list[str]) -> Sweep:
        """A sweep with its accumulators, given the group values defined before it."""
        return Sweep(loop=lp, accs=tuple(accs), nhwc=nhwc_sweep(lp, names))

    def _group_value(self, name: str, e: sympy.Expr, comment: str, names: list[str]) -> GroupValue:
        """``name = e`` per group, given the group values defined before it."""
        text, reads = self.g(e)
        return GroupValue(name=name, expr=text, comment=comment, reads=tuple(n for n in names if n in reads))

    # ---- the two kernels ------------------------------------------------
    def forward(self) -> ForwardPlan:
        """The forward kernel's plan."""
        spec = self.spec
        names = [i.name for i in spec.inputs] + [derived(b.name, "G") for b in spec.buffers]
        steps: list[Sweep | GroupValue] = []
        values = list(self.ir.values)  # the core value h = f(x, t), an element temporary of every sweep
        for st in self.ir.forward:
            if isinstance(st, Loop):
                done = sum(isinstance(s, Sweep) for s in steps)
                lp = self.loop([e for _, e in st.accs], values, group_sums=st.accs, first=done == 0, second=done == 1)
                steps.append(self._sweep(lp, [a for a, _ in st.accs], names))
                names += [a for a, _ in st.accs]
            elif isinstance(st, Select):
                enames = {**self.group_names, **self.elem_names}
                text, reads = self.printer.c_reads(st.expr, "double", enames)
                steps.append(GroupSelect(st.name, st.op, text, st.comment, tuple(n for n in names if n in reads)))
                names.append(st.name)
            else:
                steps.append(self._group_value(st.name, st.expr, st.comment, names))
                names.append(st.name)
        _, out_expr = self.ir.fwd_elem[-1]
        temps = values + list(self.ir.fwd_elem[:-1])
        done = sum(isinstance(s, Sweep) for s in steps)
        extra = [(output_array(o), e) for o, e in self.ir.out_elem]  # the outputs beside y
        final = self.loop(
            [out_expr, *(e for _, e in extra)],
            temps,
            stores=[("y", out_expr), *extra],
            arith=self.atype,
            outputs=["y", *(o for o, _ in extra)],
            first=done == 0,
            second=done == 1,
        )
        updates = [(b, *self.g(e)) for b, e in self.ir.buffer_updates]
        update_reads = frozenset().union(*(r for _, _, r in updates))
        return ForwardPlan(
            steps=tuple(steps),
            final=self._sweep(final, (), names),
            updates=tuple((b, text) for b, text, _ in updates),
            update_reads=tuple(n for n in names if n in update_reads),
            levels=_levels(steps),
        )

    def _group_values(self, names: list[str]) -> list[GroupValue]:
        """The per-group values between the reduction sweep and the final one: the means
        (kept as sum/N, exact for constant rows), then the values derived from them with
        their common subexpressions named once (online layer norm's coefficients share
        several). Float kernels compute dx from the factored closed form, so they skip the
        coefficients of the expanded one. ``names`` (the group values before them) grows."""
        A = self.atype
        coeffs = {k for k, _ in self.ir.dx_terms}
        means = {r for r, _ in zip((a.name for a in self.ir.bwd_group), self.ir.bwd_loop)}
        kept = [a for a in self.ir.bwd_group if a.name not in means and (A == "double" or a.name not in coeffs)]
        repl, reduced = sympy.cse([a.expr for a in kept], symbols=sympy.numbered_symbols("Cse"), order="none")
        values = [Assign(a.name, a.expr, a.comment) for a in self.ir.bwd_group if a.name in means]
        values += [Assign(str(t), e, "common subexpression") for t, e in repl]
        values += [Assign(a.name, r, a.comment) for a, r in zip(kept, reduced)]
        group = []
        for a in values:
            group.append(self._group_value(a.name, a.expr, a.comment, names))
            names.append(a.name)
        return group

    def backward(self) -> BackwardPlan:
        """The backward kernel's plan."""
        names = [i.name for i in self.spec.inputs] + list(self.ir.stats)
        temps = list(self.ir.values) + list(self.ir.bwd_elem)
        red = None
        if self.ir.bwd_loop:
            lp = self.loop(
                [e for _, e in self.ir.bwd_loop], temps, group_sums=self.ir.bwd_loop, arith=self.atype, first=True
            )
            red = self._sweep(lp, [a for a, _ in self.ir.bwd_loop], names)
            names += [a for a, _ in self.ir.bwd_loop]
        group = self._group_values(names)
        # double: dx = sum of per-group coefficients times element monomials (fewest flops);
        # float: the factored closed form, whose cancellations the hi/lo addends keep exact
        if self.atype == "double" and self.ir.dx_terms:
            dx_expr = Add(*[sympy.Symbol(k) * m for k, m in self.ir.dx_terms])
        else:
            dx_expr = self.ir.dx_closed
        if self.ir.dcore is not None:  # ∂L/∂h once per element: dx and the tensors' gradients read it
            temps.append(self.ir.dcore)
        dts = [("d" + t, e) for t, e in self.ir.dtensors]
        pexprs = [e for _, e in self.ir.dparams]
        final = self.loop(
            [dx_expr, *(e for _, e in dts), *pexprs],
            temps,
            stores=[("dx", dx_expr), *dts],
            param_sums=list(enumerate(pexprs)),
            arith=self.atype,
            outputs=["dx", *(o for o, _ in dts)],
            first=red is None,
            second=red is not None,
        )
        if red is not None:  # the block arrays the reduction sweep left are still the group's
            final = dataclasses.replace(final, fresh=tuple(p for p in final.blocks if p not in red.loop.blocks))
        sweep = self._sweep(final, (), names)
        if self.spec.layout == "trailing":
            sweep = dataclasses.replace(sweep, rows=row_sweep(final, names))
        return BackwardPlan(reduction=red, group=tuple(group), final=sweep)


def _levels(steps: list[Sweep | GroupValue]) -> tuple[SplitLevel, ...]:
    """The forward's steps as split-reduction levels (see :func:`derivgen.codegen.ir.split_levels`)."""
    levels: list[tuple[Sweep | None, list[GroupValue]]] = []
    for st in steps:
        if isinstance(st, Sweep) or not levels:
            levels.append((st if isinstance(st, Sweep) else None, []))
        if isinstance(st, GroupValue):
            levels[-1][1].append(st)
    out, known = [], []
    for sweep, assigns in levels:
        out.append(SplitLevel(sweep=sweep, assigns=tuple(assigns), known=tuple(known)))
        known += [a.name for a in assigns]
    return tuple(out)


# ---- second order (derivgen.derive.second): the double backward and the JVP -------------


def second_plan(
    printer: SpecPrinter,
    ir: SecondIR,
    ctype: str,
    windows: WindowFunctions | None = None,
    slots: BlockSlots | None = None,
) -> SecondPlan:
    """The C plan of one second-order kernel for the element type ``ctype`` (its windows'
    functions added to ``windows``, its block means' arrays to ``slots``)."""
    spec = printer.spec
    params = [p.name for p in spec.params]
    scalar = {p.name for p in spec.params if p.scalar}
    rename = {"N": "N", "x": "Xv", "dy": "Dyv"}
    for p in params:
        rename[p] = derived(p, "G") if p in scalar else derived(p, "V")
    masks = {m.name: m.option for m in spec.masks}
    rename.update({m: derived(m, "V") for m in masks})

    # arrays of x's shape read at the element: the tensor inputs, the cotangents of the outputs
    # beside y (the double backward's), the seeds of the tensors with a gradient
    arrays = [t.name for t in spec.tensors] + ([o.cotangent.name for o in spec.outputs] if ir.kind == "bb" else [])
    rename.update({a: derived(a, "V") for a in arrays})
    seed_arrays = {sd: t + "_Seed" for t, sd in ir.seed_tensors.items()}
    seed_chan = {ir.seed_params[p]: p for p in params if p not in scalar}
    loads = {"x": ("Xv", "x", "Idx"), "dy": ("Dyv", "dy", "Idx"), ir.seed_x: (ir.seed_x, "Seed_x", "Idx")}
    loads.update({a: (derived(a, "V"), a, "Idx") for a in arrays})
    loads.update({sd: (sd, arr, "Idx") for sd, arr in seed_arrays.items()})
    loads.update({p: (derived(p, "V"), p, "Ch") for p in params if p not in scalar})
    loads.update({sd: (sd, p + "_Seed", "Ch") for sd, p in seed_chan.items()})
    loads.update({m: (derived(m, "V"), mask_load(o), "", (o, "N")) for m, o in masks.items()})
    windows = windows or WindowFunctions(printer, f"{spec.name}_{ir.kind}", ctype)

    def C(e):
        return printer.c(e, "double", rename, lambda w: windows.function(w, list(ir.temps), loads).call(rename))

    def needed(exprs, temps_in=None):
        temps, names = needed_temps([hide_windows(e) for e in exprs], all_temps if temps_in is None else temps_in)
        loads = []
        if "x" in names:
            loads.append(f"const double Xv = {c_load('x[Idx]', ctype)};")
        if "dy" in names:
            loads.append(f"const double Dyv = {c_load('dy[Idx]', ctype)};")
        if ir.seed_x in names:
            loads.append(f"const double {ir.seed_x} = {c_load('Seed_x[Idx]', ctype)};")
        loads += [f"const double {derived(a, 'V')} = {c_load(a + '[Idx]', ctype)};" for a in arrays if a in names]
        loads += [
            f"const double {sd} = {c_load(arr + '[Idx]', ctype)};" for sd, arr in seed_arrays.items() if sd in names
        ]
        chan = [
            f"const double {derived(p, 'V')} = {c_load(p + '[Ch]', ctype)};"
            for p in params
            if p not in scalar and p in names
        ]
        chan += [f"const double {s} = {c_load(p + '_Seed[Ch]', ctype)};" for s, p in seed_chan.items() if s in names]
        chan += [f"const double {derived(m, 'V')} = {mask_load(o)};" for m, o in masks.items() if m in names]
        chan += passes.loads(names)
        return tuple(loads + [f"const double {nm} = {C(te)};" for nm, te in temps]), tuple(chan)

    def plan_pass(slot: int, body: sympy.Expr, kind: str, temps: list) -> BlockPass:
        elem, chan = needed([body], temps)
        names = needed_temps([body], temps)[1]
        comment = f'Bm{slot} = mean({printer.code(body)}, "{kind}")'
        return block_pass(slot, kind, comment, chan, elem, C(body), names, passes)

    passes = BlockPasses(slots if slots is not None else BlockSlots(), plan_pass)
    all_temps = passes.hide_temps(ir.temps)  # block means read as Bm<k> (BlockPass)
    sums = [(a, passes.hide(e, all_temps)) for a, e in ir.loop]
    elem1, chan1 = needed([e for _, e in sums])
    blocks1 = passes.needed(needed_temps([e for _, e in sums], all_temps)[1])
    outs2 = []
    for name, terms, closed in ir.outputs:
        outs2.append((name, passes.hide(Add(*[sympy.Symbol(k) * m for k, m in terms]), all_temps)))
    pexprs = [(k, passes.hide(e, all_temps)) for k, (p, e) in enumerate(ir.param_elem) if e != 0]
    elem2, chan2 = needed([e for _, e in outs2] + [e for _, e in pexprs])
    blocks2 = passes.needed(needed_temps([e for _, e in outs2] + [e for _, e in pexprs], all_temps)[1])
    group = [(a.name, C(a.expr), a.comment) for a in ir.means]
    repl, reduced = sympy.cse([a.expr for a in ir.group], symbols=sympy.numbered_symbols("Cse"), order="none")
    group += [(str(t), C(e), "common subexpression") for t, e in repl]
    group += [(a.name, C(r), a.comment) for a, r in zip(ir.group, reduced)]
    seed_group = []
    for i, s in ir.seed_inputs.items():
        seed_group.append((s, f"const double {s} = {c_load(i + '_Seed_In[Grp * ' + i + '_Seed_Stride]', ctype)};"))
    for p in params:
        if p in scalar:
            seed_group.append(
                (ir.seed_params[p], f"const double {ir.seed_params[p]} = {c_load(p + '_Seed[0]', ctype)};")
            )
    return SecondPlan(
        elem1=elem1,
        chan1=chan1,
        sums=tuple((a, C(e)) for a, e in sums),
        group=tuple(group),
        elem2=elem2,
        chan2=chan2,
        stores=tuple((n, C(e)) for n, e in outs2),
        param_sums=tuple((k, C(e)) for k, e in pexprs),
        inputs=tuple(ir.input_out),
        param_groups=tuple((params.index(p), v) for p, v in ir.param_group),
        seed_group=tuple(seed_group),
        blocks1=blocks1,
        blocks2=tuple(p for p in blocks2 if p not in blocks1),
    )


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
