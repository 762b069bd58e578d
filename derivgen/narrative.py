"""The derivation for people, built from the engine's results.

:mod:`derivgen.engine` computes (a :class:`~derivgen.engine.ModeDerivation`:
the program of statistics, the partial derivatives, the adjoints, the
closed forms); this module turns that data into the steps a careful person
writes down -- definitions, local partials, the partials of the statistics
with the terms that vanish and why, the adjoints, the closed form, the
parameter and input gradients -- for :mod:`derivgen.document` to print as
LaTeX, Markdown or text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .document import latex_expr, text_expr
from .reduce import Mean, ReductionAlgebra
from .spec import DY, X


@dataclass
class Equation:
    """One displayed equation: ``lhs = rhs`` (rhs a SymPy expression or None)."""
    lhs_latex: str
    lhs_text: str
    rhs: sympy.Expr | None = None
    note: str = ""
    note_latex: str = ""      # the note with its mathematics in LaTeX (optional)


@dataclass
class Step:
    title: str
    prose: str
    equations: list[Equation] = field(default_factory=list)


def partial_latex(num: str, den: str) -> str:
    return r"\frac{\partial %s}{\partial %s}" % (num, den)


def partial_text(num: str, den: str) -> str:
    return f"∂{num}/∂{den}"


_NEGLIGIBLE = ("exactly, so any term proportional to it — the “1/N²” term that hand derivations "
               "drop as negligible — is not small but exactly zero")


class _Names:
    """Display names of the symbols of one derivation (spec names and auxiliaries)."""

    def __init__(self, spec, statistics, coordinate=None):
        self.spec = spec
        self.named = {n.symbol.name: n for n in spec.symbols.values()}
        self.named.update({s.symbol.name: s for s in statistics})
        if coordinate is not None:
            self.named[coordinate.symbol.name] = coordinate

    def L(self, sym) -> str:
        n = self.named.get(getattr(sym, "name", None))
        return n.latex if n is not None else sympy.latex(sym)

    def T(self, sym) -> str:
        n = self.named.get(getattr(sym, "name", None))
        return n.text if n is not None else str(sym)

    def txt(self, e) -> str:
        return text_expr(e, self.spec, extra=self.named)

    def ltx(self, e) -> str:
        return latex_expr(e, self.spec, subscript=False, extra=self.named)


def _why_zero(stats, show) -> str:
    defs = [f"{s.text} = {show(s.expr)}" for s in stats]
    return " and ".join(defs) if defs else "its terms cancel"


def facts(spec, statistics, partials, sum_zero: bool, xhat_def) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(vanishing, kept): the terms that are exactly zero and the ones kept, with reasons (text)."""
    names = _Names(spec, statistics)
    vanishing, kept = [], []
    for p in partials:
        if p.kind == "zero":
            why = f"{names.txt(p.raw)} = {names.txt(p.linear)} = 0 because " + _why_zero(p.because, names.txt)
            vanishing.append((f"∂{p.stat.text}/∂{names.T(p.wrt)} through the mean {names.txt(p.atom)}", why))
        elif p.kind == "kept":
            why = f"{names.txt(p.raw)} = {names.txt(p.linear)}, which is not zero in general: kept"
            kept.append((f"∂{p.stat.text}/∂{names.T(p.wrt)} through the mean {names.txt(p.atom)}", why))
    if sum_zero:
        lin = _linear_mean(spec, xhat_def)
        vanishing.append(("Σ_j x̂_j", f"{names.txt(Mean(spec.normalized.symbol))} = {names.txt(lin)} = 0 {_NEGLIGIBLE}."))
    return vanishing, kept


def _linear_mean(spec, xhat_def):
    varying = {X, DY} | {p.symbol for p in spec.params if not p.scalar}
    return sympy.factor_terms(ReductionAlgebra(varying).canon(Mean(xhat_def)))


def build_steps(md) -> list[Step]:
    from .engine import mode_depends_on_x
    spec = md.spec
    n = _Names(spec, md.statistics, md.coordinate)
    xhat = spec.normalized.symbol if spec.normalized else None
    steps: list[Step] = []

    # ---- definitions
    defs = Step("Definitions",
                "One normalization group holds N elements x_i. Angle brackets are the mean over "
                "the group, ⟨e⟩ = (1/N) Σ_j e_j. The statistics, in order:")
    for st in md.user_statistics:
        defs.equations.append(Equation(st.latex, st.text, st.expr))
    if xhat is not None:
        defs.equations.append(Equation(spec.normalized.latex + "_i", spec.normalized.text, md.normalized_expr))
    defs.equations.append(Equation("y_i", "y", spec.output))
    steps.append(defs)
    if md.aux:
        aux = Step("Auxiliary statistics",
                   "derivgen names the group means the statistics are not linear in, and the square roots, "
                   "powers and other functions of group values inside them, so that every mean the backward "
                   "meets is known and every derivative is rational in named values. As computed:")
        for st in md.statistics:
            note = f"named by derivgen: {st.expr_text}" if st.aux else ""
            aux.equations.append(Equation(st.latex, st.text, st.expr, note=note))
        steps.append(aux)

    # ---- local partials of the output
    stat_syms = [s.symbol for s in md.statistics]
    local = Step("Local partial derivatives",
                 "y_i depends on x_i directly and on every statistic; each statistic depends "
                 "on all x_j of the group. With L the loss and ∂L/∂y_i given, the chain rule "
                 "runs through the statistics latest first:")
    through = [s for s in stat_syms if mode_depends_on_x(md, s)]
    chain_l = partial_latex("L", "x_i") + " = " + partial_latex("L", "y_i") + partial_latex("y_i", "x_i") + \
        "".join(" + " + partial_latex("L", n.L(s)) + partial_latex(n.L(s), "x_i") for s in through)
    chain_t = "∂L/∂x_i = ∂L/∂y_i·∂y_i/∂x_i" + "".join(f" + ∂L/∂{n.T(s)}·∂{n.T(s)}/∂x_i" for s in through)
    local.equations.append(Equation(chain_l, chain_t, None))
    if xhat is not None:
        local.equations.append(Equation(partial_latex("y", spec.normalized.latex),
                                        partial_text("y", spec.normalized.text), sympy.diff(spec.output, xhat)))
        local.equations.append(Equation(partial_latex(spec.normalized.latex, "x"),
                                        partial_text(spec.normalized.text, "x"), sympy.diff(md.normalized_expr, X)))
        for s in stat_syms:
            d = sympy.diff(md.normalized_expr, s)
            if d != 0:
                local.equations.append(Equation(partial_latex(spec.normalized.latex, n.L(s)),
                                                partial_text(spec.normalized.text, n.T(s)), d))
    else:
        y_full = spec.output
        local.equations.append(Equation(partial_latex("y", "x"), "∂y/∂x", sympy.diff(y_full, X)))
    steps.append(local)

    # ---- partials of the statistics
    sp = Step("Partial derivatives of the statistics",
              "Each statistic is a function of group means; a mean ⟨r⟩ contributes "
              "(1/N)·∂r/∂x_i to ∂s/∂x_i and ⟨∂r/∂s'⟩ to ∂s/∂s' for an earlier statistic s'. "
              "These last terms are where hand derivations go wrong:")
    for p in md.partials:
        st = p.stat
        if p.kind == "group":
            sp.equations.append(Equation(partial_latex(st.latex, n.L(p.wrt)), partial_text(st.text, n.T(p.wrt)),
                                         p.value))
        elif p.kind == "element":
            sub = "x_i" if p.wrt == X else n.L(p.wrt) + "_i"
            subt = "x_i" if p.wrt == X else n.T(p.wrt) + "_i"
            sp.equations.append(Equation(partial_latex(st.latex, sub), partial_text(st.text, subt), p.value))
        else:
            lhs_l = partial_latex(st.latex, n.L(p.wrt)) + r"\ \text{via}\ " + n.ltx(p.atom)
            lhs_t = partial_text(st.text, n.T(p.wrt)) + " via " + n.txt(p.atom)
            if p.kind == "zero":
                why = f"{n.txt(p.raw)} = {n.txt(p.linear)} = 0 because " + _why_zero(p.because, n.txt)
                why_l = (f"${n.ltx(p.raw)} = {n.ltx(p.linear)} = 0$ because "
                         + _why_zero(p.because, lambda e: "$" + n.ltx(e) + "$"))
                sp.equations.append(Equation(lhs_l, lhs_t, sympy.S.Zero, note=why, note_latex=why_l))
            else:
                why = f"{n.txt(p.raw)} = {n.txt(p.linear)}, which is not zero in general: kept"
                why_l = f"${n.ltx(p.raw)} = {n.ltx(p.linear)}$, which is not zero in general: kept"
                sp.equations.append(Equation(lhs_l, lhs_t, p.value, note=why, note_latex=why_l))
    steps.append(sp)

    adj = Step("Gradients with respect to the statistics",
               "Latest statistic first; each collects ∂L/∂y through y and through every later statistic:")
    for st in reversed(md.statistics):
        adj.equations.append(Equation(partial_latex("L", st.latex), partial_text("L", st.text),
                                      md.adjoints[st.symbol]))
    steps.append(adj)

    # ---- closed form
    if xhat is not None:
        xt = spec.normalized.text
        how = f"Substituting x = x({xt}) and " + (f"g = {n.txt(md.g)}, " if md.g is not None else "")
    elif md.implicit_coordinate:
        how = (f"The output normalizes x without naming it: with {md.coordinate.text} = "
               f"{n.txt(md.coordinate_expr)} (named here) y = {n.txt(md.output_in_coordinate)}. "
               f"Substituting x = x({md.coordinate.text}) and " + (f"g = {n.txt(md.g)}, " if md.g is not None else ""))
    elif md.coordinate is not None:
        how = (f"Writing x through the centred coordinate {md.coordinate.text} (polynomials in x are never "
               "expanded into raw powers of x, which would cancel catastrophically), ")
    else:
        how = ""
    closed = Step("Closed form", how + ("applying" if how else "Applying")
                  + " linearity of ⟨·⟩ and the definitions of the statistics:")
    if md.g is not None:
        closed.equations.append(Equation("g_i", "g", md.g))
    closed.equations.append(Equation(partial_latex("L", "x_i"), "∂L/∂x", md.dx))
    closed.prose += f" the backward needs {len(md.reductions)} reduction(s) per group: " + \
        ", ".join(n.txt(r.atom) for r in md.reductions) + "."
    if md.sum_xhat_zero:
        lin = _linear_mean(spec, md.normalized_expr)
        note = f"{n.txt(Mean(xhat))} = {n.txt(lin)} = 0 {_NEGLIGIBLE}."
        note_l = f"$\\langle {spec.normalized.latex} \\rangle = 0$ {_NEGLIGIBLE}."
        closed.equations.append(Equation(r"\sum_j " + spec.normalized.latex + "_j", "Σ x̂", sympy.S.Zero,
                                         note=note, note_latex=note_l))
    steps.append(closed)

    # ---- parameters, inputs, buffers
    through_stats = [p for p in spec.params if md.grads[p.name].group != 0 or
                     any(q.wrt == p.symbol for q in md.partials)]
    if spec.params:
        if through_stats:
            prose = ("Parameters that enter the statistics collect their gradient through them too: the "
                     "element-level part is summed over the axes the parameter does not span, the per-group "
                     "part (a scalar parameter inside a statistic) over the groups:")
        else:
            prose = ("Parameters do not enter the statistics, so their gradients are plain sums of "
                     "∂L/∂y·∂y/∂p over the axes the parameter does not span:")
        ps = Step("Parameter gradients", prose)
        for p in spec.params:
            gr = md.grads[p.name]
            ps.equations.append(Equation(partial_latex("L", p.latex), partial_text("L", p.text), gr.element,
                                         note="summed over all elements" if p.scalar
                                         else "summed over the non-parameter axes"))
            if gr.group != 0:
                ps.equations.append(Equation(partial_latex("L", p.latex) + r"\ \text{(statistics)}",
                                             partial_text("L", p.text) + " (statistics)", gr.group,
                                             note="per group, summed over the groups"))
        steps.append(ps)
    if spec.inputs:
        istep = Step("Gradients of the per-group inputs", "Summed over groups when the input is a single scalar:")
        for i in spec.inputs:
            istep.equations.append(Equation(partial_latex("L", i.latex), partial_text("L", i.text),
                                            md.dinputs[i.name]))
        steps.append(istep)
    if spec.buffers and md.mode == "train":
        bstep = Step("Running buffers (not differentiated)", "Updated in place in training mode:")
        for b in spec.buffers:
            bstep.equations.append(Equation(b.latex + r" \leftarrow", b.text + " ←", b.update))
        steps.append(bstep)
    return steps
