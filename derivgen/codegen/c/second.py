"""The second-order C kernels (:mod:`derivgen.derive.second`): the double backward and the JVP.

One reduction sweep and one output sweep per group, all arithmetic in double (float values
are widened on load), sums in DG_LANES lanes; the template (``_c_second.j2``) lays out the
loops. Loads are named by the naming table (:mod:`derivgen.codegen.c.names`), windows and
block means shared with the mode's first-order kernels.
"""

from __future__ import annotations

import sympy
from sympy import Add

from derivgen.codegen.c.blocks import BlockPasses, BlockSlots, block_pass, block_slots_read
from derivgen.codegen.c.ctext import c_load
from derivgen.codegen.c.hoist import RunValues, hoist
from derivgen.codegen.c.names import group_names, load_table, locals_of
from derivgen.codegen.c.types import BlockPass, SecondPlan
from derivgen.codegen.c.windows import WindowFunctions, hide_windows
from derivgen.codegen.ir import SecondIR, needed_temps
from derivgen.codegen.printers import SpecPrinter


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
    # arrays of x's shape read at the element: the tensor inputs, the cotangents of the outputs
    # beside y (the double backward's); the seeds of x, the tensors and the parameters too
    arrays = [t.name for t in spec.tensors] + ([o.cotangent.name for o in spec.outputs] if ir.kind == "bb" else [])
    loads = load_table(spec, arrays, ir)  # the naming table (names.py)
    rename = {**group_names(spec, buffers=False), **locals_of(loads)}
    windows = windows or WindowFunctions(printer, f"{spec.name}_{ir.kind}", ctype)

    def C(e):
        return printer.c(e, "double", rename, lambda w: windows.function(w, list(ir.temps), loads).call(rename))

    varying = {n for n, ld in loads.items() if ld.at_element}
    run_values = RunValues()

    def needed(exprs, temps_in=None):
        """(element loads and temporaries, per-run loads and run values, ``exprs`` as printed)."""
        temps, names = needed_temps([hide_windows(e) for e in exprs], all_temps if temps_in is None else temps_in)
        elem = [ld.line(ctype) for n, ld in loads.items() if ld.at_element and n in names]
        chan = [ld.line(ctype) for n, ld in loads.items() if not ld.at_element and n in names]
        chan += passes.loads(names)
        if block_slots_read(names):  # a block sweep: its arithmetic shared along a run, once a run (hoist.py)
            runs, temps, exprs = hoist(temps, list(exprs), varying, run_values)
            chan += [f"const double {nm} = {C(te)};" for nm, te in runs]
        return tuple(elem + [f"const double {nm} = {C(te)};" for nm, te in temps]), tuple(chan), list(exprs)

    def plan_pass(slot: int, body: sympy.Expr, kind: str, temps: list) -> BlockPass:
        elem, chan, (body_c,) = needed([body], temps)
        names = needed_temps([body], temps)[1]
        comment = f'Bm{slot} = mean({printer.code(body)}, "{kind}")'
        return block_pass(slot, kind, comment, chan, elem, C(body_c), names, passes)

    passes = BlockPasses(slots if slots is not None else BlockSlots(), plan_pass)
    all_temps = passes.hide_temps(ir.temps)  # block means read as Bm<k> (BlockPass)
    sums = [(a, passes.hide(e, all_temps)) for a, e in ir.loop]
    blocks1 = passes.needed(needed_temps([e for _, e in sums], all_temps)[1])
    elem1, chan1, printed = needed([e for _, e in sums])
    sums = [(a, e) for (a, _), e in zip(sums, printed)]
    outs2 = []
    for name, terms, closed in ir.outputs:
        outs2.append((name, passes.hide(Add(*[sympy.Symbol(k) * m for k, m in terms]), all_temps)))
    pexprs = [(k, passes.hide(e, all_temps)) for k, (p, e) in enumerate(ir.param_elem) if e != 0]
    blocks2 = passes.needed(needed_temps([e for _, e in outs2] + [e for _, e in pexprs], all_temps)[1])
    elem2, chan2, printed = needed([e for _, e in outs2] + [e for _, e in pexprs])
    outs2 = [(n, e) for (n, _), e in zip(outs2, printed)]
    pexprs = [(k, e) for (k, _), e in zip(pexprs, printed[len(outs2) :])]
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
