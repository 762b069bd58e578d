"""The derivation for people, built from the engine's results.

:mod:`derivgen.derive.first` computes (a :class:`~derivgen.derive.results.ModeDerivation`:
the program of statistics, the partial derivatives, the adjoints, the
closed forms); this module turns that data into the steps a careful person
writes down -- definitions, local partials, the partials of the statistics
with the terms that vanish and why, the adjoints, the closed form, the
parameter and input gradients -- for :mod:`derivgen.explain.document` to print as
LaTeX, Markdown or text.

This module builds the steps (:func:`build_steps`) up to the statistics' adjoints; the
closed form and the gradients are :mod:`~derivgen.explain.gradients`', the reasons terms
vanish :mod:`~derivgen.explain.reasons`', the records :mod:`~derivgen.explain.records`'.
"""

from __future__ import annotations

import re

import sympy

from derivgen.derive.results import G, ModeDerivation, Partial, mode_depends_on_x
from derivgen.derive.rewrite import block_facts, tidy_windows
from derivgen.explain.gradients import (
    _closed_form,
    _input_gradients,
    _parameter_gradients,
    _running_buffers,
    _tensor_gradients,
)
from derivgen.explain.reasons import _Names, _selection_zero, _why_kept_text, _why_zero, _why_zero_text, facts
from derivgen.explain.records import Equation, Step, partial_latex, partial_text
from derivgen.spec.model import DY, X
from derivgen.symbolic.block import BlockMean, block_mean, hide_blocks
from derivgen.symbolic.reduce import GroupMin

__all__ = ["Equation", "Step", "build_steps", "facts"]


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


def _tensor_note(t) -> str:
    """What a tensor input is, in words."""
    shape = "x's shape" if t.shape == "x" else f"one value per {t.shape} ({'broadcast'} over x's other axes)"
    what = "a 0/1 mask, no gradient" if t.mask else ("with a gradient" if t.grad else "no gradient")
    return f"a tensor input of {shape}, {what}"


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
