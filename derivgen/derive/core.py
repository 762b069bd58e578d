"""A layer whose statistics read a value h = f(x, t, ...) (its core, the spec's ``core``),
derived to first order: the layer seen from h (:func:`core_spec`: h in place of x), derived
there, written back in h, and the chain rule through h (``dcore`` = ∂L/∂h, ``chain`` = ∂h/∂v).
The second order does the same in :mod:`derivgen.derive.second`.
"""

from __future__ import annotations

import dataclasses

import sympy
from sympy import Mul

from derivgen.derive.closed_forms import Deriver
from derivgen.derive.results import DerivationError, ModeDerivation, ParamGrad, check_derivatives, name_reductions
from derivgen.spec.model import Spec, Statistic, X


def core_spec(spec: Spec) -> Spec:
    """The layer seen from its core value h (the one its statistics read): h in place of x in
    the statistics, the normalized coordinate and the outputs, and no values. Its derivation's
    ∂L/∂x is ∂L/∂h; the tensors h is computed from appear nowhere in it (the parser saw to that)."""
    u = {spec.core.symbol: X}

    def sub(st: Statistic) -> Statistic:
        return dataclasses.replace(st, expr=st.expr.xreplace(u))

    modes = tuple(
        dataclasses.replace(m, statistics=tuple(sub(s) for s in m.statistics), blocks=tuple(sub(b) for b in m.blocks))
        for m in spec.modes
    )
    used = {s for m in modes for st in m.statistics for s in st.expr.free_symbols}
    for e in [spec.output, *(o.expr for o in spec.outputs)]:
        used |= e.xreplace(u).free_symbols
    return dataclasses.replace(
        spec,
        modes=modes,
        normalized_expr=spec.normalized_expr.xreplace(u) if spec.normalized_expr is not None else None,
        output=spec.output.xreplace(u),
        outputs=tuple(dataclasses.replace(o, expr=o.expr.xreplace(u)) for o in spec.outputs),
        buffers=tuple(dataclasses.replace(b, update=b.update.xreplace(u)) for b in spec.buffers),
        values=(),
        core=None,
        tensors=tuple(t for t in spec.tensors if t.symbol in used),
    )


def _through_core(spec: Spec, mode_name: str | None) -> ModeDerivation:
    """The derivation of a layer whose statistics read a value h = f(x, t, ...): the layer's
    derivation in h (:func:`core_spec`), written back in h, then the chain rule through h:
    ∂L/∂x = ∂L/∂h·∂f/∂x and ∂L/∂t = ∂L/∂h·∂f/∂t (+ the paths from the outputs that read t),
    one closed form ∂L/∂h that every input's gradient shares."""
    cs = core_spec(spec)
    inner = Deriver(cs, cs.mode(mode_name)).run()
    h = spec.core.symbol
    back = {X: h}

    def w(e):
        return e.xreplace(back) if isinstance(e, sympy.Basic) else e

    f = spec.core.expr
    dcore = w(inner.dx)
    chain = {"x": sympy.diff(f, X)}
    chain.update({t.name: sympy.diff(f, t.symbol) for t in spec.grad_tensors if f.has(t.symbol)})
    for d in chain.values():
        check_derivatives(spec, f"values.{spec.core.name}.expr", d)
    direct = {t.name: w(inner.dtensors.get(t.name, sympy.S.Zero)) for t in spec.grad_tensors}
    dtensors = dict(direct)
    for t in spec.grad_tensors:
        if t.name in chain:
            through = dcore if chain[t.name] == 1 else Mul(dcore, chain[t.name], evaluate=False)
            dtensors[t.name] = through + direct[t.name]
    grads = {k: ParamGrad(w(v.element), w(v.group)) for k, v in inner.grads.items()}
    for p in spec.params:  # a parameter inside h: its element gradient through h (∂f/∂p in x itself)
        d = sympy.diff(f, p.symbol)
        if d != 0:
            if p.scalar:
                raise DerivationError(
                    f"{spec.source}: values.{spec.core.name}.expr: a scalar parameter in the core value is not supported yet"
                )
            grads[p.name] = ParamGrad(grads[p.name].element + dcore * d if p.name in grads else dcore * d)
    dinputs = {k: w(v) for k, v in inner.dinputs.items()}
    for i in spec.inputs:  # a per-group input inside h: Σ over the group of ∂L/∂h·∂f/∂i
        d = sympy.diff(f, i.symbol)
        if d != 0:
            raise DerivationError(
                f"{spec.source}: values.{spec.core.name}.expr: a per-group input in the core value is not supported yet"
            )
    dx = dcore if chain["x"] == 1 else Mul(dcore, chain["x"], evaluate=False)
    return dataclasses.replace(
        inner,
        spec=spec,
        user_statistics=tuple(dataclasses.replace(s, expr=w(s.expr)) for s in inner.user_statistics),
        statistics=tuple(dataclasses.replace(s, expr=w(s.expr)) for s in inner.statistics),
        normalized_expr=w(inner.normalized_expr),
        output=spec.output,
        g=w(inner.g),
        dx=dx,
        grads=grads,
        dinputs=dinputs,
        reductions=name_reductions(
            spec,
            inner.coordinate,
            [
                dcore,
                *dinputs.values(),
                *dtensors.values(),
                *(g.element for g in grads.values()),
                *(g.group for g in grads.values()),
            ],
        ),
        partials=tuple(
            dataclasses.replace(
                pt, value=w(pt.value), atom=w(pt.atom), raw=w(pt.raw), linear=w(pt.linear), wrt=w(pt.wrt)
            )
            for pt in inner.partials
        ),
        adjoints={w(k): w(v) for k, v in inner.adjoints.items()},
        coordinate_expr=w(inner.coordinate_expr),
        output_in_coordinate=w(inner.output_in_coordinate),
        x_in_coordinate=w(inner.x_in_coordinate),
        element=frozenset(inner.element - {X}) | {h, X} | spec.tensor_symbols,
        mean_facts=None,
        blocks=tuple(dataclasses.replace(b, expr=w(b.expr)) for b in inner.blocks),
        dtensors=dtensors,
        dcore=dcore,
        chain=chain,
        direct=direct,
    )
