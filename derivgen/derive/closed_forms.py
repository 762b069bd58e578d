"""The first order's closed forms (:class:`Deriver`, on top of its reverse pass,
:class:`~derivgen.derive.reverse.ReversePass`): the adjoints' terms written in x̂ and g,
reduced by linearity of the means and the known statistics, tidied, an auxiliary written
through the user's statistic it is a multiple of; x kept as itself where that needs fewer
run-time means; then the fewest run-time means -- the :class:`ModeDerivation` of one mode.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy
from sympy import Add, Mul

from derivgen.derive.results import G, MeanFacts, ModeDerivation, ParamGrad, check_derivatives, name_reductions
from derivgen.derive.reverse import ReversePass, _Adjoints
from derivgen.derive.rewrite import _polynomial_in_x, closed_form, fewest_closed_forms, tidy
from derivgen.spec.model import X
from derivgen.symbolic.block import BlockFacts, BlockMean, block_mean
from derivgen.symbolic.reduce import SELECTIONS, Mean, expand, means


class Deriver(ReversePass):
    """One mode's derivation: its reverse pass, then the closed forms (see
    :mod:`derivgen.derive.first`); used once, by :func:`~derivgen.derive.first.derive_mode`,
    which returns its result as a :class:`ModeDerivation`."""

    def finish(self, expr: sympy.Expr) -> sympy.Expr:
        """In x̂, reduced by the algebra (linearity, known statistics), tidied; an auxiliary
        that a user's statistic is a multiple of written through that statistic."""
        e = closed_form(expr, self.alg, self.to_xhat, self.element)
        fold = self._folds()
        return tidy(e.xreplace(fold), self.element) if fold and e.free_symbols & set(fold) else e

    def _folds(self) -> dict[sympy.Symbol, sympy.Expr]:
        """a = s/k for an auxiliary a and a user's statistic s = k·a (k free of a, of x and of
        every auxiliary): ρ = a₁/τ gives a₁ = ρ·τ, so closed forms read ρ, not a₁."""
        out: dict[sympy.Symbol, sympy.Expr] = {}
        aux = {st.symbol for st in self.program.stats if st.aux}
        for st in self.program.stats:
            if st.aux or st.expr.has(Mean, *SELECTIONS):
                continue
            for a in st.expr.free_symbols & aux:
                k = sympy.cancel(st.expr / a)
                if a not in out and not k.free_symbols & aux and k != 0:
                    out[a] = st.symbol / k
        return out

    def _closed_forms(
        self, adj: _Adjoints
    ) -> tuple[sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr], dict[sympy.Symbol, sympy.Expr]]:
        """dx, the parameter and input gradients and the statistics' adjoints in closed form.

        Where the output uses x itself beside the coordinate (x·sigmoid(v·x)/σ), writing x as
        (x - μ) + μ would split one mean into two and print (x - μ) + μ inside functions: the
        closed forms are then also written in x as it is, and that version is kept when it
        needs fewer run-time means (with as many, the coordinate keeps differences centred)."""
        if self.to_xhat is not None:
            self.alg.derived = {self.coord.symbol: self.coord_def}
        written = self._closed_forms_in(adj)
        if self.to_xhat is None or not self.y_hat.has(X):
            return self._fewest(*written)
        to_xhat = self.to_xhat
        self.to_xhat = None
        plain = self._closed_forms_in(adj)
        if _mean_count(plain) < _mean_count(written):
            if self.implicit is None and self.spec.normalized is None:
                self.coord = self.coord_def = None  # the centred coordinate is not used
            return self._fewest(*plain)
        self.to_xhat = to_xhat
        return self._fewest(*written)

    def _closed_forms_in(
        self, adj: _Adjoints
    ) -> tuple[sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr], dict[sympy.Symbol, sympy.Expr]]:
        """The closed forms with x written as :attr:`to_xhat` says (or as itself)."""
        spec, finish = self.spec, self.finish
        dx = finish(Add(*adj.terms[X]))
        grads = {}
        for p in spec.params:
            if p.scalar:
                grads[p.name] = ParamGrad(
                    finish(self.dL(p.symbol) + Add(*adj.terms[p.symbol])), finish(adj.group[p.symbol])
                )
            else:
                grads[p.name] = ParamGrad(finish(Add(*adj.terms[p.symbol])))
        for t in spec.grad_tensors:  # beside the parameters until run() splits them off
            grads[t.name] = ParamGrad(finish(Add(*adj.terms[t.symbol])))
        dinputs = {i.name: finish(adj.group[i.symbol]) for i in spec.inputs}
        unname_g = {G: self.g_def} if self.g_def is not None else {}
        adjoints = {
            # a selection's adjoint with g written out: its terms meet (softmax's is zero)
            st.symbol: finish(
                adj.group[st.symbol].xreplace(unname_g) if isinstance(st.expr, SELECTIONS) else adj.group[st.symbol]
            )
            for st in self.program.stats
        }
        for where, e in [("output", dx), *((f"params.{k}", v.element + v.group) for k, v in grads.items())]:
            check_derivatives(spec, where, e)
        return dx, grads, dinputs, adjoints

    def _fewest(
        self,
        dx: sympy.Expr,
        grads: dict[str, ParamGrad],
        dinputs: dict[str, sympy.Expr],
        adjoints: dict[sympy.Symbol, sympy.Expr],
    ) -> tuple[sympy.Expr, dict[str, ParamGrad], dict[str, sympy.Expr], dict[sympy.Symbol, sympy.Expr]]:
        """The closed forms in the fewest run-time means of ∂L/∂y (:mod:`derivgen.symbolic.fewest`):
        group means, then the block means of each kind, merged where their integrands or
        their coefficients in every output are proportional with a factor one value over
        the mean's domain (per group; per block). The coordinate is chosen before (a merge
        would join ⟨g·(x - μ)⟩ and μ·⟨g⟩ back into ⟨g·((x - μ) + μ)⟩); the statistics'
        adjoints stay as derived."""
        names = list(grads)
        exprs = [dx, *(grads[k].element for k in names), *(grads[k].group for k in names), *dinputs.values()]
        exprs = fewest_closed_forms(
            exprs,
            self.alg,
            self.bfacts,
            self.g_def,
            self.element,
            keep=lambda a: a.has(*self.cotangents, G),
            spell=self._speller(),
            centre=self._centre_blocks,
        )
        k = len(names)
        dx, elements, groups, ins = exprs[0], exprs[1 : 1 + k], exprs[1 + k : 1 + 2 * k], exprs[1 + 2 * k :]
        grads = {name: ParamGrad(e, gr) for name, e, gr in zip(names, elements, groups)}
        return dx, grads, dict(zip(dinputs, ins)), adjoints

    def _speller(self) -> Callable[[sympy.Expr], sympy.Expr]:
        """A sum as the reader knows it: k·num for a statistic s = num/den (num a sum) is k·den·s
        (a switchable norm's exp(vw_in)·σ²_in + exp(vw_ln)·σ²_ln + exp(vw_bn)·σ²_bn is vz·σ²)."""
        known = []
        for st in [*self.program.stats, *self.blocks]:
            if st.expr.has(Mean, BlockMean, *SELECTIONS):
                continue
            num, den = sympy.fraction(sympy.together(st.expr))
            if num.is_Add:
                known.append((expand(num), den, st.symbol))
        for y in {self.spec.output, self.y_hat}:  # the output's own sums (1 + x + x²/2)
            for a in sympy.preorder_traversal(y):
                if a.is_Add and a.free_symbols & self.element and not a.has(Mean, BlockMean, *SELECTIONS):
                    known.append((expand(a), sympy.S.One, a))

        def spell(f: sympy.Expr) -> sympy.Expr:
            if not f.is_Add:
                return f
            ef = expand(f)
            for num, den, s in known:
                if len(Add.make_args(ef)) != len(Add.make_args(num)):
                    continue
                k = sympy.cancel(ef / num)
                if (
                    not k.has(X, *self.cotangents, G)
                    and not (k.free_symbols & self.element)
                    and expand(ef - k * num) == 0
                ):
                    return Mul(k, den, s, evaluate=False)  # 2·(1 + x + x²/2), not distributed
            return f

        return spell

    def _centre_blocks(self, exprs: list[sympy.Expr], kind: str) -> list[list[sympy.Expr]]:
        """The block means of ∂L/∂y of one kind written about their block's own mean of x:
        ⟨∂L/∂y·(x - μ_in)⟩ rather than ⟨∂L/∂y·x⟩ or ⟨∂L/∂y·((x - μ) + μ)⟩ (x in the group's
        coordinate) -- one rewrite of ``exprs`` per block statistic mean(x, kind), latest
        first (a spec may name the same mean twice and use the later one)."""
        centres = [st.symbol for st in reversed(self.blocks) if st.expr == block_mean(X, kind)]
        to_x = {self.coord.symbol: self.coord_def} if self.to_xhat is not None else {}
        z = sympy.Dummy("z", real=True)
        facts = BlockFacts(self.bfacts.element | {z}, self.bfacts.kinds, self.bfacts.channel, self.bfacts.known)
        found = {b for e in exprs for b in e.atoms(BlockMean) if b.kind == kind and b.has(*self.cotangents, G)}
        out = []
        for m in centres:
            table = {}
            for b in found:
                u = expand(b.body.xreplace(to_x) if to_x else b.body)
                if u.has(X) and _polynomial_in_x(u):
                    table[b] = facts.rewrite(block_mean(expand(u.subs(X, z + m)), kind)).xreplace({z: X - m})
            if table:
                out.append([tidy(e.xreplace(table), self.element) if e.has(*table) else e for e in exprs])
        return out

    def _sum_xhat_zero(self) -> bool:
        """⟨x̂⟩ = 0 exactly for the spec's x̂."""
        return self.spec.normalized is not None and self.to_xhat is not None and self.alg.canon(Mean(self.xhat)) == 0

    def run(self) -> ModeDerivation:
        """The derivation as data."""
        spec = self.spec
        adj = self.reverse()
        dx, grads, dinputs, adjoints = self._closed_forms(adj)
        dtensors = {t.name: grads.pop(t.name).element for t in spec.grad_tensors}
        sum_zero = self._sum_xhat_zero()
        results = [dx, *dinputs.values(), *(g.element for g in grads.values()), *(g.group for g in grads.values())]
        results += list(dtensors.values())
        uses_g = self.g_def is not None and any(e.has(G) for e in results)
        return ModeDerivation(
            spec=spec,
            mode=self.mode.name,
            user_statistics=self.mode.statistics,
            statistics=tuple(self.program.stats),
            normalized_expr=self.xhat_def,
            output=spec.output,
            g=self.g_def if uses_g else None,
            dx=dx,
            grads=grads,
            dinputs=dinputs,
            reductions=name_reductions(spec, self.coord, results),
            partials=tuple(adj.partials),
            adjoints=adjoints,
            sum_xhat_zero=sum_zero,
            coordinate=self.coord,
            coordinate_expr=self.coord_def,
            implicit_coordinate=self.implicit is not None,
            output_in_coordinate=self.y_hat if self.implicit is not None else None,
            x_in_coordinate=self.to_xhat,
            element=frozenset(self.element),
            mean_facts=MeanFacts.of(self.alg),
            self_rules=dict(self.program.rules),
            blocks=tuple(self.blocks),
            dtensors=dtensors,
        )


def _mean_count(forms: tuple) -> int:
    """How many distinct group means the closed forms (dx, grads, dinputs, adjoints) read."""
    dx, grads, dinputs, _ = forms
    exprs = [dx, *dinputs.values(), *(g.element + g.group for g in grads.values())]
    return len({m for e in exprs for m in means(e)})
