"""The "Second order" section of a derivation document (``derivgen derive --order 2``): how the
double backward and the JVP are derived, with their seeds and reductions, their closed forms
and their proofs, in LaTeX, Markdown or text (:func:`render_second`).
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy

from derivgen.derive.results import SecondOrder
from derivgen.explain.printers import ShownAs, _mode_title, latex_expr, mode_names, text_expr
from derivgen.explain.records import ModeDocument
from derivgen.explain.tex import _tex_escape
from derivgen.prove.proof import ModeProof
from derivgen.spec.model import Named, Spec
from derivgen.symbolic.reduce import Mean


def _backward_program(second: SecondOrder) -> str:
    """What the backward's own program holds, as the prose names it: " (statistics, x̂, g, its
    reductions)", each part only where the mode has it; empty when it has none."""
    first = second.first
    parts = [
        *(["statistics"] if first.statistics else []),
        *([first.coordinate.text] if first.coordinate is not None else []),
        *(["g"] if first.g is not None else []),
        *(["its reductions"] if first.reductions else []),
    ]
    return f" ({', '.join(parts)})" if parts else ""


def _second_prose(second: SecondOrder, extra: Mapping[str, Named] | None = None) -> str:
    """How the double backward and the JVP are derived, with their seeds and reductions
    (listed, as the first order's closed form lists its own)."""
    spec = second.spec
    cots = ", ".join(
        [
            second.cot_x.text,
            *(second.cot_tensors[t.name].text for t in spec.grad_tensors),
            *(second.cot_params[p.name].text for p in spec.params),
            *(second.cot_inputs[i.name].text for i in spec.inputs),
        ]
    )
    tans = ", ".join(
        [
            second.tan_x.text,
            *(second.tan_tensors[t.name].text for t in spec.grad_tensors),
            *(second.tan_params[p.name].text for p in spec.params),
            *(second.tan_inputs[i.name].text for i in spec.inputs),
        ]
    )

    def means(reductions: tuple) -> str:
        return ", ".join(text_expr(Mean(r.arg), spec, extra=extra) for r in reductions)

    if second.reductions:
        double = (
            f"to means of element monomials, {_count(len(second.reductions), 'reduction')} per group "
            f"({means(second.reductions)}): one sweep for them and one for the outputs"
        )
    else:
        double = "to no reduction over the group: one sweep for the outputs"
    jvp = (
        f"{_count(len(second.jvp_reductions), 'reduction')} per group ({means(second.jvp_reductions)})"
        if second.jvp_reductions
        else "no reduction over the group"
    )
    dirac = (
        " Terms from |u| (a DiracDelta, the derivative of sign(u)) are dropped: zero wherever the first "
        "derivative exists."
        if _has_abs(second)
        else ""
    )
    core = ""
    if second.cot_core is not None:  # the backward in the core value sees one seed of each kind
        h = spec.core.text
        core = (
            f" Both see {h} = {text_expr(spec.core.expr, spec, extra=extra)} through one seed per element: "
            f"{second.cot_core.text} = {text_expr(second.cot_core_expr, spec, extra=extra)} and "
            f"{second.tan_core.text} = {text_expr(second.tan_core_expr, spec, extra=extra)}; the gradients of x and "
            f"the tensors {h} is made of are ∂L₂/∂{h}, computed once, times ∂{h}/∂v"
            + (", plus what they read directly." if any(v != 0 for v in second.direct.values()) else ".")
        )
    outs = ""
    if spec.outputs:
        names = ", ".join(f"∂L/∂{o.text}" for o in spec.outputs)
        outs = (
            f" The backward's inputs include the gradients {names} arriving at the outputs beside y (δ"
            f"{spec.outputs[0].text} in the first order; δ is the seeds' here), so the double backward also "
            "gives L₂'s gradient with respect to each."
        )
    return (
        f"The double backward is the vector-Jacobian product of the backward above: with the cotangents "
        f"{cots} of the backward's outputs it differentiates L₂ = Σ δx·∂L/∂x + Σ δp·∂L/∂p + ... once more, "
        f"by reverse mode through the backward's own program{_backward_program(second)}, and the "
        f"nested means collapse by linearity and the known statistics {double}. "
        f"The JVP is forward mode through the forward program with the tangents {tans}: {jvp}."
        + outs
        + core
        + dirac
        + "".join(" " + note for note in spec.second_order_notes)
    )


def _has_abs(second: SecondOrder) -> bool:
    """Whether the layer's expressions take an absolute value (or a sign), whose second
    derivative is a DiracDelta that the second order drops."""
    spec, first = second.spec, second.first
    exprs = [spec.output, spec.normalized_expr, *(st.expr for st in first.statistics)]
    for group in (spec.values, spec.outputs, spec.windows):
        exprs += [getattr(item, "expr", None) for item in group]
    mode = spec.mode(first.mode)
    exprs += [st.expr for st in (*mode.statistics, *mode.blocks)]
    return any(isinstance(e, sympy.Basic) and e.has(sympy.Abs, sympy.sign) for e in exprs)


def _count(n: int, noun: str) -> str:
    """``n`` ``noun``s, singular for one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _second_equations(second: SecondOrder) -> list[tuple[str, str, object]]:
    """[(lhs latex, lhs text, rhs)]: the double backward's outputs and ẏ (the reductions
    they read are listed in the prose, as the means the equations spell out)."""
    spec = second.spec
    eqs = []
    eqs.append((r"\frac{\partial L_2}{\partial x}", "∂L₂/∂x", second.dx))
    eqs.append((r"\frac{\partial L_2}{\partial (\partial L/\partial y)}", "∂L₂/∂(∂L/∂y)", second.ddy))
    for o in spec.outputs:
        eqs.append(
            (
                rf"\frac{{\partial L_2}}{{\partial (\partial L/\partial \mathrm{{{o.name}}})}}",
                f"∂L₂/∂(∂L/∂{o.name})",
                second.ddouts[o.name],
            )
        )
    for t in spec.grad_tensors:
        eqs.append((rf"\frac{{\partial L_2}}{{\partial {t.latex}}}", f"∂L₂/∂{t.text}", second.dtensors[t.name]))
    for p in spec.params:
        gr = second.grads[p.name]
        e = gr.element if gr.group == 0 else gr.element + gr.group
        eqs.append((rf"\frac{{\partial L_2}}{{\partial {p.latex}}}", f"∂L₂/∂{p.text}", e))
    for i in spec.inputs:
        eqs.append((rf"\frac{{\partial L_2}}{{\partial {i.latex}}}", f"∂L₂/∂{i.text}", second.dinputs[i.name]))
    eqs.append((r"\dot{y}", "ẏ", second.ty))
    for o in spec.outputs:  # (an output that is the core value: its tangent is ḣ, given in the prose)
        if second.tan_core is None or second.touts[o.name] != second.tan_core.symbol:
            eqs.append((rf"\dot{{\mathrm{{{o.name}}}}}", f"{o.name}̇", second.touts[o.name]))
    return eqs


def _second_proof_lines(proof: ModeProof | None) -> list[str]:
    if proof is None:
        return ["not checked (run with proofs enabled)"]
    return [f"N = {r.n}: {r.status} ({r.method}, {r.seconds:.2f} s)" for r in proof.results]


def render_second(spec: Spec, modes: list[ModeDocument], fmt: str) -> str:
    """The "Second order" section of a derivation document (``derivgen derive --order 2``),
    from each mode's second order and its proof (None: not checked)."""
    out = []
    for doc in modes:
        mode, second = doc.derivation, doc.second
        # δ is the second order's seeds here: the gradient arriving at an output beside y (δh
        # above) is written ∂L/∂h
        arriving = {
            o.cotangent.name: ShownAs(
                o.cotangent.name, o.cotangent, rf"\frac{{\partial L}}{{\partial {o.latex}}}", f"∂L/∂{o.text}"
            )
            for o in spec.outputs
        }
        extra = {**mode_names(mode), **arriving, **second.names}
        prose, eqs, lines = (
            _second_prose(second, extra),
            _second_equations(second),
            _second_proof_lines(doc.second_proof),
        )
        mt = _mode_title(mode, len(modes))
        title = "Second order" + (f" ({mt.lower()})" if mt else "")
        if fmt == "latex":
            out += [
                rf"\section*{{{title}}}",
                _tex_escape(prose),
                r"\begin{align*}",
                " \\\\\n".join(f"{lhs} &= {latex_expr(e, spec, extra=extra)}" for lhs, _, e in eqs),
                r"\end{align*}",
                (
                    r"\paragraph{Proof against brute force.} Second derivatives of the "
                    r"explicit layer at small N (sympy.diff twice) against the closed forms:"
                ),
                r"\begin{itemize}",
                *(r"\item " + _tex_escape(x) for x in lines),
                r"\end{itemize}",
                "",
            ]
        elif fmt == "markdown":
            out += [f"## {title}", "", prose, ""]
            out += [f"$$ {lhs} = {latex_expr(e, spec, extra=extra)} $$\n" for lhs, _, e in eqs]
            out += ["Proof against brute force (second derivatives of the explicit layer):", ""]
            out += [f"- {x}" for x in lines] + [""]
        else:
            out += ["", title, "-" * len(title), prose]
            out += [f"  {t} = {text_expr(e, spec, extra=extra)}" for _, t, e in eqs]
            out += ["", "  Proof against brute force (second derivatives):"] + [f"    {x}" for x in lines]
    return "\n".join(out) + "\n"
