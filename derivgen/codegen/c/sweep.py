"""The sweep planner: a mode's first-order IR as the C statements of its forward and
backward kernels, for one element type.

The kernel templates lay out the loops -- groups, blocks, runs of contiguous values,
DG_LANES lanes -- and :class:`CPlanner` fills them: what each sweep over a group loads,
computes, stores and sums (:class:`~derivgen.codegen.c.types.CLoop`), and the per-group
values between sweeps. Float kernels compute their output sweeps in float with the group
terms as hi/lo pairs (``H0_hi``) and float copies (``rstd_F``); common subexpressions of
the group values are ``Cse0``. Names of loads and group values come from the naming table
(:mod:`derivgen.codegen.c.names`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import sympy
from sympy import Add

from derivgen.codegen.c.blocks import BlockPasses, BlockSlots, block_pass, block_slots_read
from derivgen.codegen.c.ctext import ATYPES, c_store, output_array
from derivgen.codegen.c.floats import exact_selection, float_prelude, kv, shared_calls, sums_in_float
from derivgen.codegen.c.hoist import RunValues, hoist, reciprocals
from derivgen.codegen.c.layouts import batch_arrays, nhwc_sweep, row_sweep
from derivgen.codegen.c.names import (
    CHANNEL_INDEX,
    POSITION_INDEX,
    X,
    group_names,
    load_table,
    locals_of,
    native_names,
    summed_names,
)
from derivgen.codegen.c.types import (
    BackwardPlan,
    BlockPass,
    CDecl,
    CLoop,
    ForwardPlan,
    GroupSelect,
    GroupValue,
    SplitLevel,
    Sweep,
)
from derivgen.codegen.c.windows import WindowFunctions, hide_windows
from derivgen.codegen.ir import Assign, Loop, ModeIR, Select, needed_temps
from derivgen.codegen.printers import SpecPrinter, TileRead
from derivgen.symbolic.window import Window


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
        self.group_names = group_names(spec)
        self.masks = {m.name: m.option for m in spec.masks}
        # arrays of x's shape read at the element beside x and dy: the tensor inputs, and the
        # cotangents of the outputs beside y
        self.arrays = [t.name for t in spec.tensors] + [o.cotangent.name for o in spec.outputs]
        self.loads = load_table(spec, self.arrays)  # the naming table (names.py)
        self.native = set(native_names(spec))  # tensors read at their own shape
        self.summed = set(summed_names(spec))  # and those whose gradients the backward kernel sums
        self.elem_names = locals_of(self.loads)
        self.run_values = RunValues()  # the block sweeps' values shared along a run

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
    def loop(
        self,
        exprs: list[sympy.Expr],
        temps: list[tuple[str, sympy.Expr]],
        *,
        stores: Iterable[tuple[str, sympy.Expr]] = (),
        group_sums: Iterable[tuple[str, sympy.Expr]] = (),
        param_sums: Sequence[tuple[int, sympy.Expr]] = (),
        tensor_sums: Sequence[sympy.Expr] = (),
        tensor_slots: Sequence[tuple[int, str]] = (),
        arith: str = "double",
        outputs: Iterable[str] = (),
        first: bool = False,
        second: bool = False,
        float_sums: bool | str = False,
        keep_out: Sequence[tuple[sympy.Expr, str]] = (),
        keep_in: Sequence[tuple[sympy.Expr, str]] = (),
        exact: frozenset[str] = frozenset(),
    ) -> CLoop:
        """Element sweep computing ``exprs``; ``temps`` are element temporaries available;
        ``stores`` are (output array, element expression) pairs.

        ``tensor_sums`` are the element gradients of a trailing layout's tensors read at
        their own shape, summed per sample and feature (``CLoop.tensor_pend``); a channel
        layout's are parameter sums whose ``tensor_slots`` (slot, output) store each run's
        sum per (sample, channel) (``CLoop.tensor_slots``).

        ``outputs`` are the full-size arrays the sweep writes (straight, streamed
        from registers, or through a cache-resident tile streamed out after each
        run: see the template); the ``first`` sweep of a function prefetches the
        arrays it reads, and the ``second`` reads them ahead in the next group.

        Loads and stores use the array type. Sums are always double. With
        ``arith="double"`` all arithmetic is double, so a float32 kernel centres
        and squares without rounding the statistics to float (mean offset 1e4)
        or overflowing (|x| ~ 1e30). ``arith="float"`` (output sweeps of float
        kernels) computes in float, adding group-level terms as hi + lo pairs; with
        ``float_sums`` the summands too (each widened to double as it is added: see
        :func:`~derivgen.codegen.c.floats.sums_in_float`; ``"dx"``: a gradient's). ``keep_out`` are
        (call, name) pairs the sweep computes in its element arithmetic and also stores in the
        thread's row ``<name>_Row`` (at the element's place in its group's run), ``keep_in``
        those it reads back from there instead of computing them again (see :meth:`_kept`).
        ``exact``: the group values that are float values (a maximum of x), added without a low half.
        """
        ctype = self.ctype
        # the scalar parameters' sums (slots past the parameters' are tensor gradients' sums)
        scalar_sums = (
            (f"Psum_{k}", e) for k, e in param_sums if k < len(self.params) and self.params[k] in self.scalar
        )
        all_sums0 = [*group_sums, *scalar_sums]
        if keep_in:  # read back, not computed: the sweep's expressions hold the names instead
            back = {f: sympy.Symbol(nm) for f, nm in keep_in}
            exprs = [e.xreplace(back) for e in exprs]
            stores = [(o, e.xreplace(back)) for o, e in stores]
            temps = [(nm, e.xreplace(back)) for nm, e in temps]
            group_sums = [(a, e.xreplace(back)) for a, e in group_sums]
            param_sums = [(k, e.xreplace(back)) for k, e in param_sums]
            tensor_sums = [e.xreplace(back) for e in tensor_sums]
        for f, nm in keep_out:  # computed as a temporary after those it reads, stored, and read by name
            to = {f: sympy.Symbol(nm)}
            deps = {str(v) for v in f.free_symbols}
            at = max((i for i, (t, _) in enumerate(temps) if t in deps), default=-1) + 1
            temps = [*temps[:at], (nm, f), *((t, e.xreplace(to)) for t, e in temps[at:])]
            exprs = [e.xreplace(to) for e in exprs]
            group_sums = [(a, e.xreplace(to)) for a, e in group_sums]
        # block means are read as values one per block, left by their passes (BlockPass)
        temps = self.blocks.hide_temps(temps)
        exprs = [self.blocks.hide(e, temps) for e in exprs]
        stores = [(o, self.blocks.hide(e, temps)) for o, e in stores]
        group_sums = [(a, self.blocks.hide(e, temps)) for a, e in group_sums]
        param_sums = [(k, self.blocks.hide(e, temps)) for k, e in param_sums]
        tensor_sums = [self.blocks.hide(e, temps) for e in tensor_sums]
        needed, names = needed_temps([hide_windows(e) for e in exprs], temps)
        block_reads = [f"Bm{k}" for k in block_slots_read(names)]
        if block_reads:  # block values are double: the element code reading them is too
            arith = "double"
        runs: list[tuple[str, sympy.Expr]] = []  # computed once a run of positions (hoist.py)
        if arith == "double" and not keep_in and not keep_out:
            every = [e for _, e in stores] + [e for _, e in group_sums] + [e for _, e in param_sums] + tensor_sums
            varying = {"x", "dy", *self.masks, *self.arrays}
            if block_reads:
                runs, needed, every = hoist(needed, every, varying, self.run_values)
            needed, every = reciprocals(needed, every, varying | set(block_reads))  # once an element
            rest = iter(every)
            stores = [(o, next(rest)) for o, _ in stores]
            group_sums = [(a, next(rest)) for a, _ in group_sums]
            param_sums = [(k, next(rest)) for k, _ in param_sums]
            tensor_sums = [next(rest) for _ in tensor_sums]
        chan = [p for p in self.params if p not in self.scalar]
        loads = self.loads

        called: list[Window] = []  # a sweep that calls a window function needs the channel index Ch
        window_reads: set[str] = set()  # and the group values the calls pass

        tiles: list[tuple[int, str]] = []  # the position layout's windows, as tiles of the block
        kernel_values = set(self.group_names) | {o.name for o in self.spec.options}

        def windows(w: Window) -> str:
            called.append(w)
            tiled = self.spec.reduce == "position"
            fn = self.windows.function(w, list(temps), loads, called=not tiled)
            if tiled and not set(fn.groups) <= kernel_values:  # reads a group's own value: called
                tiled = False
                fn = self.windows.function(w, list(temps), loads)
            window_reads.update(self.group_names.get(g, g) for g in fn.groups)
            if tiled:
                for t in self.windows.tiles(w, list(temps), loads, self.group_names):
                    if t not in tiles:
                        tiles.append(t)
                return TileRead(f"Wt_{fn.slot}[Ch * DG_NHWC_GROUPS + Gi]")
            return fn.call(self.group_names)

        kept = [nm for _, nm in (*keep_in, *keep_out)]
        elem = {"x", "dy", *chan, *self.masks, *block_reads, *self.arrays, *kept} | {nm for nm, _ in needed}
        enames = dict(self.group_names)
        enames.update(self.elem_names)
        enames.update({b: b for b in block_reads})
        enames.update({nm: nm for nm, _ in runs})
        prelude, hoisted = ([], {})
        if arith == "float":
            every = [te for _, te in needed] + list(exprs)
            prelude, hoisted = float_prelude(every, elem, enames, self.g, self.group_names, exact)
        body_reads: set[str] = set()
        pend_reads: set[str] = set()
        # masks compare in double: group values as computed, element values widened
        mask_names = {**self.group_names, **{k: f"((double){v})" for k, v in self.elem_names.items()}}
        mask_names.update({nm: f"((double){kv(nm)})" for nm in [*(n for n, _ in needed), *kept]})

        def element(e: sympy.Expr, into: set[str]) -> str:
            """Element arithmetic (temporaries, stored outputs) in the sweep's type."""
            if arith == "float":
                text, reads = self.printer.c_float_reads(e, enames, hoisted, mask_names, windows)
            else:
                text, reads = self.printer.c_reads(e, "double", enames, windows)
            into |= reads
            return text

        elem_loads = [ld.line(ctype, arith) for n, ld in loads.items() if ld.at_element and n in names]
        # a block value one per sample (index Blk) is read with the element; one per (sample,
        # channel) or per channel with the parameters, where the sweep knows the channel Ch
        if not runs:
            elem_loads += self.blocks.loads(names, by_channel=False)
        for f, nm in keep_in:
            elem_loads.insert(0, f"const {arith} {kv(nm)} = {kv(nm)}_Row[Idx - Off];")
            enames[nm] = kv(nm)
        stored_rows = {nm for _, nm in keep_out}
        for nm, te in needed:
            elem_loads.append(f"const {arith} {kv(nm)} = {element(te, body_reads)};")
            enames[nm] = kv(nm)
            if nm in stored_rows:
                elem_loads.append(f"{kv(nm)}_Row[Idx - Off] = {kv(nm)};")
        # summands are double: float element values are widened before any arithmetic, so the
        # temporaries (x-hat, g) are the same values in every sweep and products do not overflow
        dnames = dict(self.group_names)
        dnames.update(self.elem_names)
        dnames.update({nm: kv(nm) for nm, _ in needed})
        dnames.update({b: b for b in block_reads})
        dnames.update({nm: nm for nm, _ in runs})
        if arith != "double":
            dnames.update({k: f"((double){v})" for k, v in dnames.items() if k in elem})

        # a kept call (Kv0: a float value, computed once for the float sweeps) is called again in
        # a double summand, whose element terms keep double's precision (kept calls read no
        # block means: floats.shared_calls keeps none where there are any)
        unkeep = {sympy.Symbol(nm): f for f, nm in (*keep_in, *keep_out)}

        def summand(e: sympy.Expr, into: set[str] = body_reads) -> str:
            text, reads = self.printer.c_reads(e.xreplace(unkeep), "double", dnames, windows)
            into.update(reads)
            return text

        param_loads = [ld.line(ctype, arith) for n, ld in loads.items() if not ld.at_element and n in names]
        # with run values, every block value is read with the parameters, before the run values
        param_loads += self.blocks.loads(names, by_channel=None if runs else True)
        param_loads += [f"const double {nm} = {element(te, body_reads)};" for nm, te in runs]
        scalar = {k for k, p in enumerate(self.params) if p in self.scalar}
        chan_sums = [(k, e) for k, e in param_sums if k not in scalar]
        scal_sums = [(k, e) for k, e in param_sums if k in scalar]
        all_sums = list(group_sums) + [(f"Psum_{k}", e) for k, e in scal_sums]
        stored = tuple((o, c_store(element(e, body_reads), ctype)) for o, e in stores)

        def float_summand(e: sympy.Expr) -> str:
            """The element factors in float, widened; the group factor in double."""
            c, v = e.as_independent(*(t for t in e.free_symbols if str(t) in elem), as_Add=False)
            text = f"((double)({element(v, body_reads)}))"
            if c == 1:
                return text
            ct, reads = self.g(c)
            body_reads.update(reads)
            return f"{text}*({ct})"

        fl = bool(float_sums) and arith != "double"
        in_float = [fl and sums_in_float(e, elem, float_sums == "dx") for _, e in all_sums0]
        sums = tuple((a, float_summand(e) if f else summand(e)) for (a, e), f in zip(all_sums, in_float))
        psum_reads: set[str] = set()
        chan_summands = tuple((k, summand(e, psum_reads)) for k, e in chan_sums)
        pend = tuple((k, element(e, pend_reads)) for k, e in chan_sums)
        tpend = tuple((k, element(e, pend_reads)) for k, e in enumerate(tensor_sums))
        body_reads |= window_reads
        other_reads = frozenset(body_reads)  # what the element code reads besides the parameter sums
        body_reads |= psum_reads
        passes = self.blocks.needed(names)
        # the arrays of x's shape read ahead (a tensor read at its own shape is not: its values
        # are those of a sample, read again by every row)
        streamed = [a for a in self.arrays if a not in self.native]
        # a per-position tensor is read at the element's position (Pi), which the runs of the
        # parameter sweeps know: along the channels (S == 1) one position, else runs of S
        positions = any(ld.index == POSITION_INDEX for n, ld in loads.items() if n in names)
        return CLoop(
            uses_params=bool(param_loads) or bool(chan_sums) or bool(called) or positions,
            prelude=_live(prelude, frozenset(body_reads | pend_reads)),
            param_loads=tuple(param_loads),
            elem_loads=tuple(elem_loads),
            stores=stored,
            group_sums=sums,
            param_sums=chan_summands,
            scalar_param_sums=tuple((k, f"Psum_{k}") for k, _ in scal_sums),
            param_pend=pend,
            tensor_pend=tpend,
            tensor_slots=tuple(tensor_slots),
            tensor_single=tuple((k, c_store(f"(double)({e})", ctype)) for k, e in pend if k in dict(tensor_slots)),
            sample_index=bool(tensor_slots) or any(ld.index == CHANNEL_INDEX for n, ld in loads.items() if n in names),
            position_index=positions,
            outputs=tuple(outputs),
            prefetch=tuple(a for a in ("x", "dy", *streamed) if a in names) if first else (),
            ahead_next=tuple(a for a in ("x", "dy", *streamed) if a in names) if second else (),
            reads=frozenset(body_reads),
            pend_reads=frozenset(pend_reads),
            other_reads=other_reads,
            calls_windows=bool(called),
            float_lanes=arith == "float" and bool(chan_sums) and self.spec.reduce != "position",
            blocks=passes,
            fresh=passes,
            window_tiles=tuple(tiles),
            runs=bool(runs),
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
        names = [i.name for i in spec.inputs] + [self.group_names[b.name] for b in spec.buffers]
        steps: list[Sweep | GroupValue] = []
        values = list(self.ir.values)  # the core value h = f(x, t), an element temporary of every sweep
        chan = {p for p in self.params if p not in self.scalar}
        elem = {"x", "dy", *chan, *self.masks, *self.arrays}  # the element values a summand may read
        _, out_expr = self.ir.fwd_elem[-1]
        temps = values + list(self.ir.fwd_elem[:-1])
        extra = [(output_array(o), e) for o, e in self.ir.out_elem]  # the outputs beside y
        floats = [
            isinstance(st, Loop)
            and self.atype != "double"
            and not values
            and all(sums_in_float(e, elem) for _, e in st.accs)
            for st in self.ir.forward
        ]
        last, keeps = self._kept(floats, [out_expr, *(e for _, e in extra), *(e for _, e in temps)])
        exact: set[str] = set()  # the maxima and minima taken in float lanes: float values
        for k, st in enumerate(self.ir.forward):
            if isinstance(st, Loop):
                done = sum(isinstance(s, Sweep) for s in steps)
                lp = self.loop(
                    [e for _, e in st.accs],
                    values,
                    group_sums=st.accs,
                    arith=self.atype if floats[k] else "double",
                    first=done == 0,
                    second=done == 1,
                    float_sums=floats[k],
                    keep_out=keeps if k == last else (),
                    exact=frozenset(exact),
                )
                steps.append(self._sweep(lp, [a for a, _ in st.accs], names))
                names += [a for a, _ in st.accs]
            elif isinstance(st, Select):
                enames = {**self.group_names, **self.elem_names}
                text, reads = self.printer.c_reads(st.expr, "double", enames)
                lane = self.atype if exact_selection(st.expr) else "double"
                lane_text = self.printer.c_reads(st.expr, lane, enames)[0] if lane != "double" else text
                exact.update([st.name] if lane != "double" else [])
                steps.append(
                    GroupSelect(
                        st.name,
                        st.op,
                        text,
                        st.comment,
                        tuple(n for n in names if n in reads),
                        x=X,
                        lane=lane,
                        lane_expr=lane_text,
                    )
                )
                names.append(st.name)
            else:
                steps.append(self._group_value(st.name, st.expr, st.comment, names))
                names.append(st.name)
        done = sum(isinstance(s, Sweep) for s in steps)
        final = self.loop(
            [out_expr, *(e for _, e in extra)],
            temps,
            stores=[("y", out_expr), *extra],
            arith=self.atype,
            outputs=["y", *(o for o, _ in extra)],
            first=done == 0,
            second=done == 1,
            keep_in=keeps,
            exact=frozenset(exact),
        )
        updates = [(b, *self.g(e)) for b, e in self.ir.buffer_updates]
        update_reads = frozenset().union(*(r for _, _, r in updates))
        final_sweep = self._sweep(final, (), names)
        arrays = [*(i.name for i in spec.inputs), *(b.name + "_G" for b in spec.buffers)]
        arrays += [(st, str(k)) if isinstance(st, Sweep) else st.name for k, st in enumerate(steps)]
        return ForwardPlan(
            steps=tuple(steps),
            final=final_sweep,
            updates=tuple((b, text) for b, text, _ in updates),
            update_reads=tuple(n for n in names if n in update_reads),
            levels=_levels(steps),
            batch_arrays=batch_arrays([*arrays, (final_sweep, "F")]),
            keeps=tuple(kv(nm) for _, nm in keeps),
        )

    def _kept(self, floats: list[bool], out: list[sympy.Expr]) -> tuple[int | None, list[tuple[sympy.Expr, str]]]:
        """The calls of elementary functions that the forward's last statistic sweep adds in
        float and the output sweep computes again (softmax's exp(x - m)): that sweep keeps
        their values in a row of the thread's (``Kv0_Row``, one group's run: trailing layouts,
        whose group is one contiguous run) and the output sweep reads them back, the same bits
        as computing them again in the same arithmetic without a second call. Returns the
        sweep's index in the forward program and the (call, name) pairs."""
        loops = [k for k, st in enumerate(self.ir.forward) if isinstance(st, Loop)]
        if self.spec.layout != "trailing" or not loops or not floats[loops[-1]]:
            return None, []
        return loops[-1], shared_calls([e for _, e in self.ir.forward[loops[-1]].accs], out)

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
        plan = self._backward(True)
        return plan if plan.final.rows is None or not plan.keeps else self._backward(False)

    def _backward(self, keep: bool) -> BackwardPlan:
        """The backward kernel's plan; ``keep``: the reduction sweep keeps the elementary-function
        calls the final sweep computes again (trailing layouts, float; see :meth:`_kept`) --
        not where the final sweep goes over rows in lockstep, after the rows' reductions."""
        names = [i.name for i in self.spec.inputs] + list(self.ir.stats)
        temps = list(self.ir.values) + list(self.ir.bwd_elem)
        red = None
        keeps: list[tuple[sympy.Expr, str]] = []
        if self.ir.bwd_loop:
            if keep and self.spec.layout == "trailing" and self.atype != "double":
                red_exprs = [e for _, e in self.ir.bwd_loop]
                needed, _ = needed_temps(red_exprs, temps)
                keeps = shared_calls([*red_exprs, *(e for _, e in needed)], self._backward_exprs(temps))
            lp = self.loop(
                [e for _, e in self.ir.bwd_loop],
                temps,
                group_sums=self.ir.bwd_loop,
                arith=self.atype,
                first=True,
                float_sums="dx",  # summands of elementary functions in float, as dx (floats.sums_in_float)
                keep_out=keeps,
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
        # a per-sample tensor has its gradient summed in the sweep; the others' are stored at
        # x's shape (a per-position one's too: its sum over the channels crosses the groups)
        dts = [("d" + t, e) for t, e in self.ir.dtensors if t not in self.summed]
        tsums = [(t, e) for t, e in self.ir.dtensors if t in self.summed]
        pexprs = [e for _, e in self.ir.dparams]
        trailing = self.spec.layout == "trailing"
        # a channel layout's per-(sample, channel) tensors: parameter-sum slots after the parameters'
        slots = [] if trailing else [(len(pexprs) + j, "d" + t) for j, (t, _) in enumerate(tsums)]
        final = self.loop(
            [dx_expr, *(e for _, e in dts), *pexprs, *(e for _, e in tsums)],
            temps,
            stores=[("dx", dx_expr), *dts],
            param_sums=list(enumerate(pexprs + ([] if trailing else [e for _, e in tsums]))),
            tensor_sums=[e for _, e in tsums] if trailing else [],
            tensor_slots=slots,
            arith=self.atype,
            outputs=["dx", *(o for o, _ in dts)],
            first=red is None,
            second=red is not None,
            float_sums="dx",  # scalar parameters' sums of elementary functions, as dx (floats.sums_in_float)
            keep_in=keeps,
        )
        if red is not None:  # the block arrays the reduction sweep left are still the group's
            final = dataclasses.replace(final, fresh=tuple(p for p in final.blocks if p not in red.loop.blocks))
        sweep = self._sweep(final, (), names)
        if self.spec.layout == "trailing":
            sweep = dataclasses.replace(sweep, rows=row_sweep(final, names))
        arrays = [*(i.name for i in self.spec.inputs), *self.ir.stats]
        arrays += [(red, "R")] if red is not None else []
        arrays += [v.name for v in group] + [(sweep, "F")]
        return BackwardPlan(
            reduction=red,
            group=tuple(group),
            final=sweep,
            batch_arrays=batch_arrays(arrays),
            keeps=tuple(kv(nm) for _, nm in keeps),
        )

    def _backward_exprs(self, temps: list[tuple[str, sympy.Expr]]) -> list[sympy.Expr]:
        """What the backward's final sweep computes (dx in the float kernels' factored form, the
        tensors' and parameters' gradients) with the temporaries it needs."""
        exprs = [self.ir.dx_closed, *(e for _, e in self.ir.dtensors), *(e for _, e in self.ir.dparams)]
        needed, _ = needed_temps(exprs, temps + ([self.ir.dcore] if self.ir.dcore is not None else []))
        return [*exprs, *(e for _, e in needed)]


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
