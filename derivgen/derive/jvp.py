"""The JVP (see :mod:`derivgen.derive.second`): forward mode through the forward program --
the statistics, the block statistics, x̂ and the outputs -- from the tangents of x, the
parameters, the inputs and the tensor inputs (:class:`_ForwardPass`), brought to closed
form (:func:`_jvp`).
"""

from __future__ import annotations

import sympy

from derivgen.derive.program import selection_count, selection_tie, statistic_partial
from derivgen.derive.results import ModeDerivation, check_derivatives
from derivgen.derive.seeds import _Closer, _diff, _Seeds, _sorted, almost_everywhere
from derivgen.spec.model import Statistic, X
from derivgen.symbolic.block import BlockMean, block_mean, hide_blocks
from derivgen.symbolic.reduce import SELECTIONS, Mean, hide_means
from derivgen.symbolic.window import Window


class _ForwardPass:
    """Forward mode through the forward program: the tangent of every value from the
    tangents of x, the parameters and the inputs."""

    def __init__(self, first: ModeDerivation, seeds: _Seeds) -> None:
        spec = self.spec = first.spec
        self.rules = first.self_rules
        self.tan: dict[sympy.Symbol, sympy.Expr] = {X: seeds.tan_x.symbol}
        for p in spec.params:
            self.tan[p.symbol] = seeds.tan_params[p.name].symbol
        for i in spec.inputs:
            self.tan[i.symbol] = seeds.tan_inputs[i.name].symbol
        for t in spec.grad_tensors:
            self.tan[t.symbol] = seeds.tan_tensors[t.name].symbol
        for w in spec.windows:  # Ẇ = Window(e'(x)·ẋ)
            self.tan[w.symbol] = Window(_diff(w.body, X) * seeds.tan_x.symbol, w.size, 1)
        self.elem_in = {X} | {p.symbol for p in spec.params if not p.scalar} | spec.window_symbols
        self.elem_in |= {b.symbol for b in first.blocks} | {t.symbol for t in spec.grad_tensors}
        self.statistics = first.statistics

    def tangent(self, expr: sympy.Expr, where: str) -> sympy.Expr:
        """Σ ∂expr/∂u·u̇ over the values u with a tangent; a block mean's tangent is the block
        mean of its argument's."""
        out = sympy.S.Zero
        if expr.has(BlockMean):
            expr, back = hide_blocks(expr)
            for z, b in back.items():
                out += _diff(expr, z).xreplace(back) * block_mean(self.tangent(b.body, where), b.kind)
            return out + self.tangent(expr, where).xreplace(back)
        for u in _sorted(expr.free_symbols & set(self.tan)):
            d = _diff(expr, u)
            check_derivatives(self.spec, where, d)
            out += d * self.tan[u]
        return out

    def statistic(self, st: Statistic) -> None:
        """The tangent of one statistic, through its group values and its means; of a group
        maximum (minimum), the mean tangent of the elements that attain it."""
        if isinstance(st.expr, SELECTIONS):
            count = selection_count(self.statistics, st)
            tie = selection_tie(st)
            r = st.expr.args[0]
            self.tan[st.symbol] = (
                sympy.S.Zero if count is None else Mean(tie * self.tangent(r, f"statistics.{st.name}")) / count
            )
            return
        hidden, table = hide_means(st.expr, prefix=f"{st.name}_Q")
        ts = sympy.S.Zero
        for v in _sorted(hidden.free_symbols & set(self.tan)):
            if v in self.elem_in:
                continue
            d = almost_everywhere(statistic_partial(self.rules, st, v, hidden).xreplace(table))
            check_derivatives(self.spec, f"statistics.{st.name}", d)
            ts += d * self.tan[v]
        for r, atom in table.items():
            coef = almost_everywhere(statistic_partial(self.rules, st, r, hidden).xreplace(table))
            if coef != 0:
                ts += coef * Mean(self.tangent(atom.args[0], f"statistics.{st.name}"))
        self.tan[st.symbol] = ts


def _jvp(first: ModeDerivation, seeds: _Seeds, close: _Closer) -> tuple[sympy.Expr, dict[str, sympy.Expr]]:
    """ẏ and the tangent of each output beside y as closed forms: forward mode through the
    statistics, x̂ and the outputs."""
    fwd = _ForwardPass(first, seeds)
    for st in first.statistics:
        fwd.statistic(st)
    for b in first.blocks:  # ḃ = F'·(what F reads), a block mean's through the block mean
        fwd.tan[b.symbol] = fwd.tangent(b.expr, f"statistics.{b.name}")
    xhat = first.normalized_symbol
    txhat = fwd.tangent(first.normalized_expr, "normalized") if xhat is not None else None

    def tangent(y: sympy.Expr, where: str) -> sympy.Expr:
        if xhat is not None:
            return _diff(y, xhat) * txhat + fwd.tangent(y, where)
        return fwd.tangent(y, where)

    ty = close(tangent(first.output_in_normalized if xhat is not None else first.output, "output"))
    check_derivatives(first.spec, "JVP", ty)
    touts = {}
    for o in first.spec.outputs:  # x̂ is the spec's own symbol there (no implicit coordinate)
        touts[o.name] = close(tangent(o.expr, f"output.{o.name}"))
        check_derivatives(first.spec, f"JVP {o.name}", touts[o.name])
    return ty, touts
