"""The code generator's IR: one program per mode (and per second-order kernel), as plain data.

The IR is what every target lays out as loops:

* forward group program: ``Loop`` (accumulate sums of element expressions over
  the group) and ``Assign`` (a per-group value from sums and earlier values),
  exactly the statistics as the spec writes them -- two passes for a variance,
  never E[x²] - E[x]²;
* forward elementwise: the normalized coordinate, then y;
* backward: element temporaries (x̂, g), the run-time reductions, per-group
  coefficients, dx as ``Σ coefficient · element monomial``, parameter-gradient
  contributions, per-group input gradients.

It is built from a mode's derivation (:func:`build_mode_ir`) and from its second
order (:func:`build_second_ir`); the C planner (:mod:`derivgen.codegen.c.plan`) and the
templates (:mod:`derivgen.codegen.emit`) read it. Every name it makes is in derivgen's
own namespace (see :mod:`derivgen.symbolic.naming`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import sympy
from sympy import Add, Mul

from derivgen.derive.first import G, ModeDerivation
from derivgen.derive.second import SecondOrder
from derivgen.spec.model import DY, N, Spec, X
from derivgen.symbolic.block import BlockMean
from derivgen.symbolic.naming import code_text, derived
from derivgen.symbolic.reduce import SELECTIONS, GroupMax, Mean, expand, means
from derivgen.symbolic.window import Window

# The forward's statistics divide by N, which the C printer writes as Dg_per: a product where
# N is a power of two, the same bits without a division's latency between a row's sweeps.
# The backward's and second order's means divide by N_DIVIDED, which prints as Sum/N: there
# no sweep waits on the quotient, and side by side Dg_per was not faster (layer norm
# 65536x128, AVX-512 build, AMD EPYC).
N_DIVIDED = sympy.Symbol("N")


@dataclass
class Loop:
    """One sweep of the forward program: accumulators summed over the group."""

    accs: list[tuple[str, sympy.Expr]]  # acc name, element expression summed over the group


@dataclass
class Select:
    """A group maximum or minimum of the forward program: ``name = max(expr)`` (``op`` "max"
    or "min") over the group's elements, as written."""

    name: str
    op: str
    expr: sympy.Expr  # element-level
    comment: str = ""


@dataclass
class Assign:
    """A per-group value of a program (group-level expression)."""

    name: str
    expr: sympy.Expr  # group-level
    comment: str = ""


@dataclass
class ModeIR:
    """One mode's forward and backward as the templates lay them out."""

    mode: str
    stats: list[str]  # the program's statistics: the spec's and the auxiliaries
    forward: list  # Loop | Assign
    levels: list[tuple[list, list]]  # the forward program as split-reduction levels (split_levels)
    buffer_updates: list[tuple[str, sympy.Expr]]
    fwd_elem: list[tuple[str, sympy.Expr]]  # (name, element expr); the last is y
    bwd_elem: list[tuple[str, sympy.Expr]]  # element temporaries for the backward (x̂, g)
    bwd_loop: list[tuple[str, sympy.Expr]]  # reduction accumulators
    bwd_group: list[Assign]  # per-group: reductions, coefficients, input grads
    dx_terms: list[tuple[str, sympy.Expr]]  # (coefficient name, element monomial)
    dx_closed: sympy.Expr  # the closed form (for comments and NumPy)
    dparams: list[tuple[str, sympy.Expr]]  # element-level parameter-gradient contributions
    dparam_groups: list[tuple[int, str]]  # (parameter slot, group variable): scalar parameters in statistics
    dparam_group_exprs: dict[str, sympy.Expr]  # the same, by parameter name, as expressions
    dinputs: list[tuple[str, str]]  # (input, group variable holding its gradient)
    element_symbols: list[str]
    stat_exprs: list[tuple[str, sympy.Expr, str]]  # (name, expression as computed, source text)
    values: list[tuple[str, sympy.Expr]] = field(default_factory=list)  # the core value h = f(x, t), first
    out_elem: list[tuple[str, sympy.Expr]] = field(default_factory=list)  # the outputs beside y
    dcore: tuple[str, sympy.Expr] | None = None  # ∂L/∂h, computed once: dx and dt read it
    dtensors: list[tuple[str, sympy.Expr]] = field(default_factory=list)  # (tensor, element gradient)


def _unique(name: str, used: set[str]) -> str:
    """``name``, with underscores appended until it is not in ``used`` (which it joins)."""
    while name in used:
        name += "_"
    used.add(name)
    return name


def needed_temps(
    exprs: Iterable[sympy.Expr], temps: list[tuple[str, sympy.Expr]]
) -> tuple[list[tuple[str, sympy.Expr]], set[str]]:
    """The element temporaries ``(name, definition)`` that ``exprs`` use, directly or
    through a later temporary, in definition order; and every symbol name used."""
    needed: list[tuple[str, sympy.Expr]] = []
    names = {str(s) for e in exprs for s in e.free_symbols}
    for nm, te in reversed(temps):
        if nm in names:
            needed.insert(0, (nm, te))
            names |= {str(s) for s in te.free_symbols}
    return needed, names


def by_monomial(
    expr: sympy.Expr,
    is_elem: Callable[[sympy.Expr], bool],
    prefix: str,
    used: set[str],
    spec: Spec,
    *,
    of: str = "",
    drop_zero: bool = True,
) -> tuple[list[Assign], list[tuple[str, sympy.Expr]]]:
    """``expr = Σ_k coefficient_k(group) · monomial_k(element)``: the coefficients as group
    assignments named ``prefix`` + the monomial (fewest flops per element), and the
    ``(coefficient name, monomial)`` terms. ``of`` ends each assignment's comment;
    ``drop_zero`` leaves out coefficients that are zero.

    A function's argument is not expanded, nor an exponential split: Derf's
    exp(-(alpha x + s)^2) stays one monomial (split, it was exp(-alpha^2 x^2) exp(-2 alpha s x)
    with exp(-s^2) in the coefficient, whose factors overflow where the product does not:
    x = 20, alpha = 1, s = -20 gave 0*inf, NaN, for a dx of 2/sqrt(pi))."""
    e = expand(expr, open_means=True)
    by_mono: dict[sympy.Expr, list] = {}
    for term in Add.make_args(e):
        c, m = [], []
        for f in Mul.make_args(term):
            (m if is_elem(f) else c).append(f)
        by_mono.setdefault(Mul(*m), []).append(Mul(*c))
    assigns, terms = [], []
    for mono in sorted(by_mono, key=sympy.default_sort_key):
        coef = sympy.factor_terms(Add(*by_mono[mono]))
        if drop_zero and coef == 0:
            continue
        nm = _unique(prefix + ("1" if mono == 1 else "_".join(_mono_name(f) for f in Mul.make_args(mono))), used)
        assigns.append(Assign(nm, coef, comment=f"coefficient of {code_text(mono, spec)}{of}"))
        terms.append((nm, mono))
    return assigns, terms


def _mono_name(f: sympy.Expr) -> str:
    """A factor of an element monomial in a coefficient's name: xhat, xhat2, or "f" for a
    factor that is not a power of a symbol (tanh(alpha*x)): names stay identifiers."""
    b, e = f.as_base_exp()
    if not b.is_Symbol or not (e == 1 or (e.is_Integer and e > 0)):
        return "f"
    return str(b) if e == 1 else f"{b}{e}"


def forward_program(first: ModeDerivation) -> list:
    """Loop/Assign steps computing the statistics as written (two passes for a variance).
    A sweep whose sums use no value assigned since an earlier sweep joins that sweep."""
    forward: list = []
    for st in first.statistics:
        if isinstance(st.expr, SELECTIONS):
            op = "max" if type(st.expr) is GroupMax else "min"
            forward.append(Select(st.name, op, st.expr.args[0], comment=f"{st.name} = {st.expr_text}"))
            continue
        atoms = means(st.expr)
        sub = {}
        if atoms:
            accs = []
            for k, a in enumerate(atoms):
                nm = f"Sum_{st.name}" if len(atoms) == 1 else f"Sum_{st.name}_{k}"
                accs.append((nm, a.args[0]))
                sub[a] = sympy.Symbol(nm) / N
            last = max((i for i, s in enumerate(forward) if isinstance(s, Loop)), default=None)
            since = {s.name for s in forward[last + 1 :]} if last is not None else set()
            uses = {str(v) for _, e in accs for v in e.free_symbols}
            if last is not None and not (uses & since):
                forward[last].accs.extend(accs)
            else:
                forward.append(Loop(accs))
        forward.append(Assign(st.name, st.expr.xreplace(sub), comment=f"{st.name} = {st.expr_text}"))
    return forward


def split_levels(forward: list) -> list[tuple[list, list]]:
    """A forward program as levels of a split reduction: (sums, assigns) pairs. A
    level's sums (accumulator name, element expression) are summed over the elements of
    each group, whatever part of a group one caller holds (a rank, a micro-batch); its
    assigns compute statistics from the totals, N (the group's size) and the
    statistics of earlier levels. Statistics that need no sums come in a level with none."""
    levels: list[tuple[list, list]] = []
    for step in forward:
        if isinstance(step, Select):
            continue  # layers with group maxima have no split reduction (codegen.emit)
        if isinstance(step, Loop):
            levels.append((list(step.accs), []))
        else:
            if not levels:
                levels.append(([], []))
            levels[-1][1].append(step)
    return levels


def build_mode_ir(first: ModeDerivation) -> ModeIR:
    """The IR of one mode's derivation (first order)."""
    spec = first.spec
    blocks = [(b.name, b.expr) for b in first.blocks]  # one value per block: element values
    element = {
        X,
        DY,
        G,
        *(p.symbol for p in spec.params if not p.scalar),
        *spec.mask_symbols,
        *spec.window_symbols,
        *(b.symbol for b in first.blocks),
        *spec.tensor_symbols,
        *spec.cotangents,
        *([spec.core.symbol] if spec.core is not None else []),
    }
    xhat = spec.normalized.symbol if spec.normalized else None
    if xhat is not None:
        element.add(xhat)
    coord = first.coordinate  # the backward's coordinate: x̂, or the centred x - μ
    if coord is not None:
        element.add(coord.symbol)

    def is_elem(e):  # a window or a block mean is an element value whatever it sums
        return (bool(e.free_symbols & element) or e.has(Window, BlockMean)) and not isinstance(e, Mean)

    buffer_updates = [(b.name, b.update) for b in spec.buffers] if first.mode == "train" else []
    windows = [(w.name, w.expr) for w in spec.windows]  # W = window(e(x), k), before what reads it
    fwd_elem = windows + blocks
    if xhat is not None:
        fwd_elem.append((spec.normalized.name, first.normalized_expr))
    fwd_elem.append(("y", spec.output))

    bwd_elem = windows + blocks
    if coord is not None:
        bwd_elem.append((coord.name, first.coordinate_expr))
    if first.g is not None:
        bwd_elem.append(("g", first.g))
    bwd_loop = [("Sum_" + r.name[len("Mean_") :], r.arg) for r in first.reductions]
    bwd_group = [
        Assign(r.name, sympy.Symbol(acc) / N_DIVIDED, comment=f"{r.name} = mean({code_text(r.arg, spec)})")
        for r, (acc, _) in zip(first.reductions, bwd_loop)
    ]
    # dx = Σ_k coefficient_k(group) · monomial_k(element); a layer with a core value computes
    # ∂L/∂h once per element instead (dx and the tensors' gradients are it times ∂h/∂v)
    dx_terms = []
    if spec.core is None:
        coefficients, dx_terms = by_monomial(first.dx_lowered, is_elem, "K_", set(), spec, of=" in dx", drop_zero=False)
        bwd_group += coefficients
    dinputs = []
    for i in spec.inputs:
        nm = derived(i.name, "Grad")
        bwd_group.append(Assign(nm, first.lowered(first.dinputs[i.name]), comment=f"dL/d{i.name} for this group"))
        dinputs.append((i.name, nm))
    dparam_groups = []
    for k, p in enumerate(spec.params):
        if first.grads[p.name].group != 0:
            nm = derived(p.name, "Grad")
            bwd_group.append(
                Assign(
                    nm,
                    first.lowered(first.grads[p.name].group),
                    comment=f"dL/d{p.name} through the statistics, this group",
                )
            )
            dparam_groups.append((k, nm))
    dparams = [(p.name, first.lowered(first.grads[p.name].element)) for p in spec.params]
    forward = forward_program(first)
    values, out_elem, dcore, dtensors = [], [], None, []
    if spec.core is not None:
        values.append((spec.core.name, spec.core.expr))
        adj = sympy.Symbol(derived(spec.core.name, "Adj"), real=True)
        dcore = (adj.name, first.lowered(first.dcore))
        dx_closed = adj * first.chain["x"]
        for t in spec.grad_tensors:
            through = adj * first.chain[t.name] if t.name in first.chain else sympy.S.Zero
            dtensors.append((t.name, through + first.lowered(first.direct[t.name])))
    else:
        dx_closed = first.dx_lowered
        dtensors = [(t.name, first.lowered(first.dtensors[t.name])) for t in spec.grad_tensors]
    out_elem = [(o.name, o.expr) for o in spec.outputs]
    return ModeIR(
        mode=first.mode,
        stats=[s.name for s in first.statistics],
        forward=forward,
        levels=split_levels(forward),
        buffer_updates=buffer_updates,
        fwd_elem=fwd_elem,
        bwd_elem=bwd_elem,
        bwd_loop=bwd_loop,
        bwd_group=bwd_group,
        dx_terms=dx_terms,
        dx_closed=dx_closed,
        dparams=dparams,
        dparam_groups=dparam_groups,
        dinputs=dinputs,
        dparam_group_exprs={
            p.name: first.lowered(first.grads[p.name].group) for p in spec.params if first.grads[p.name].group != 0
        },
        element_symbols=sorted(str(s) for s in element),
        stat_exprs=[(st.name, st.expr, st.expr_text) for st in first.statistics],
        values=values,
        out_elem=out_elem,
        dcore=dcore,
        dtensors=dtensors,
    )


# ------------------------------------------------------------------- second order


@dataclass
class SecondIR:
    """A second-order kernel (``bb``: the double backward; ``jvp``) as one reduction sweep
    and one output sweep per group, like the first-order backward."""

    kind: str
    temps: list[tuple[str, sympy.Expr]]  # element temporaries (x̂, g), in order
    loop: list[tuple[str, sympy.Expr]]  # (accumulator, element expression summed)
    means: list[Assign]  # Mean_... = Sum_.../N
    group: list[Assign]  # coefficients and per-group outputs
    outputs: list[tuple[str, list[tuple[str, sympy.Expr]], sympy.Expr]]  # (array, Σ coef·monomial, closed)
    param_elem: list[tuple[str, sympy.Expr]]  # (parameter, element contribution summed like dp)
    param_group: list[tuple[str, str]]  # (parameter, group variable): scalar parameters
    input_out: list[tuple[str, str]]  # (input, group variable)
    seed_x: str  # the seed symbol of x (X_Dd, X_T)
    seed_params: dict[str, str]  # parameter -> seed symbol
    seed_inputs: dict[str, str]
    # tensor inputs and outputs beside y (empty otherwise): the seeds of the tensors with a
    # gradient (δt, ṫ), the element outputs their gradients are among (``d<t>``, summed over
    # a broadcast tensor's axes afterwards), and a core layer's ∂L₂/∂h at fixed δh, computed
    # once per element after the means (name, expression) when dx and the tensors' gradients
    # read it: dx = it·∂h/∂x + ..., as the first-order backward shares ∂L/∂h
    seed_tensors: dict[str, str] = field(default_factory=dict)
    tensor_outputs: list[str] = field(default_factory=list)
    dcore: tuple[str, sympy.Expr] | None = None


def build_second_ir(second: SecondOrder, kind: str) -> SecondIR:
    """The IR of one second-order kernel (``kind`` "bb" or "jvp") of a mode's second order ``second``."""
    first, spec = second.first, second.spec
    element = {str(s) for s in second.element} | {"x", "dy"}

    def is_elem(f):
        return (bool({str(v) for v in f.free_symbols} & element) or f.has(Window, BlockMean)) and not isinstance(
            f, Mean
        )

    temps = [(w.name, w.expr) for w in spec.windows] + [(b.name, b.expr) for b in first.blocks]
    if spec.core is not None:  # h, then the seed the backward in h sees (δh or ḣ)
        temps.append((spec.core.name, spec.core.expr))
        seed_core, seed_expr = (
            (second.cot_core, second.cot_core_expr) if kind == "bb" else (second.tan_core, second.tan_core_expr)
        )
        if seed_core is not None:
            temps.append((seed_core.name, seed_expr))
    if first.coordinate is not None:
        temps.append((first.coordinate.name, first.coordinate_expr))
    if first.g is not None and kind == "bb":
        temps.append(("g", first.g))
    reds = second.reductions if kind == "bb" else second.jvp_reductions
    low = second.lowered if kind == "bb" else second.jvp_lowered
    loop = [("Sum_" + r.name[len("Mean_") :], r.arg) for r in reds]
    means_ = [
        Assign(r.name, sympy.Symbol(acc) / N_DIVIDED, comment=f"{r.name} = mean({code_text(r.arg, spec)})")
        for r, (acc, _) in zip(reds, loop)
    ]
    used: set[str] = set()
    group, outputs, param_elem, param_group, input_out = [], [], [], [], []
    dcore = None
    if kind == "bb":
        outs = [("dx", second.dx), ("ddy", second.ddy)]
        outs += [("dd" + o, e) for o, e in second.ddouts.items()]
        outs += [("d" + t.name, second.dtensors[t.name]) for t in spec.grad_tensors]
        if second.dcore is not None:
            adj = sympy.Symbol(derived(spec.core.name, "Adj2"), real=True)
            dcore = (adj.name, low(second.dcore))
            shared = {"dx": "x", **{"d" + t.name: t.name for t in spec.grad_tensors}}
    else:
        outs = [("ty", second.ty)] + [("t" + o, e) for o, e in second.touts.items()]
    for name, e in outs:
        assigns, terms = by_monomial(low(e), is_elem, f"K{name.upper()}_", used, spec)
        group += assigns
        closed = low(e)
        if dcore is not None and name in shared:  # ∂L₂/∂v = ∂L₂/∂h·∂h/∂v + the rest
            v = shared[name]
            closed = adj * second.chain.get(v, 0) + low(second.direct.get(v, 0)) if v in second.chain else closed
        outputs.append((name, terms, closed))
    if kind == "bb":
        for p in spec.params:
            gr = second.grads[p.name]
            param_elem.append((p.name, low(gr.element)))
            if gr.group != 0:
                nm = _unique(derived(p.name, "Grad2"), used)
                group.append(Assign(nm, low(gr.group), comment=f"d{p.name} through the statistics, this group"))
                param_group.append((p.name, nm))
        for i in spec.inputs:
            nm = _unique(derived(i.name, "Grad2"), used)
            group.append(Assign(nm, low(second.dinputs[i.name]), comment=f"d{i.name} for this group"))
            input_out.append((i.name, nm))
        seeds = (second.cot_x, second.cot_params, second.cot_inputs, second.cot_tensors)
    else:
        seeds = (second.tan_x, second.tan_params, second.tan_inputs, second.tan_tensors)
    # only the temporaries something uses
    kept, _ = needed_temps(
        [
            *(e for _, e in loop),
            *(e for _, _, e in outputs),
            *(e for _, e in param_elem),
            *([dcore[1]] if dcore is not None else []),
        ],
        temps,
    )
    return SecondIR(
        kind=kind,
        temps=kept,
        loop=loop,
        means=means_,
        group=group,
        outputs=outputs,
        param_elem=param_elem,
        param_group=param_group,
        input_out=input_out,
        seed_x=seeds[0].name,
        seed_params={k: v.name for k, v in seeds[1].items()},
        seed_inputs={k: v.name for k, v in seeds[2].items()},
        seed_tensors={k: v.name for k, v in seeds[3].items()},
        tensor_outputs=[t.name for t in spec.grad_tensors] if kind == "bb" else [],
        dcore=dcore,
    )
