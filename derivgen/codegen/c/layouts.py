"""What the layouts other than NCHW need of a sweep: channels last, and rows in lockstep.

Channels last (NHWC): the kernels run the same sweeps over a block of groups in lockstep:
for every position s of a run (and every channel of a group), the innermost loop walks the
block's groups, which are adjacent in memory. Each group keeps its own DG_LANES lanes,
filled in the same order as the NCHW kernels fill them (lane J gets the run's positions J,
J + DG_LANES, ..., the remainder lane 0), so sums, statistics and outputs are the NCHW
kernels' bits. Group-level values live in arrays ``Gv_<name>[Gi]``; the innermost loop
declares the ones its code uses (:class:`NhwcSweep`). The position layout's kernels
(``reduce = "position"``) read the same plan data.

Rows in lockstep (trailing layouts): a trailing layout's backward adds every element's
parameter-gradient terms into per-feature partial sums: done row by row, each element costs
a load and a store of each partial (float pend, flushed to double every DG_PEND rows). Its
final sweep therefore runs over DG_ROWS rows in lockstep instead: each row's reduction
sweep and group values come first, one row after another as before (the same bits for dx),
the group values the final sweep reads are kept in arrays ``Rv_<name>[Rr]``, and then,
block of DG_LANES features by block, the final sweep computes each row's dx and adds its
terms into registers, which go into the thread's double partials once per block of rows
(:class:`RowSweep`).

Batch-reduced channels-last kernels keep every group value, sum and per-channel prelude
value in arrays over the channels (:func:`batch_arrays`).
"""

from __future__ import annotations

from derivgen.codegen.c.types import CLoop, NhwcSweep, RowSweep, Sweep


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


def row_sweep(lp: CLoop, group_names: list[str]) -> RowSweep | None:
    """The lockstep plan of a trailing layout's final backward sweep, or None where the
    per-row sweep stays: no per-feature parameter or per-sample tensor terms, several outputs or group sums in
    the sweep (no straight streaming), scalar parameter sums, or window calls (they read a
    row's neighbours through its offset)."""
    if not (lp.param_pend or lp.tensor_pend) or not lp.direct_run or lp.scalar_param_sums or lp.calls_windows:
        return None
    prelude, group = _read_values(lp, group_names, lp.reads | lp.pend_reads)
    return RowSweep(values=prelude + tuple(("double", n) for n in group))


def batch_arrays(entries: list[str | tuple[Sweep, str]]) -> tuple[tuple[str, str, str], ...]:
    """The arrays of a batch-reduced channels-last kernel, as (C type, name, length), in the
    order the kernel defines its ``entries``: a group value's name gives ``Gv_<name>``; a
    sweep tagged ``tag`` its group sums (``Gv_<acc>``, block sums ``Bs_<acc>``), parameter
    sums (``Dp<k>``, ``Bs_p<k>``) and the prelude values its element code reads
    (``Pv<tag>_<name>``)."""
    out: list[tuple[str, str, str]] = []
    for v in entries:
        if isinstance(v, str):
            out.append(("double", f"Gv_{v}", "G"))
            continue
        sw, tag = v
        for acc, _ in sw.loop.group_sums:
            out += [("double", f"Gv_{acc}", "G"), ("double", f"Bs_{acc}", "DG_NHWC_CHUNK * G")]
        for k, _ in sw.loop.param_sums:
            out += [("double", f"Dp{k}", "G"), ("double", f"Bs_p{k}", "DG_NHWC_CHUNK * G")]
        out += [(t, f"Pv{tag}_{n}", "G") for t, n in sw.nhwc.inner_prelude]
    return tuple(out)
