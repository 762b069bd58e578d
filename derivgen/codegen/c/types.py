"""The plan types of the C kernels: plain, frozen data the templates lay out.

A sweep over a group (:class:`CLoop`, wrapped with its accumulators and layout needs as a
:class:`Sweep`), the per-group values between sweeps (:class:`GroupValue`,
:class:`GroupSelect`), a block mean's pass (:class:`BlockPass`), the split reduction's
levels (:class:`SplitLevel`), and the kernels of one mode for one element type
(:class:`KernelPlan`: :class:`ForwardPlan`, :class:`BackwardPlan`, :class:`SecondPlan`).
Every line records the names it reads, so which group values a sweep needs is known from
the plan, never read back from the C text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


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
    # a position layout's windows as tiles of the block (WindowFunctions.tiles): (slot, C text)
    # computed before the sweep, the windows inside others first; the element code reads Wt_<slot>
    window_tiles: tuple[tuple[int, str], ...] = ()
    # run values among the parameters' loads (hoist.py): the channel index may go unread
    runs: bool = False
    # the gradients of the tensors read at their own shape (a trailing layout's "sample" ones:
    # one value per sample and feature), as (slot, element expression in element arithmetic):
    # summed per feature over a unit's rows into Tsum[slot * M + feature] (in registers over
    # the rows in lockstep, like param_pend), the units added in order after the sweep
    tensor_pend: tuple[tuple[int, str], ...] = ()
    # a channel layout's: the parameter-sum slots (after the parameters') that are the
    # gradients of its per-(sample, channel) tensors, as (slot, output array): a run's lanes
    # are stored at the output's Tn + Ch instead of added into the thread's partials
    tensor_slots: tuple[tuple[int, str], ...] = ()
    # each such slot's one value where a run is one element per (sample, channel) (S == 1), as
    # (slot, the stored C value of its term)
    tensor_single: tuple[tuple[int, str], ...] = ()
    # the sweep reads or sums a channel layout's per-(sample, channel) tensor: the templates
    # define Tn, the block's sample's first value of it
    sample_index: bool = False
    # the sweep reads a channel layout's per-position tensor: the templates define Pi, the
    # element's (sample, position) index into it (uses_params: the runs know the position)
    position_index: bool = False

    # Runs whose iterations carry no lane sums may start their lane blocks anywhere, so a
    # long streaming run peels a scalar head up to a 64-byte boundary of its single output
    # and streams whole blocks straight from registers ("direct"; short ones are written
    # in place); runs with lane sums compute into a cache-resident tile that is streamed
    # out afterwards, keeping the lane of every element.
    def _direct(self, channel_lanes: bool) -> bool:
        return len(self.outputs) == 1 and not self.group_sums and not (channel_lanes and self.param_sums)

    @property
    def lane_arrays(self) -> tuple[str, ...]:
        """The suffixes of the lane arrays of this sweep's sums: ``Lane_<acc>`` of its group
        sums, then ``Lane_p<k>`` of its per-channel parameter sums."""
        return tuple(a for a, _ in self.group_sums) + tuple(f"p{k}" for k, _ in self.param_sums)

    @property
    def tensor_out(self) -> dict[int, str]:
        """The tensor gradients among the parameter-sum slots: slot -> output array."""
        return dict(self.tensor_slots)

    @property
    def tensor_one(self) -> dict[int, str]:
        """A tensor-gradient slot's stored value where its run is one element: slot -> C value."""
        return dict(self.tensor_single)

    @property
    def param_slots(self) -> tuple[int, ...]:
        """The parameters (slots) whose per-channel sums this sweep adds."""
        return tuple(k for k, _ in self.param_sums)

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
    axes: tuple[int, ...] = (3,)  # those of the (O, G, Cg, S) view one block spans (BLOCK_AXES)

    @property
    def by_sample(self) -> bool:
        """A block inside one sample (an instance, a sample): one thread's, where the threads
        share the group's samples."""
        return 0 not in self.axes

    @property
    def by_channel(self) -> bool:
        """A block inside one channel (an instance, a channel over the samples)."""
        return 2 not in self.axes

    @property
    def per_sample(self) -> str:
        """C: the blocks of one sample (of a ``by_sample`` kind)."""
        return "Cg" if self.by_channel else "1"


@dataclass(frozen=True)
class BlockPassGroup:
    """Block passes that walk the group together (kernel.c.j2, block_group): each keeps its own
    lanes, and adds them into its block array in its own order, so each mean has the bits of
    its pass alone; the loads are those of the passes, each once."""

    passes: tuple[BlockPass, ...]
    chan_loads: tuple[str, ...]
    elem_loads: tuple[str, ...]


def _declared(load: str) -> str:
    """The name a load declares (``const double Xv = ...;`` -> ``Xv``)."""
    return load.split("=", 1)[0].split()[-1]


def _merged(loads: list[str], more: tuple[str, ...]) -> list[str] | None:
    """``loads`` then those of ``more`` not among them; None where one of them declares a name
    already declared otherwise."""
    names = {_declared(v): v for v in loads}
    out = list(loads)
    for v in more:
        if v in out:
            continue
        if _declared(v) in names:
            return None
        names[_declared(v)] = v
        out.append(v)
    return out


def block_groups(passes: tuple[BlockPass, ...]) -> tuple[BlockPassGroup, ...]:
    """``passes`` (dependencies first) as groups that walk the group once: the passes whose
    block values the same earlier passes give (one level of the dependencies: none reads
    another's), in their order. A pass whose loads would declare a name its level's others
    declare otherwise walks alone."""
    level: dict[int, int] = {}
    for p in passes:
        level[p.slot] = 1 + max((level[d] for d in p.deps if d in level), default=-1)
    groups: list[BlockPassGroup] = []
    for lv in sorted(set(level.values())):
        chan: list[str] = []
        elem: list[str] = []
        members: list[BlockPass] = []
        for p in (q for q in passes if level[q.slot] == lv):
            c, e = _merged(chan, p.chan_loads), _merged(elem, p.elem_loads)
            if c is None or e is None:
                groups.append(BlockPassGroup((p,), p.chan_loads, p.elem_loads))
                continue
            chan, elem = c, e
            members.append(p)
        if members:
            groups.append(BlockPassGroup(tuple(members), tuple(chan), tuple(elem)))
    return tuple(groups)


@dataclass(frozen=True)
class NhwcSweep:
    """A sweep's group-level needs in the NHWC kernels."""

    prelude_inputs: tuple[str, ...]  # group values the prelude reads
    inner_group: tuple[str, ...]  # group values the element code reads
    inner_prelude: tuple[tuple[str, str], ...]  # (type, name) of prelude values the element code reads


@dataclass(frozen=True)
class RowSweep:
    """What a trailing layout's final backward sweep needs to run over rows in lockstep: the
    group values and prelude declarations its element code reads, as (C type, name)."""

    values: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sweep:
    """A sweep of a kernel: its loop, the accumulators it leaves, and its NHWC needs."""

    kind: ClassVar[str] = "sweep"
    loop: CLoop
    accs: tuple[str, ...]
    nhwc: NhwcSweep
    rows: RowSweep | None = None  # a trailing layout's final backward sweep over rows in lockstep

    @property
    def nhwc_prelude(self) -> tuple[tuple[CDecl, bool], ...]:
        """The prelude's declarations, each with whether the element code of a sweep over a
        block of groups reads it (kept per group in an array) or not."""
        return tuple((d, (d.ctype, d.name) in self.nhwc.inner_prelude) for d in self.loop.prelude)


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
    group's run (trailing layouts: one contiguous row), ``expr`` the element value (double),
    computed in DG_LANES lanes of type ``lane``."""

    kind: ClassVar[str] = "select"
    name: str
    op: str  # "max" or "min"
    expr: str
    comment: str
    reads: tuple[str, ...]
    x: str  # the name of x at the element, which ``expr`` reads (the naming table's)
    # the type of the selection's lanes: the element arithmetic's where the element value is
    # exact in it (x, -x, |x| of float data: float), else double; ``lane_expr`` is ``expr``
    # in it (the template, _c_sweep.j2's select, keeps ``expr`` to choose among zeros and NaNs)
    lane: str = "double"
    lane_expr: str = ""


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
    # the arrays a batch-reduced channels-last kernel allocates: (C type, name, length)
    batch_arrays: tuple[tuple[str, str, str], ...] = ()
    # values a statistic sweep keeps per element for the output sweep: one row per thread each
    # (<name>_Row, of the element arithmetic's type; CPlanner._kept)
    keeps: tuple[str, ...] = ()

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
    batch_arrays: tuple[tuple[str, str, str], ...] = ()  # as ForwardPlan's
    keeps: tuple[str, ...] = ()  # as ForwardPlan's: the reduction sweep keeps them for the final one

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
