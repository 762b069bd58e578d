"""The last steps of a derivation (see :mod:`derivgen.explain.steps`): the closed form and the
coordinate it is written in, the gradients of the tensor inputs through a core value, of the
parameters and of the per-group inputs, and the running buffers' updates.
"""

from __future__ import annotations

import sympy

from derivgen.derive.results import ModeDerivation
from derivgen.explain.printers import text_expr
from derivgen.explain.reasons import _NEGLIGIBLE, _linear_mean, _Names
from derivgen.explain.records import Equation, Step, partial_latex, partial_text
from derivgen.symbolic.reduce import Mean


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
