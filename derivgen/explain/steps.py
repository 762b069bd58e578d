"""The derivation for people, built from the engine's results.

:mod:`derivgen.derive.first` computes (a :class:`~derivgen.derive.first.ModeDerivation`:
the program of statistics, the partial derivatives, the adjoints, the
closed forms); this module turns that data into the steps a careful person
writes down -- definitions, local partials, the partials of the statistics
with the terms that vanish and why, the adjoints, the closed form, the
parameter and input gradients -- for :mod:`derivgen.explain.document` to print as
LaTeX, Markdown or text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sympy

from derivgen.derive.first import G, ModeDerivation, Partial, block_facts, mode_depends_on_x, tidy_windows
from derivgen.explain.document import latex_expr, text_expr
from derivgen.spec.model import DY, Named, Spec, Statistic, X
from derivgen.symbolic.block import BlockMean, block_mean, hide_blocks
from derivgen.symbolic.reduce import GroupMin, Mean, ReductionAlgebra


@dataclass(frozen=True)
class Equation:
    """One displayed equation: ``lhs = rhs`` (rhs a SymPy expression or None)."""

    lhs_latex: str
    lhs_text: str
    rhs: sympy.Expr | None = None
    note: str = ""
    note_latex: str = ""  # the note with its mathematics in LaTeX (optional)
    rel_latex: str = "="  # the relation between the sides: "=", or "\\leftarrow" for an update
    rel_text: str = "="


@dataclass(frozen=True)
class Step:
    """One step of a derivation: a title, its prose and its equations."""

    title: str
    prose: str
    equations: tuple[Equation, ...] = ()


def partial_latex(num: str, den: str) -> str:
    """∂num/∂den in LaTeX."""
    return rf"\frac{{\partial {num}}}{{\partial {den}}}"


def partial_text(num: str, den: str) -> str:
    """∂num/∂den in text."""
    return f"∂{num}/∂{den}"


_NEGLIGIBLE = (
    "exactly, so any term proportional to it — the “1/N²” term that hand derivations "
    "drop as negligible — is not small but exactly zero"
)


class _Names:
    """Display names of the symbols of one derivation (spec names and auxiliaries)."""

    def __init__(self, spec: Spec, statistics: Iterable[Statistic], coordinate: Named | None = None):
        self.spec = spec
        self.named = {n.symbol.name: n for n in spec.symbols.values()}
        self.named.update({s.symbol.name: s for s in statistics})
        if coordinate is not None:
            self.named[coordinate.symbol.name] = coordinate

    def latex(self, sym: sympy.Basic) -> str:
        """A symbol's name in LaTeX."""
        n = self.named.get(getattr(sym, "name", None))
        return n.latex if n is not None else sympy.latex(sym)

    def text(self, sym: sympy.Basic) -> str:
        """A symbol's name in text."""
        n = self.named.get(getattr(sym, "name", None))
        return n.text if n is not None else str(sym)

    def expr_text(self, e: sympy.Expr) -> str:
        """An expression in text."""
        return text_expr(e, self.spec, extra=self.named)

    def expr_latex(self, e: sympy.Expr) -> str:
        """An expression in LaTeX (no element subscripts)."""
        return latex_expr(e, self.spec, subscript=False, extra=self.named)


def _why_zero(stats: Iterable[Statistic], show: Callable[[sympy.Expr], str]) -> str:
    """Why a term vanishes: the definitions of the statistics it uses, or that its terms cancel."""
    defs = [f"{s.text} = {show(s.expr)}" for s in stats]
    return " and ".join(defs) if defs else "its terms cancel"


def _why_zero_text(p: Partial, names: _Names) -> str:
    return f"{names.expr_text(p.raw)} = {names.expr_text(p.linear)} = 0 because " + _why_zero(
        p.because, names.expr_text
    )


def _why_kept_text(p: Partial, names: _Names) -> str:
    return f"{names.expr_text(p.raw)} = {names.expr_text(p.linear)}, which is not zero in general: kept"


def _through_mean_text(p: Partial, names: _Names) -> str:
    return f"∂{p.stat.text}/∂{names.text(p.wrt)} through the mean {names.expr_text(p.atom)}"


def _selection_zero(p: Partial, names: _Names) -> tuple[str, str]:
    """Why a group maximum (minimum) gets no gradient: ∂L/∂s is zero identically."""
    st = p.stat
    return (
        f"∂L/∂{st.text} through the group {names.expr_text(p.atom)}",
        (
            f"∂L/∂{st.text} = {'' if p.raw == 0 else names.expr_text(p.raw) + ' = '}0 for every ∂L/∂y: "
            "y does not change when "
            f"{st.text} shifts (it only keeps the arithmetic in range), so no gradient flows through "
            f"{st.text} and the backward needs no mask of the elements that attain it"
        ),
    )


def facts(mode: ModeDerivation) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(vanishing, kept): the terms of one mode's derivation that are exactly zero and the
    ones kept, with reasons (text)."""
    spec = mode.spec
    names = _Names(spec, mode.statistics)
    vanishing, kept = [], []
    for p in mode.partials:
        if p.kind == "selection" and p.value == 0:
            vanishing.append(_selection_zero(p, names))
        if p.kind == "zero":
            vanishing.append((_through_mean_text(p, names), _why_zero_text(p, names)))
        elif p.kind == "kept":
            kept.append((_through_mean_text(p, names), _why_kept_text(p, names)))
    if mode.sum_xhat_zero:
        lin = _linear_mean(spec, mode.normalized_expr)
        vanishing.append(
            (
                f"Σ_j {spec.normalized.text}_j",
                f"{names.expr_text(Mean(spec.normalized.symbol))} = {names.expr_text(lin)} = 0 {_NEGLIGIBLE}.",
            )
        )
    return vanishing, kept


def _linear_mean(spec: Spec, xhat_def: sympy.Expr) -> sympy.Expr:
    """⟨x̂⟩ by linearity of the mean, in the spec's statistics (zero for a centred x̂)."""
    varying = {X, DY} | {p.symbol for p in spec.params if not p.scalar} | spec.mask_symbols | spec.tensor_symbols
    varying |= {spec.core.symbol} if spec.core is not None else set()
    return sympy.factor_terms(ReductionAlgebra(varying).canon(Mean(xhat_def)))


# ---------------------------------------------------------------- the steps


def _definitions(mode: ModeDerivation) -> Step:
    spec = mode.spec
    eqs = [Equation(t.latex + "_i", t.text, None, note=_tensor_note(t)) for t in spec.tensors]
    if spec.core is not None:
        eqs.append(
            Equation(spec.core.latex + "_i", spec.core.text, spec.core.expr, note="the value the statistics normalize")
        )
    eqs += [Equation(st.latex, st.text, st.expr) for st in mode.user_statistics]
    eqs += [
        Equation(
            w.latex + "_i",
            w.text,
            w.expr,
            note="the sum over the elements i - ⌊k/2⌋ .. i + ⌊(k-1)/2⌋ of the group, none past its ends",
        )
        for w in spec.windows
    ]
    eqs += [
        Equation(
            "{" + b.latex + "}_i", b.text, b.expr, note="one value per " + " and per ".join(sorted(b.kinds)) + " block"
        )
        for b in mode.blocks
    ]
    if spec.normalized is not None:
        eqs.append(Equation(spec.normalized.latex + "_i", spec.normalized.text, mode.normalized_expr))
    eqs.append(Equation("y_i", "y", spec.output))
    eqs += [
        Equation(o.latex + "_i", o.text, o.expr, note=f"an output beside y; δ{o.text} is the gradient arriving at it")
        for o in spec.outputs
    ]
    blocks = (
        " A mean with a kind beside it, ⟨e⟩_instance (sample, batch), is over the block of the group "
        "that element i lies in: its (sample, channel)'s positions (its sample's channels and "
        "positions; its channel's samples and positions)."
        if mode.blocks
        else ""
    )
    return Step(
        "Definitions",
        "One normalization group holds N elements x_i. Angle brackets are the mean over "
        f"the group, ⟨e⟩ = (1/N) Σ_j e_j.{blocks} The statistics, in order:",
        tuple(eqs),
    )


def _blocks(mode: ModeDerivation, names: _Names) -> Step:
    """How the gradient reaches x through the block statistics: a block mean is its own
    transpose, so an element's adjoint comes back as the block mean of the adjoints."""
    eqs = []
    for b in mode.blocks:
        d = sympy.powsimp(sympy.diff(mode.output, b.symbol))
        if d != 0:
            eqs.append(Equation(partial_latex("y_i", "{" + b.latex + "}_i"), partial_text("y_i", b.text + "_i"), d))
    facts = block_facts(mode.blocks, mode.element, {p.symbol for p in mode.spec.params if not p.scalar})
    size = sympy.Symbol("N_b", positive=True)
    for b in mode.blocks:
        hidden, back = hide_blocks(b.expr)
        for v in sorted(hidden.free_symbols, key=sympy.default_sort_key):
            d = sympy.diff(hidden, v).xreplace(back)
            if d == 0:
                continue
            if v not in back:  # read directly: another block statistic, a group value
                eqs.append(Equation(partial_latex(b.latex, names.latex(v)), partial_text(b.text, names.text(v)), d))
                continue
            u = back[v].body
            eqs.append(
                Equation(
                    partial_latex("{" + b.latex + "}_i", "x_j"),
                    f"∂{b.text}_i/∂x_j",
                    d * sympy.diff(u, X) / size,
                    note=f"for x_j in the {back[v].kind} block of i (N_b elements), else 0",
                )
            )
            for m in mode.blocks:  # through a block statistic inside the block mean
                du = sympy.diff(u, m.symbol)
                if du == 0:
                    continue
                raw = block_mean(du, back[v].kind)
                val = facts.rewrite(raw)
                because = val == 0 and isinstance(m.expr, BlockMean)
                why = f"{names.expr_text(raw)} = {names.expr_text(val)}" + (
                    f" because {m.text} = {names.expr_text(m.expr)}" if because else ""
                )
                why_l = f"${names.expr_latex(raw)} = {names.expr_latex(val)}$" + (
                    f" because ${m.latex} = {names.expr_latex(m.expr)}$" if because else ""
                )
                eqs.append(
                    Equation(
                        partial_latex(b.latex, m.latex) + r"\ \text{via}\ " + names.expr_latex(back[v]),
                        partial_text(b.text, m.text) + " via " + names.expr_text(back[v]),
                        d * val,
                        note=why,
                        note_latex=why_l,
                    )
                )
    return Step(
        "Through the block statistics",
        "A block statistic b is one value per block; its adjoint at element i, "
        "b̄_i = ∂L/∂y_i·∂y_i/∂b_i plus what later block statistics pass on, reaches what its "
        "definition reads directly by ∂b/∂v, and what a block mean ⟨u⟩ of it reads by the same "
        "block mean of the adjoint: ∂L/∂x_j gets ⟨b̄·∂b/∂⟨u⟩⟩_j·∂u_j/∂x_j (a block mean is its own "
        "transpose: Σ_i a_i⟨u⟩_i = Σ_j ⟨a⟩_j u_j). These block means are rewritten exactly as the "
        "group means are: per-block factors come out, and ⟨x - m⟩ = 0 for m = ⟨x⟩, so a "
        "variance's adjoint does not reach its own mean. The partial derivatives, then the "
        "closed form below:",
        tuple(eqs),
    )


def _auxiliaries(mode: ModeDerivation) -> Step:
    eqs = [
        Equation(st.latex, st.text, st.expr, note=f"named by derivgen: {_articles(st.expr_text)}" if st.aux else "")
        for st in mode.statistics
    ]
    return Step(
        "Auxiliary statistics",
        "derivgen names the group means the statistics are not linear in, and the square roots, "
        "powers and other functions of group values inside them, so that every mean the backward "
        "meets is known and every derivative is rational in named values. As computed:",
        tuple(eqs),
    )


def _articles(text: str) -> str:
    """``text`` with "a" before a vowel as "an" ("an absolute value")."""
    return re.sub(r"\b([Aa]) (?=[aeiou])", r"\1n ", text)


def _chain_rule(mode: ModeDerivation, names: _Names) -> Equation:
    """∂L/∂x_i through y and every statistic that depends on x."""
    through = [s.symbol for s in mode.statistics if mode_depends_on_x(mode, s.symbol)]
    chain_l = (
        partial_latex("L", "x_i")
        + " = "
        + partial_latex("L", "y_i")
        + partial_latex("y_i", "x_i")
        + "".join(" + " + partial_latex("L", names.latex(s)) + partial_latex(names.latex(s), "x_i") for s in through)
    )
    chain_t = "∂L/∂x_i = ∂L/∂y_i·∂y_i/∂x_i" + "".join(f" + ∂L/∂{names.text(s)}·∂{names.text(s)}/∂x_i" for s in through)
    return Equation(chain_l, chain_t, None)


def _local_partials(mode: ModeDerivation, names: _Names) -> Step:
    spec = mode.spec
    eqs = [_chain_rule(mode, names)]
    if spec.normalized is not None:
        xhat = spec.normalized
        eqs.append(
            Equation(partial_latex("y", xhat.latex), partial_text("y", xhat.text), sympy.diff(spec.output, xhat.symbol))
        )
        eqs.append(
            Equation(partial_latex(xhat.latex, "x"), partial_text(xhat.text, "x"), sympy.diff(mode.normalized_expr, X))
        )
        for st in mode.statistics:
            d = sympy.diff(mode.normalized_expr, st.symbol)
            if d != 0:
                eqs.append(
                    Equation(
                        partial_latex(xhat.latex, names.latex(st.symbol)),
                        partial_text(xhat.text, names.text(st.symbol)),
                        d,
                    )
                )
    else:
        eqs.append(Equation(partial_latex("y", "x"), "∂y/∂x", sympy.diff(spec.output, X)))
    return Step(
        "Local partial derivatives",
        "y_i depends on x_i directly and on every statistic; each statistic depends "
        "on all x_j of the group. With L the loss and ∂L/∂y_i given, the chain rule "
        "runs through the statistics latest first:",
        tuple(eqs),
    )


def _windows(mode: ModeDerivation) -> Step:
    """How the gradient reaches x through a window: each x_j is in the windows of its
    neighbours, so their adjoints come back summed over the mirrored window."""
    spec = mode.spec
    eqs = []
    for w in spec.windows:
        dy_dw = sympy.powsimp(sympy.diff(mode.output, w.symbol))
        eqs.append(Equation(partial_latex("y", w.latex), partial_text("y", w.text), dy_dw))
        eqs.append(
            Equation(
                partial_latex(w.latex + "_i", "x_j"),
                f"∂{w.text}_i/∂x_j",
                sympy.diff(w.body, X).xreplace({X: sympy.Symbol("x_j", real=True)}),
                note="for every j in the window of i, else 0",
            )
        )
        eqs.append(
            Equation(
                partial_latex("L", "x") + r"\big|_{" + w.latex + "}",
                f"∂L/∂x (through {w.text})",
                tidy_windows(sympy.diff(w.body, X) * w.expr.transpose(DY * dy_dw), mode.element),
            )
        )
    return Step(
        "Through the window",
        "A window's value at i sums over its neighbours, so x_j reaches the windows of every i "
        "whose window holds j: the elements j - ⌊(k-1)/2⌋ .. j + ⌊k/2⌋. ∂L/∂x_j collects "
        "∂L/∂y_i·∂y_i/∂W_i over them -- the transposed window windowᵀ, the window mirrored "
        "(the same for an odd k) -- times ∂W/∂x at j:",
        tuple(eqs),
    )


def _partial_equation(p: Partial, names: _Names) -> Equation:
    """One partial derivative of a statistic; through a mean, with why it vanishes or is kept."""
    st = p.stat
    if p.kind == "group":
        return Equation(partial_latex(st.latex, names.latex(p.wrt)), partial_text(st.text, names.text(p.wrt)), p.value)
    if p.kind == "element":
        sub = "x_i" if p.wrt == X else names.latex(p.wrt) + "_i"
        subt = "x_i" if p.wrt == X else names.text(p.wrt) + "_i"
        return Equation(partial_latex(st.latex, sub), partial_text(st.text, subt), p.value)
    if p.kind == "selection":
        sub = "x_i" if p.wrt == X else names.latex(p.wrt) + "_i"
        subt = "x_i" if p.wrt == X else names.text(p.wrt) + "_i"
        if p.value == 0:
            why = _selection_zero(p, names)[1]
            return Equation(partial_latex("L", st.latex), partial_text("L", st.text), sympy.S.Zero, note=why)
        note = (
            f"{st.text} = {names.expr_text(p.atom)} passes its gradient to the elements that attain it, "
            f"split evenly among ties (as torch.{'amin' if isinstance(p.atom, GroupMin) else 'amax'})"
        )
        return Equation(partial_latex(st.latex, sub), partial_text(st.text, subt), p.value, note=note)
    lhs_l = partial_latex(st.latex, names.latex(p.wrt)) + r"\ \text{via}\ " + names.expr_latex(p.atom)
    lhs_t = partial_text(st.text, names.text(p.wrt)) + " via " + names.expr_text(p.atom)
    if p.kind == "zero":
        why_l = f"${names.expr_latex(p.raw)} = {names.expr_latex(p.linear)} = 0$ because " + _why_zero(
            p.because, lambda e: "$" + names.expr_latex(e) + "$"
        )
        return Equation(lhs_l, lhs_t, sympy.S.Zero, note=_why_zero_text(p, names), note_latex=why_l)
    why_l = f"${names.expr_latex(p.raw)} = {names.expr_latex(p.linear)}$, which is not zero in general: kept"
    return Equation(lhs_l, lhs_t, p.value, note=_why_kept_text(p, names), note_latex=why_l)


def _statistic_partials(mode: ModeDerivation, names: _Names) -> Step:
    if not mode.partials:  # no statistic depends on x (an eval mode's come from buffers)
        return Step("Partial derivatives of the statistics", "No statistic depends on x: there are none.")
    return Step(
        "Partial derivatives of the statistics",
        "Each statistic is a function of group means; a mean ⟨r⟩ contributes "
        "(1/N)·∂r/∂x_i to ∂s/∂x_i and ⟨∂r/∂s'⟩ to ∂s/∂s' for an earlier statistic s'. "
        "These last terms are where hand derivations go wrong:",
        tuple(_partial_equation(p, names) for p in mode.partials),
    )


def _statistic_adjoints(mode: ModeDerivation) -> Step:
    prose = "Latest statistic first; each collects ∂L/∂y through y and through every later statistic"
    eqs = [
        Equation(partial_latex("L", st.latex), partial_text("L", st.text), mode.adjoints[st.symbol])
        for st in reversed(mode.statistics)
    ]
    if mode.g is not None and any(e.rhs.has(G) for e in eqs):  # g is defined where it is first used
        prose += ", written in g, the part of ∂L/∂y·∂y/∂x that varies within the group"
        eqs.insert(0, Equation("g_i", "g", mode.g))
    return Step("Gradients with respect to the statistics", prose + ":", tuple(eqs))


def _closed_form_how(mode: ModeDerivation, names: _Names) -> str:
    """How the closed form is reached: through which coordinate."""
    spec = mode.spec
    with_g = f"g = {names.expr_text(mode.g)}, " if mode.g is not None else ""
    if spec.normalized is not None:
        return f"Substituting x = x({spec.normalized.text}) and " + with_g
    if mode.implicit_coordinate:
        return (
            f"The output normalizes x without naming it: with {mode.coordinate.text} = "
            f"{names.expr_text(mode.coordinate_expr)} (named here) y = "
            f"{names.expr_text(mode.output_in_coordinate)}. "
            f"Substituting x = x({mode.coordinate.text}) and " + with_g
        )
    if mode.coordinate is not None:
        return (
            f"Writing x through the centred coordinate {mode.coordinate.text} (polynomials in x are never "
            "expanded into raw powers of x, which would cancel catastrophically), "
        )
    return ""


def _closed_form(mode: ModeDerivation, names: _Names) -> Step:
    spec = mode.spec
    how = _closed_form_how(mode, names)
    prose = how + ("applying" if how else "Applying") + " linearity of ⟨·⟩ and the definitions of the statistics:"
    n = len(mode.reductions)
    parts = []
    if n:
        parts.append(
            f"{n} reduction{'s' if n > 1 else ''} per group: "
            + ", ".join(names.expr_text(r.atom) for r in mode.reductions)
        )
    by_kind: dict[str, list] = {}
    for b in mode.block_reductions:
        by_kind.setdefault(b.kind, []).append(b)
    for kind, bs in by_kind.items():
        parts.append(
            f"{len(bs)} {kind} mean{'s' if len(bs) > 1 else ''} (one value per {kind} block): "
            + ", ".join(names.expr_text(b) for b in bs)
        )
    if not parts:
        prose += " the backward needs no reduction over the group."
    else:
        prose += " the backward needs " + ("no reduction over the group but " if not n else "") + "; ".join(parts) + "."
    eqs = []
    if mode.g is not None:
        eqs.append(Equation("g_i", "g", mode.g))
    if mode.dcore is not None:
        core = spec.core
        eqs.append(Equation(partial_latex("L", core.latex + "_i"), partial_text("L", core.text), mode.dcore))
    else:
        eqs.append(Equation(partial_latex("L", "x_i"), "∂L/∂x", mode.dx))
    if mode.sum_xhat_zero:
        xhat = spec.normalized
        lin = _linear_mean(spec, mode.normalized_expr)
        note = f"{names.expr_text(Mean(xhat.symbol))} = {names.expr_text(lin)} = 0 {_NEGLIGIBLE}."
        note_l = f"$\\langle {xhat.latex} \\rangle = 0$ {_NEGLIGIBLE}."
        eqs.append(
            Equation(r"\sum_j " + xhat.latex + "_j", "Σ " + xhat.text, sympy.S.Zero, note=note, note_latex=note_l)
        )
    return Step("Closed form", prose, tuple(eqs))


def _parameter_gradients(mode: ModeDerivation) -> Step:
    spec = mode.spec
    through_stats = [
        p for p in spec.params if mode.grads[p.name].group != 0 or any(q.wrt == p.symbol for q in mode.partials)
    ]
    if through_stats:
        prose = (
            "Parameters that enter the statistics collect their gradient through them too: the "
            "element-level part is summed over the axes the parameter does not span, the per-group "
            "part (a scalar parameter inside a statistic) over the groups:"
        )
    else:
        prose = (
            "Parameters do not enter the statistics, so their gradients are plain sums of "
            "∂L/∂y·∂y/∂p over the axes the parameter does not span:"
        )
    eqs = []
    for p in spec.params:
        gr = mode.grads[p.name]
        if gr.element != 0 or gr.group == 0:  # no zero printed beside a nonzero part
            eqs.append(
                Equation(
                    partial_latex("L", p.latex),
                    partial_text("L", p.text),
                    gr.element,
                    note="summed over all elements" if p.scalar else "summed over the non-parameter axes",
                )
            )
        if gr.group != 0:
            eqs.append(
                Equation(
                    partial_latex("L", p.latex) + r"\ \text{(statistics)}",
                    partial_text("L", p.text) + " (statistics)",
                    gr.group,
                    note="per group, summed over the groups",
                )
            )
    return Step("Parameter gradients", prose, tuple(eqs))


def _input_gradients(mode: ModeDerivation) -> Step:
    return Step(
        "Gradients of the per-group inputs",
        "Summed over groups when the input is a single scalar:",
        tuple(
            Equation(partial_latex("L", i.latex), partial_text("L", i.text), mode.dinputs[i.name])
            for i in mode.spec.inputs
        ),
    )


def _tensor_note(t) -> str:
    """What a tensor input is, in words."""
    shape = "x's shape" if t.shape == "x" else f"one value per {t.shape} ({'broadcast'} over x's other axes)"
    what = "a 0/1 mask, no gradient" if t.mask else ("with a gradient" if t.grad else "no gradient")
    return f"a tensor input of {shape}, {what}"


def _tensor_gradients(mode: ModeDerivation) -> Step:
    """The chain rule through the core value, and the gradients of the tensor inputs."""
    spec = mode.spec
    eqs = []
    prose = ""
    if spec.core is not None:
        core = spec.core
        dh = partial_text("L", core.text)
        ones = [k for k, d in mode.chain.items() if d == 1]
        prose = (
            f"The statistics read x only through {core.text} = {text_expr(core.expr, spec)}, so every gradient "
            f"through them is {dh}·∂{core.text}/∂v, with the closed form {dh} above computed once"
        )
        shown = {t.name: t for t in spec.tensors}
        for k, d in mode.chain.items():
            t = shown.get(k)
            eqs.append(
                Equation(partial_latex(core.latex, t.latex if t else k), f"∂{core.text}/∂{t.text if t else k}", d)
            )
        if len(ones) > 1:
            prose += (
                f"; ∂{core.text}/∂v = 1 for "
                + " and ".join(shown[k].text if k in shown else k for k in ones)
                + f": their gradients are the same values, {dh} itself, "
                "shared rather than recomputed"
            )
        prose += ":"
        eqs.append(Equation(partial_latex("L", "x_i"), "∂L/∂x", mode.dx))
    else:
        prose = "Each tensor input's gradient at its element:"
    for t in spec.grad_tensors:
        note = "" if t.shape == "x" else f"summed over the axes {t.name} is broadcast over"
        eqs.append(
            Equation(partial_latex("L", t.latex + "_i"), partial_text("L", t.text), mode.dtensors[t.name], note=note)
        )
    return Step("Gradients of x and the tensor inputs", prose, tuple(eqs))


def _running_buffers(mode: ModeDerivation) -> Step:
    return Step(
        "Running buffers (not differentiated)",
        "Updated in place in training mode:",
        tuple(Equation(b.latex, b.text, b.update, rel_latex=r"\leftarrow", rel_text="←") for b in mode.spec.buffers),
    )


def build_steps(mode: ModeDerivation) -> tuple[Step, ...]:
    """The derivation of one mode as the steps a careful person writes down: definitions,
    auxiliaries, local partials, the partials of the statistics (with the terms that vanish
    and why), the adjoints, the closed form, the parameter and input gradients, the buffers."""
    spec = mode.spec
    names = _Names(spec, mode.statistics, mode.coordinate)
    steps = [_definitions(mode)]
    if mode.aux:
        steps.append(_auxiliaries(mode))
    steps.append(_local_partials(mode, names))
    if spec.windows:
        steps.append(_windows(mode))
    if mode.blocks:
        steps.append(_blocks(mode, names))
    steps += [
        _statistic_partials(mode, names),
        _statistic_adjoints(mode),
        _closed_form(mode, names),
    ]
    if spec.core is not None or spec.grad_tensors:
        steps.append(_tensor_gradients(mode))
    if spec.params:
        steps.append(_parameter_gradients(mode))
    if spec.inputs:
        steps.append(_input_gradients(mode))
    if spec.buffers and mode.mode == "train":
        steps.append(_running_buffers(mode))
    return tuple(steps)
