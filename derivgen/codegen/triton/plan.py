"""Plans of the Triton kernels: a mode's IR as the text of ``triton.jit`` kernel statements.

Like the C planner (:mod:`derivgen.codegen.c.plan`), this module computes every statement of
a mode's kernels once, before rendering, as plain data (:class:`TritonPlan`), and the
template (``templates/triton.py.j2``) only lays it out. The kernels see a normalization
group as a matrix of A rows and B columns (``derivgen.triton._target.tile``) and sweep it
in tiles, or hold it in registers when it fits (``ONE_PASS``); the plan says what each
sweep loads, computes, sums and stores:

* forward: the program's sweeps of sums (``Loop``), group maxima and minima (``Select``)
  and per-group values (``Assign``), exactly as the IR writes them (two passes for a
  variance); then y; the statistics stored per group; the running buffers updated;
* backward: the statistics loaded, the reduction sweep, the per-group values (means,
  input gradients, parameter terms through the statistics), then dx from the factored
  closed form and each parameter's contributions, summed per channel into the program's
  row of partial sums (a second kernel reduces the rows).

A layer with tensor inputs beside x (``Spec.tensors``) reads each at x's element offsets
(``<t>_Ptr``: the host writes a broadcast one out at x's shape and strides); its core value
h = f(x, t) (``ModeIR.values``) is an element temporary of every sweep; the outputs beside y
are stored in the forward's last sweep beside y (``<o>_Out``); the backward reads their
cotangents (``d<o>_Ptr``), computes ∂L/∂h once per element (``ModeIR.dcore``) and stores
each tensor's element gradient (``d<t>_Ptr``) beside dx; the host sums a broadcast one over
the axes it is broadcast over.

A window, ``window(u, k)`` (:mod:`derivgen.symbolic.window`: the forward's ``Win1`` and the
transposed windows of the closed forms), is a ``triton.jit`` function of its own
(:class:`TWindow`): at each element of a tile it loops over the offsets D of the window,
a run-time k's, and sums its body at element Ib + D of the group, loading x, dy and the
parameters there (masked: zero past the group's ends), with the element temporaries the body
reads computed there too; a window inside the body (a temporary ``Win1`` at the neighbour)
calls its own function. The group runs along the columns of a 1 x B matrix (trailing and
``reduce = "position"`` layouts, the only ones with windows), so the neighbour lies D·sB away.

Every name a kernel makes carries an upper-case tag (``X_Ptr``, ``gamma_Part``,
``Sum_mean_Acc``), derivgen's namespace (see :mod:`derivgen.symbolic.naming`); element
values, statistics and options keep their spec names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from derivgen.codegen.ir import Loop, ModeIR, Select, needed_temps
from derivgen.codegen.triton.printer import triton_expr
from derivgen.spec.model import Spec
from derivgen.symbolic.naming import code_text, derived
from derivgen.symbolic.window import Window, offsets


@dataclass(frozen=True)
class TSweep:
    """One sweep over a group's elements: the element loads, temporaries, then sums
    (``accs``: accumulator, summed text), a selection (``select``: name, "max"/"min",
    text) or stores and parameter contributions (``stores``, ``params``)."""

    loads: tuple[tuple[str, str], ...]  # (value name, pointer name) of element loads
    temps: tuple[tuple[str, str], ...]  # (name, text)
    accs: tuple[tuple[str, str], ...] = ()
    select: tuple[str, str, str] | None = None
    stores: tuple[tuple[str, str], ...] = ()  # (pointer, text)
    params: tuple[tuple[str, str, bool], ...] = ()  # (parameter, contribution text, scalar)


@dataclass(frozen=True)
class TValue:
    """A per-group value: ``name = text``."""

    name: str
    text: str
    comment: str


@dataclass(frozen=True)
class TWindow:
    """A window's ``triton.jit`` function: called at a tile's elements (``Offs``, ``Mask``,
    ``Chan``, ``Ib``) with the group's length and stride (``B``, ``sB``), the pointers its
    loads read and the group values (options, statistics ...) its body reads; returns the
    sum over the window's offsets of the body at each element's neighbours."""

    name: str
    comment: str  # the window as text
    pointers: tuple[str, ...]  # X_Ptr, Dy_Ptr, <param>_Ptr, <option>_Lead (its own loads and its windows')
    values: tuple[str, ...]  # group values read, by their kernel names
    offsets: str  # the offsets D of the elements summed, as text
    width: str  # k as an int32 (an option's value cast, or a literal)
    transposed: bool
    loads: tuple[tuple[str, str], ...]  # element loads at the neighbour (Offs_D, Mask_D, Chan_D)
    temps: tuple[tuple[str, str], ...]  # element temporaries at the neighbour
    body: str

    def call(self, at: str = "") -> str:
        """The call at the elements ``Offs<at>``, ``Mask<at>``, ``Chan<at>``, ``Ib<at>``."""
        args = [f"Offs{at}", f"Mask{at}", f"Chan{at}", f"Ib{at}", "B", "sB", *self.pointers, *self.values]
        return f"{self.name}({', '.join(args)})"


@dataclass(frozen=True)
class TritonPlan:
    """A mode's two kernels for Triton, as statement text and argument lists."""

    mode: str
    forward_args: tuple[tuple[str, str], ...]  # (role, spec name) in kernel order
    backward_args: tuple[tuple[str, str], ...]
    forward_loads: tuple[tuple[str, str], ...]  # group loads: (name, load text)
    forward_steps: tuple[TSweep | TValue, ...]
    forward_final: TSweep
    stats: tuple[str, ...]
    buffer_loads: tuple[tuple[str, str], ...]  # buffers the updates read that are not loaded yet
    updates: tuple[tuple[str, str], ...]  # (buffer, text)
    backward_loads: tuple[tuple[str, str], ...]
    reduction: TSweep | None
    group: tuple[TValue, ...]
    final: TSweep
    final_one_pass: TSweep  # the output sweep after the reduction sweep's temporaries, in registers
    scalar_partials: tuple[str, ...]  # scalar parameters whose programs' sums are stored
    one_pass_loads: tuple[tuple[str, str], ...]  # forward: every element load, once
    one_pass_bwd_loads: tuple[tuple[str, str], ...]
    dinputs: tuple[tuple[str, str], ...]  # (input, group variable)
    dparam_groups: tuple[tuple[str, str], ...]  # (scalar parameter, group variable)
    windows: tuple[TWindow, ...] = ()  # the windows' functions, each after those it calls
    # the forward's steps and output sweep in registers (one pass): each sweep without the
    # element temporaries an earlier one computed (a core value h = f(x, t) is computed once)
    one_pass_steps: tuple[TSweep | TValue, ...] = ()
    one_pass_final: TSweep | None = None


class TritonPlanner:
    """Turns a ModeIR into Triton statement text."""

    def __init__(self, spec: Spec, ir: ModeIR):
        self.spec, self.ir = spec, ir
        self.params = [p.name for p in spec.params]
        self.scalar = {p.name for p in spec.params if p.scalar}
        self.chan = [p for p in self.params if p not in self.scalar]
        self.reads = spec.reads_buffers(ir.mode)
        self.windows: dict[tuple, TWindow] = {}  # by (window, the temporaries it reads), in definition order
        # arrays of x's shape read at x's offsets: the tensor inputs beside x, and the cotangents
        # of the outputs beside y
        self.arrays = [t.name for t in spec.tensors] + [o.cotangent.name for o in spec.outputs]

    def text(self, e: sympy.Expr, temps: list | tuple = (), at: str = "") -> str:
        """Triton text of ``e`` at the elements ``Offs<at>`` ...: its windows as calls of their
        functions, which compute the element temporaries ``temps`` their bodies read."""
        return triton_expr(e, self.spec, lambda w: self.window(w, temps).call(at))

    def element_pointers(self) -> dict[str, str]:
        """What each element load reads: x, dy, the tensor inputs and cotangents (at x's
        offsets), channel parameters (pointers), the ``leading(p)`` masks (the count ⌊p·N⌋
        the host passes)."""
        out = {"x": "X_Ptr", "dy": "Dy_Ptr", **{a: derived(a, "Ptr") for a in self.arrays}}
        out.update({p: derived(p, "Ptr") for p in self.chan})
        out.update({m.name: derived(m.option, "Lead") for m in self.spec.masks})
        return out

    def loads(self, names: set[str], at: str = "") -> tuple[tuple[str, str], ...]:
        """The element loads that code reading ``names`` needs, as (name, value text): x, dy,
        channel parameters, and the ``leading(p)`` masks (the feature index against the
        count ⌊p·N⌋ the host passes); at the elements ``Offs<at>``, ``Mask<at>``, ``Chan<at>``."""
        offs, mask, chan = f"Offs{at}", f"Mask{at}", f"Chan{at}"
        at_x = (("x", "X_Ptr"), ("dy", "Dy_Ptr"), *((a, derived(a, "Ptr")) for a in self.arrays))
        out = [(n, f"tl.load({ptr} + {offs}, mask={mask}, other=0.0).to(tl.float32)") for n, ptr in at_x if n in names]
        out += [(p, f"tl.load({derived(p, 'Ptr')} + {chan}, mask={mask}, other=0.0).to(tl.float32)") for p in self.chan]
        out += [(m.name, f"({chan} < {derived(m.option, 'Lead')}).to(tl.float32)") for m in self.spec.masks]
        return tuple((n, t) for n, t in out if n in names)

    def sweep(self, exprs: list[sympy.Expr], temps: list, **kw) -> TSweep:
        """A sweep computing ``exprs`` from the element temporaries ``temps`` it needs."""
        needed, names = needed_temps([sympy.sympify(e) for e in exprs], temps)
        return TSweep(self.loads(names), tuple((n, self.text(e, temps)) for n, e in needed), **kw)

    def window(self, w: Window, temps: list | tuple) -> TWindow:
        """The function of the window ``w`` (made once), whose body reads the element
        temporaries ``temps`` it needs (computed at each neighbour)."""
        needed, names = needed_temps([w.body], list(temps))
        key = (w, tuple(needed))
        if key in self.windows:
            return self.windows[key]
        inner: list[TWindow] = []

        def text(e: sympy.Expr) -> str:  # at the neighbour, recording the windows it calls
            return triton_expr(e, self.spec, lambda v: _record(inner, self.window(v, temps)).call("_D"))

        body = text(w.body)
        temps_text = tuple((n, text(e)) for n, e in needed)
        loads = self.loads(names, "_D")
        pointers = {self.element_pointers()[n] for n, _ in loads}
        values = names - {n for n, _ in loads} - {n for n, _ in needed}
        if w.size.is_Symbol:
            values.add(str(w.size))
        for v in inner:
            pointers |= set(v.pointers)
            values |= set(v.values)
        order = list(self.element_pointers().values())
        fn = TWindow(
            name=f"Window_{self.ir.mode}_{len(self.windows) + 1}",
            comment=code_text(w, self.spec),
            pointers=tuple(sorted(pointers, key=order.index)),
            values=tuple(sorted(values)),
            offsets=_offsets_text(w),
            width=f"tl.cast({w.size}, tl.int32)" if w.size.is_Symbol else str(int(w.size)),
            transposed=w.transposed,
            loads=loads,
            temps=temps_text,
            body=body,
        )
        self.windows[key] = fn
        return fn

    def group_loads(self, with_stats: bool) -> list[tuple[str, str]]:
        """Per-group loads: scalar parameters, inputs, buffers the statistics read, statistics."""
        out = [(p, f"tl.load({derived(p, 'Ptr')}).to(tl.float32)") for p in self.params if p in self.scalar]
        out += [
            (
                i.name,
                f"tl.load({derived(i.name, 'Ptr')} + Grp * {derived(i.name, 'Stride')}, mask=GOk, other=1.0).to(tl.float32)",
            )
            for i in self.spec.inputs
        ]
        if self.reads:
            out += [
                (b.name, f"tl.load({derived(b.name, 'Ptr')} + Grp, mask=GOk, other=1.0).to(tl.float32)")
                for b in self.spec.buffers
            ]
        if with_stats:
            out += [(s, f"tl.load({derived(s, 'Ptr')} + Grp, mask=GOk, other=1.0)") for s in self.ir.stats]
        return out

    def forward(self) -> tuple[list, TSweep, tuple]:
        """The forward's steps, its output sweep and every element load of the one-pass kernel."""
        steps: list[TSweep | TValue] = []
        names: set[str] = set()
        values = list(self.ir.values)  # the core value h = f(x, t): an element temporary of every sweep
        for st in self.ir.forward:
            if isinstance(st, Loop):
                accs = tuple((a, self.text(e, values)) for a, e in st.accs)
                sw = self.sweep([e for _, e in st.accs], values, accs=accs)
                steps.append(sw)
            elif isinstance(st, Select):
                sw = self.sweep([st.expr], values, select=(st.name, st.op, self.text(st.expr, values)))
                steps.append(sw)
            else:
                steps.append(TValue(st.name, self.text(st.expr), st.comment))
                continue
            names |= {n for n, _ in sw.loads}
        _, y = self.ir.fwd_elem[-1]
        temps = values + list(self.ir.fwd_elem[:-1])
        outs = [(output_pointer(o), e) for o, e in self.ir.out_elem]  # the outputs beside y
        stores = (("Y_Ptr", self.text(y, temps)), *((ptr, self.text(e, temps)) for ptr, e in outs))
        final = self.sweep([y, *(e for _, e in outs)], temps, stores=stores)
        names |= {n for n, _ in final.loads}
        return steps, final, self.loads(names)

    def backward(self) -> tuple[TSweep | None, list[TValue], TSweep, tuple]:
        """The backward's reduction sweep, group values, output sweep and one-pass loads."""
        ir = self.ir
        temps = list(ir.values) + list(ir.bwd_elem)
        red = None
        if ir.bwd_loop:
            red = self.sweep(
                [e for _, e in ir.bwd_loop], temps, accs=tuple((a, self.text(e, temps)) for a, e in ir.bwd_loop)
            )
        coeffs = {k for k, _ in ir.dx_terms}
        group = [TValue(a.name, self.text(a.expr), a.comment) for a in ir.bwd_group if a.name not in coeffs]
        contrib = [(p, e) for p, e in ir.dparams]
        ftemps = temps + ([ir.dcore] if ir.dcore is not None else [])  # ∂L/∂h, once per element
        dts = [(tensor_grad_pointer(t), e) for t, e in ir.dtensors]
        stores = (("Dx_Ptr", self.text(ir.dx_closed, ftemps)), *((ptr, self.text(e, ftemps)) for ptr, e in dts))
        final = self.sweep(
            [ir.dx_closed, *(e for _, e in dts), *(e for _, e in contrib)],
            ftemps,
            stores=stores,
            params=tuple((p, self.text(e, ftemps), p in self.scalar) for p, e in contrib if e != 0),
        )
        names = {n for n, _ in final.loads} | ({n for n, _ in red.loads} if red else set())
        return red, group, final, self.loads(names)

    def plan(self) -> TritonPlan:
        """The mode's whole plan."""
        spec, ir = self.spec, self.ir
        for p in ir.dparam_group_exprs:
            if p not in self.scalar:
                raise NotImplementedError(
                    f"{spec.name}: the Triton target takes a parameter in the statistics only when it is a scalar ({p})"
                )
        windowed = [a.name for a in ir.bwd_group if a.expr.has(Window) and a.name not in {k for k, _ in ir.dx_terms}]
        if windowed:
            raise NotImplementedError(
                f"{spec.name}: a per-group value of the backward holds a window ({windowed[0]}); "
                "the Triton kernels take windows in element values only"
            )
        steps, final, fwd_loads = self.forward()
        one_steps, one_final = _once([*steps, final])
        red, group, bfinal, bwd_loads = self.backward()
        buffers = [b.name for b in spec.buffers]
        loaded = {n for n, _ in self.group_loads(False)}
        upd_reads = {str(s) for _, e in ir.buffer_updates for s in e.free_symbols}
        bnames = [b for b in buffers if b in upd_reads and b not in loaded]
        fargs = [("x", "x"), *(("tensor", t.name) for t in spec.tensors), ("y", "y")]
        fargs += [("output", o.name) for o in spec.outputs] + [("param", p) for p in self.params]
        fargs += [("input", i.name) for i in spec.inputs]
        if buffers and (self.reads or ir.mode == "train"):
            fargs += [("buffer", b) for b in buffers]
        fargs += [("stat", s) for s in ir.stats] + [("option", o.name) for o in spec.options]
        fargs += [("mask", m.option) for m in spec.masks]
        bargs = [("dy", "dy"), *(("cotangent", o.name) for o in spec.outputs), ("x", "x")]
        bargs += [("tensor", t.name) for t in spec.tensors] + [("dx", "dx")]
        bargs += [("dtensor", t.name) for t in spec.grad_tensors] + [("param", p) for p in self.params]
        bargs += [("input", i.name) for i in spec.inputs]
        bargs += [("buffer", b) for b in buffers] if self.reads else []
        bargs += [("stat", s) for s in ir.stats] + [("option", o.name) for o in spec.options]
        bargs += [("mask", m.option) for m in spec.masks]
        bargs += [("dparam", p) for p in self.params] + [("dinput", i.name) for i in spec.inputs]
        return TritonPlan(
            mode=ir.mode,
            forward_args=tuple(fargs),
            backward_args=tuple(bargs),
            forward_loads=tuple(self.group_loads(False)),
            forward_steps=tuple(steps),
            forward_final=final,
            one_pass_steps=tuple(one_steps),
            one_pass_final=one_final,
            stats=tuple(ir.stats),
            buffer_loads=tuple(
                (b, f"tl.load({derived(b, 'Ptr')} + Grp, mask=GOk, other=1.0).to(tl.float32)")
                for b in bnames
                if ir.mode == "train"
            ),
            updates=tuple((b, self.text(e)) for b, e in ir.buffer_updates),
            backward_loads=tuple(self.group_loads(True)),
            reduction=red,
            group=tuple(group),
            final=bfinal,
            final_one_pass=_after(bfinal, red),
            scalar_partials=tuple(
                p
                for p in self.params
                if p in self.scalar and (p in {q for q, _, _ in bfinal.params} or p in ir.dparam_group_exprs)
            ),
            one_pass_loads=fwd_loads,
            one_pass_bwd_loads=bwd_loads,
            dinputs=tuple(ir.dinputs),
            dparam_groups=tuple((spec.params[k].name, var) for k, var in ir.dparam_groups),
            windows=tuple(self.windows.values()),
        )


def output_pointer(name: str) -> str:
    """The kernel argument an output beside y is stored through: ``h_Out`` for output h (the
    output's own name may be the element value it stores)."""
    return derived(name, "Out")


def tensor_grad_pointer(name: str) -> str:
    """The kernel argument a tensor input's element gradient is stored through (``residual_Dt``)."""
    return derived(name, "Dt")


def _offsets_text(w: Window) -> str:
    """The offsets a window sums, for its function's docstring: numbers for a fixed size."""
    if not w.size.is_Symbol:
        d = offsets(int(w.size), w.transposed)
        return f"{d[0]} .. {d[-1]}"
    k = w.size
    return f"-⌊({k}-1)/2⌋ .. ⌊{k}/2⌋" if w.transposed else f"-⌊{k}/2⌋ .. ⌊({k}-1)/2⌋"


def _record(calls: list, fn: TWindow) -> TWindow:
    """``fn``, noted in ``calls`` (the windows a window's body calls)."""
    calls.append(fn)
    return fn


def _after(final: TSweep, red: TSweep | None) -> TSweep:
    """``final`` without the temporaries ``red`` has computed already (one-pass kernels)."""
    if red is None:
        return final
    done = {n for n, _ in red.temps}
    return replace(final, temps=tuple((n, t) for n, t in final.temps if n not in done))


def _once(sweeps: list) -> tuple[list, TSweep]:
    """The forward's steps and output sweep (the last) in one pass over registers: a sweep
    leaves out the element temporaries an earlier sweep computed (the same definitions)."""
    done: set[str] = set()
    out = []
    for st in sweeps:
        if isinstance(st, TSweep):
            kept = tuple((n, t) for n, t in st.temps if n not in done)
            done |= {n for n, _ in st.temps}
            st = replace(st, temps=kept)
        out.append(st)
    return out[:-1], out[-1]


def plan_triton(spec: Spec, ir: ModeIR) -> TritonPlan:
    """The Triton plan of one mode's IR."""
    return TritonPlanner(spec, ir).plan()
