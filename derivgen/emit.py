"""Emit code from derivations: one IR per mode, one Jinja template per target.

The IR is plain data the templates lay out as loops:

* forward group program: ``Loop`` (accumulate sums of element expressions over
  the group) and ``Assign`` (a per-group value from sums and earlier values),
  exactly the statistics as the spec writes them -- two passes for a variance,
  never E[x²] - E[x]²;
* forward elementwise: the normalized coordinate, then y;
* backward: element temporaries (x̂, g), the run-time reductions, per-group
  coefficients, dx as ``Σ coefficient · element monomial``, parameter-gradient
  contributions, per-group input gradients.

Expressions are printed by :mod:`derivgen.printers`; the C statements of
each sweep are planned by :mod:`derivgen.cplan`. Every name the IR makes is
in derivgen's own namespace (see :mod:`derivgen.naming`).
"""

from __future__ import annotations

import pprint
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import sympy
from sympy import Add, Mul

from .api import Derivation, derive
from .cplan import ATYPES, CTYPES, CPlanner, c_load, c_store, nhwc_sweep, second_plan, used_in
from .engine import G, ModeDerivation
from .naming import code_text, derived
from .printers import _SPEC_FOR_PRINTING, c_expr, np_expr, np_store, np_sum, torch_expr
from .reduce import Mean, means
from .spec import DY, N, X, Spec

TEMPLATE_FILES = {"numpy": "numpy.py.j2", "torch": "torch.py.j2", "c": "kernel.c.j2", "h": "kernel.h.j2", "cbind": "cbinding.py.j2",
                  "kernels": "derivgen-kernels.h.j2"}
SHARED_HEADER = "derivgen-kernels.h"     # no spec name has a hyphen: it cannot collide with a layer


def template_dir() -> Path:
    src = Path(__file__).resolve().parent.parent / "templates"
    if (src / "numpy.py.j2").is_file():
        return src
    return Path(__file__).resolve().parent / "templates"


# ------------------------------------------------------------------- IR

@dataclass
class Loop:
    accs: list[tuple[str, sympy.Expr]]      # acc name, element expression summed over the group


@dataclass
class Assign:
    name: str
    expr: sympy.Expr                         # group-level
    comment: str = ""


@dataclass
class ModeIR:
    mode: str
    stats: list[str]                         # the program's statistics: the spec's and the auxiliaries
    forward: list                            # Loop | Assign
    buffer_updates: list[tuple[str, sympy.Expr]]
    fwd_elem: list[tuple[str, sympy.Expr]]   # (name, element expr); the last is y
    bwd_elem: list[tuple[str, sympy.Expr]]   # element temporaries for the backward (x̂, g)
    bwd_loop: list[tuple[str, sympy.Expr]]   # reduction accumulators
    bwd_group: list[Assign]                  # per-group: reductions, coefficients, input grads
    dx_terms: list[tuple[str, sympy.Expr]]   # (coefficient name, element monomial)
    dx_closed: sympy.Expr                    # the closed form (for comments and NumPy)
    dparams: list[tuple[str, sympy.Expr]]    # element-level parameter-gradient contributions
    dparam_groups: list[tuple[int, str]]     # (parameter slot, group variable): scalar parameters in statistics
    dparam_group_exprs: dict[str, sympy.Expr]  # the same, by parameter name, as expressions
    dinputs: list[tuple[str, str]]           # (input, group variable holding its gradient)
    element_symbols: list[str]
    stat_exprs: list[tuple[str, sympy.Expr, str]]   # (name, expression as computed, source text)


def _unique(name: str, used: set[str]) -> str:
    while name in used:
        name += "_"
    used.add(name)
    return name


def _forward_program(md: ModeDerivation) -> list:
    """Loop/Assign steps computing the statistics as written (two passes for a variance).
    A sweep whose sums use no value assigned since an earlier sweep joins that sweep."""
    forward: list = []
    for st in md.statistics:
        atoms = means(st.expr)
        sub = {}
        if atoms:
            accs = []
            for k, a in enumerate(atoms):
                nm = f"Sum_{st.name}" if len(atoms) == 1 else f"Sum_{st.name}_{k}"
                accs.append((nm, a.args[0]))
                sub[a] = sympy.Symbol(nm) / N
            last = max((i for i, s in enumerate(forward) if isinstance(s, Loop)), default=None)
            since = {s.name for s in forward[last + 1:]} if last is not None else set()
            uses = {str(v) for _, e in accs for v in e.free_symbols}
            if last is not None and not (uses & since):
                forward[last].accs.extend(accs)
            else:
                forward.append(Loop(accs))
        forward.append(Assign(st.name, st.expr.xreplace(sub), comment=f"{st.name} = {st.expr_text}"))
    return forward


def split_levels(ir: ModeIR) -> list[tuple[list, list]]:
    """The forward program as levels of a split reduction: (sums, assigns) pairs. A
    level's sums (accumulator name, element expression) are summed over the elements of
    each group, whatever part of a group one caller holds (a rank, a micro-batch); its
    assigns compute statistics from the totals, N (the group's size) and the
    statistics of earlier levels. Statistics that need no sums come in a level with none."""
    levels: list[tuple[list, list]] = []
    for step in ir.forward:
        if isinstance(step, Loop):
            levels.append((list(step.accs), []))
        else:
            if not levels:
                levels.append(([], []))
            levels[-1][1].append(step)
    return levels


def build_mode_ir(md: ModeDerivation) -> ModeIR:
    spec = md.spec
    element = {X, DY, G, *(p.symbol for p in spec.params if not p.scalar)}
    xhat = spec.normalized.symbol if spec.normalized else None
    if xhat is not None:
        element.add(xhat)
    coord = md.coordinate                    # the backward's coordinate: x̂, or the centred x - μ
    if coord is not None:
        element.add(coord.symbol)

    def is_elem(e):
        return bool(e.free_symbols & element) and not isinstance(e, Mean)

    buffer_updates = [(b.name, b.update) for b in spec.buffers] if md.mode == "train" else []
    fwd_elem = []
    if xhat is not None:
        fwd_elem.append((spec.normalized.name, md.normalized_expr))
    fwd_elem.append(("y", spec.output))

    bwd_elem = []
    if coord is not None:
        bwd_elem.append((coord.name, md.coordinate_expr))
    if md.g is not None:
        bwd_elem.append(("g", md.g))
    bwd_loop = [("Sum_" + r.name[len("Mean_"):], r.arg) for r in md.reductions]
    bwd_group = [Assign(r.name, sympy.Symbol(acc) / N, comment=f"{r.name} = mean({code_text(r.arg, spec)})")
                 for r, (acc, _) in zip(md.reductions, bwd_loop)]
    # dx = Σ_k coefficient_k(group) · monomial_k(element)
    dx = sympy.expand(md.dx_lowered, power_base=False, log=False)
    by_mono: dict[sympy.Expr, list] = {}
    for term in Add.make_args(dx):
        c, m = [], []
        for f in Mul.make_args(term):
            (m if is_elem(f) else c).append(f)
        by_mono.setdefault(Mul(*m), []).append(Mul(*c))
    dx_terms, used = [], set()
    for mono in sorted(by_mono, key=sympy.default_sort_key):
        nm = _unique("K_" + ("1" if mono == 1 else "_".join(_mono_name(f) for f in Mul.make_args(mono))), used)
        bwd_group.append(Assign(nm, sympy.factor_terms(Add(*by_mono[mono])),
                                comment=f"coefficient of {code_text(mono, spec)} in dx"))
        dx_terms.append((nm, mono))
    dinputs = []
    for i in spec.inputs:
        nm = derived(i.name, "Grad")
        bwd_group.append(Assign(nm, md.lowered(md.dinputs[i.name]), comment=f"dL/d{i.name} for this group"))
        dinputs.append((i.name, nm))
    dparam_groups = []
    for k, p in enumerate(spec.params):
        if md.grads[p.name].group != 0:
            nm = derived(p.name, "Grad")
            bwd_group.append(Assign(nm, md.lowered(md.grads[p.name].group),
                                    comment=f"dL/d{p.name} through the statistics, this group"))
            dparam_groups.append((k, nm))
    dparams = [(p.name, md.lowered(md.grads[p.name].element)) for p in spec.params]
    return ModeIR(mode=md.mode, stats=[s.name for s in md.statistics], forward=_forward_program(md),
                  buffer_updates=buffer_updates, fwd_elem=fwd_elem, bwd_elem=bwd_elem, bwd_loop=bwd_loop,
                  bwd_group=bwd_group, dx_terms=dx_terms, dx_closed=md.dx_lowered, dparams=dparams,
                  dparam_groups=dparam_groups, dinputs=dinputs,
                  dparam_group_exprs={p.name: md.lowered(md.grads[p.name].group) for p in spec.params
                                      if md.grads[p.name].group != 0}, element_symbols=sorted(str(s) for s in element),
                  stat_exprs=[(st.name, st.expr, st.expr_text) for st in md.statistics])


def _mono_name(f: sympy.Expr) -> str:
    """A factor of an element monomial in a coefficient's name: xhat, xhat2, or "f" for a
    factor that is not a power of a symbol (tanh(alpha*x)): names stay identifiers."""
    b, e = f.as_base_exp()
    if not b.is_Symbol or not (e == 1 or (e.is_Integer and e > 0)):
        return "f"
    return str(b) if e == 1 else f"{b}{e}"


# ------------------------------------------------------------------- second order

@dataclass
class SecondIR:
    """A second-order kernel (``bb``: the double backward; ``jvp``) as one reduction sweep
    and one output sweep per group, like the first-order backward."""
    kind: str
    temps: list[tuple[str, sympy.Expr]]           # element temporaries (x̂, g), in order
    loop: list[tuple[str, sympy.Expr]]            # (accumulator, element expression summed)
    means: list[Assign]                           # Mean_... = Sum_.../N
    group: list[Assign]                           # coefficients and per-group outputs
    outputs: list[tuple[str, list[tuple[str, sympy.Expr]], sympy.Expr]]   # (array, Σ coef·monomial, closed)
    param_elem: list[tuple[str, sympy.Expr]]      # (parameter, element contribution summed like dp)
    param_group: list[tuple[str, str]]            # (parameter, group variable): scalar parameters
    input_out: list[tuple[str, str]]              # (input, group variable)
    seed_x: str                                   # the seed symbol of x (X_Dd, X_T)
    seed_params: dict[str, str]                   # parameter -> seed symbol
    seed_inputs: dict[str, str]


def _by_monomial(expr, is_elem, prefix: str, used: set, spec) -> tuple[list[Assign], list[tuple[str, sympy.Expr]]]:
    """expr = Σ_k coefficient_k(group) · monomial_k(element): the coefficients as group
    assignments (fewest flops per element)."""
    e = sympy.expand(expr, power_base=False, log=False)
    by_mono: dict[sympy.Expr, list] = {}
    for term in Add.make_args(e):
        c, m = [], []
        for f in Mul.make_args(term):
            (m if is_elem(f) else c).append(f)
        by_mono.setdefault(Mul(*m), []).append(Mul(*c))
    assigns, terms = [], []
    for mono in sorted(by_mono, key=sympy.default_sort_key):
        coef = sympy.factor_terms(Add(*by_mono[mono]))
        if coef == 0:
            continue
        nm = _unique(prefix + ("1" if mono == 1 else "_".join(_mono_name(f) for f in Mul.make_args(mono))), used)
        assigns.append(Assign(nm, coef, comment=f"coefficient of {code_text(mono, spec)}"))
        terms.append((nm, mono))
    return assigns, terms


def build_second_ir(so, kind: str) -> SecondIR:
    md, spec = so.md, so.spec
    element = {str(s) for s in so.element} | {"x", "dy"}

    def is_elem(f):
        return bool({str(v) for v in f.free_symbols} & element) and not isinstance(f, Mean)
    temps = []
    if md.coordinate is not None:
        temps.append((md.coordinate.name, md.coordinate_expr))
    if md.g is not None and kind == "bb":
        temps.append(("g", md.g))
    reds = so.reductions if kind == "bb" else so.jvp_reductions
    low = so.lowered if kind == "bb" else so.jvp_lowered
    loop = [("Sum_" + r.name[len("Mean_"):], r.arg) for r in reds]
    means_ = [Assign(r.name, sympy.Symbol(acc) / N, comment=f"{r.name} = mean({code_text(r.arg, spec)})")
              for r, (acc, _) in zip(reds, loop)]
    used: set[str] = set()
    group, outputs, param_elem, param_group, input_out = [], [], [], [], []
    if kind == "bb":
        outs = [("dx", so.dx), ("ddy", so.ddy)]
    else:
        outs = [("ty", so.ty)]
    for name, e in outs:
        assigns, terms = _by_monomial(low(e), is_elem, f"K{name.upper()}_", used, spec)
        group += assigns
        outputs.append((name, terms, low(e)))
    if kind == "bb":
        for p in spec.params:
            gr = so.grads[p.name]
            param_elem.append((p.name, low(gr.element)))
            if gr.group != 0:
                nm = _unique(derived(p.name, "Grad2"), used)
                group.append(Assign(nm, low(gr.group), comment=f"d{p.name} through the statistics, this group"))
                param_group.append((p.name, nm))
        for i in spec.inputs:
            nm = _unique(derived(i.name, "Grad2"), used)
            group.append(Assign(nm, low(so.dinputs[i.name]), comment=f"d{i.name} for this group"))
            input_out.append((i.name, nm))
        seeds = (so.cot_x, so.cot_params, so.cot_inputs)
    else:
        seeds = (so.tan_x, so.tan_params, so.tan_inputs)
    # only the temporaries something uses
    names = set()
    for e in [*(e for _, e in loop), *(e for _, _, e in outputs), *(e for _, e in param_elem)]:
        names |= {str(v) for v in e.free_symbols}
    kept = []
    for nm, te in reversed(temps):
        if nm in names:
            kept.insert(0, (nm, te))
            names |= {str(v) for v in te.free_symbols}
    return SecondIR(kind=kind, temps=kept, loop=loop, means=means_, group=group, outputs=outputs,
                    param_elem=param_elem, param_group=param_group, input_out=input_out,
                    seed_x=seeds[0].name, seed_params={k: v.name for k, v in seeds[1].items()},
                    seed_inputs={k: v.name for k, v in seeds[2].items()})


# ------------------------------------------------------------------- rendering

@dataclass
class Emitted:
    name: str
    files: dict[str, str] = field(default_factory=dict)   # relative path -> text


def _grad_fields(spec: Spec) -> list[str]:
    return ["dx", *("d" + p.name for p in spec.params), *("d" + i.name for i in spec.inputs)]


def layer_meta(d: Derivation) -> dict:
    """The calling contract, as plain data (embedded in generated files)."""
    spec = d.spec
    return {
        "name": spec.name,
        "layout": spec.layout,
        "reduce": spec.reduce,
        "params": [p.name for p in spec.params],
        "scalar_params": [p.name for p in spec.params if p.scalar],
        "axes": spec.axes,
        "param_init": {p.name: p.init for p in spec.params},
        "options": {o.name: (o.default, o.min, o.max) for o in spec.options},
        "inputs": [i.name for i in spec.inputs],
        "buffers": [b.name for b in spec.buffers],
        "buffer_init": {b.name: b.init for b in spec.buffers},
        "modes": [m.name for m in spec.modes],
        "min_group_size": {m.name: m.min_group_size for m in spec.modes},
        "stats": {m: [s.name for s in md.statistics] for m, md in d.modes.items()},
        "split": _split_meta(d),
    }


def _split_meta(d: Derivation) -> dict | None:
    """The split reduction's shape (batch layouts, training mode): sums per level of the
    forward and sums of the backward, per group."""
    spec = d.spec
    if spec.layout != "channels" or spec.reduce != "batch" or "train" not in d.modes:
        return None
    md = d.modes["train"]
    levels = []
    for step in _forward_program(md):
        if isinstance(step, Loop):
            levels.append(len(step.accs))
        elif not levels:
            levels.append(0)
    return {"levels": levels, "backward": len(md.reductions)}


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters["c"] = lambda e, ctype, names=None: c_expr(e, ctype, names)
    env.filters["pyrepr"] = repr
    env.filters["pformat"] = lambda v: pprint.pformat(v, width=96, sort_dicts=False)
    return env


def _formulas(d: Derivation) -> dict[str, list[str]]:
    """Human-readable formulas for headers, per mode."""
    spec = d.spec
    out = {}

    def T(e):
        return code_text(e, spec)
    for mname, md in d.modes.items():
        lines = ["forward:"] + [f"  {st.name} = {T(st.expr)}" + ("  (named by derivgen)" if st.aux else "")
                                for st in md.statistics]
        if spec.normalized is not None:
            lines.append(f"  {spec.normalized.name} = {T(md.normalized_expr)}")
        lines.append(f"  y = {T(spec.output)}")
        if md.coordinate is not None and md.coordinate.name != getattr(spec.normalized, "name", None):
            lines.append(f"  ({md.coordinate.name} = {T(md.coordinate_expr)}: the centred coordinate of the backward)")
        for b in (spec.buffers if mname == "train" else ()):
            lines.append(f"  {b.name} <- {T(b.update)}  (in place, not differentiated)")
        lines.append("backward (closed form, derived by derivgen):")
        if md.g is not None:
            lines.append(f"  g = {T(md.g)}")
        for r in md.reductions:
            lines.append(f"  {r.name} = mean({T(r.arg)})")
        lines.append(f"  dx = {T(md.dx_lowered)}")
        for p in spec.params:
            where = "all elements" if p.scalar else f"the axes {p.name} does not span"
            lines.append(f"  d{p.name} = sum of {T(md.lowered(md.grads[p.name].element))} over {where}")
            if md.grads[p.name].group != 0:
                lines.append(f"      + sum over groups of {T(md.lowered(md.grads[p.name].group))}")
        for i, e in md.dinputs.items():
            lines.append(f"  d{i} = {T(md.lowered(e))}  (per group; summed for a scalar input)")
        out[mname] = lines
    return out


def emit(d: Derivation, targets=("numpy", "c")) -> Emitted:
    spec = d.spec
    env = _env()
    env.filters["np"] = lambda e: np_expr(e, spec)
    env.filters["torch"] = lambda e: torch_expr(e, spec)
    env.filters["npsum"] = lambda e, axes: np_sum(e, axes, spec)
    env.filters["code"] = lambda e: code_text(e, spec)
    env.globals["mean_of"] = Mean
    env.globals["cload"] = c_load
    env.globals["cstore"] = c_store
    env.globals["nhwc"] = nhwc_sweep
    env.globals["used_in"] = used_in
    env.globals["split_levels"] = split_levels
    env.globals["second_plan"] = second_plan
    env.globals["np_store"] = lambda target, e: np_store(target, e, spec)
    _SPEC_FOR_PRINTING[0] = spec
    irs = {m: build_mode_ir(md) for m, md in d.modes.items()}
    irs2 = {m: {"bb": build_second_ir(d.second(m), "bb"), "jvp": build_second_ir(d.second(m), "jvp")}
            for m, md in d.modes.items()}
    cplans = {(m, sfx): CPlanner(spec, ir, ct) for m, ir in irs.items() for sfx, ct in CTYPES.items()}
    ctx = dict(spec=spec, meta=layer_meta(d), irs=irs, irs2=irs2, modes=list(irs), formulas=_formulas(d),
               source=spec.source, cplans=cplans, grad_fields=_grad_fields(spec), ctypes=CTYPES, atypes=ATYPES,
               per_sample=spec.reduce != "batch", trailing=spec.layout == "trailing")
    out = Emitted(spec.name)
    if "numpy" in targets:
        ctx_np = dict(ctx, template=TEMPLATE_FILES["numpy"])
        out.files[f"numpy/{spec.name}.py"] = env.get_template(TEMPLATE_FILES["numpy"]).render(**ctx_np)
    if "torch" in targets:
        ctx_t = dict(ctx, template=TEMPLATE_FILES["torch"])
        out.files[f"torch/{spec.name}.py"] = env.get_template(TEMPLATE_FILES["torch"]).render(**ctx_t)
    if "c" in targets:
        for key, path in (("h", f"c/{spec.name}.h"), ("c", f"c/{spec.name}.c"), ("cbind", f"c/{spec.name}.py"),
                          ("kernels", f"c/{SHARED_HEADER}")):
            out.files[path] = env.get_template(TEMPLATE_FILES[key]).render(**dict(ctx, template=TEMPLATE_FILES[key]))
    return out


def emit_layer(name_or_spec, targets=("numpy", "c")) -> Emitted:
    return emit(derive(name_or_spec), targets)

