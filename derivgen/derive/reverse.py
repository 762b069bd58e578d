"""The first order's reverse pass (steps 2 and 3 of :mod:`derivgen.derive.first`): for one
mode, the coordinate x̂ and g = ∂L/∂y·∂y/∂x̂ the closed forms are written in, then the adjoint
of every statistic, latest first (∂L/∂s_k), through the partial derivatives of the program
-- its means, its group maxima, the block statistics and the output's windows -- with the
terms that vanish recorded with their reasons, and the element-level terms of ∂L/∂x and of
the parameters' gradients (:class:`ReversePass`). :mod:`derivgen.derive.closed_forms` brings
them to closed form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
from sympy import Add, Mul

from derivgen.derive.coordinate import ImplicitCoordinate, closed_form_coordinate, find_implicit
from derivgen.derive.program import Program, _selection_kind, selection_tie
from derivgen.derive.results import G, Partial, check_derivatives
from derivgen.derive.rewrite import block_facts
from derivgen.spec.model import DY, Mode, N, Named, Spec, Statistic, X
from derivgen.symbolic.block import block_mean, hide_blocks
from derivgen.symbolic.reduce import SELECTIONS, Mean, ReductionAlgebra, expand, hide_means, means


@dataclass
class _Adjoints:
    """The reverse pass's state: ∂L/∂v of every group value, the element-level terms of
    ∂L/∂x and of each per-channel parameter's gradient, and the partials as shown."""

    group: dict[sympy.Symbol, sympy.Expr]
    terms: dict[sympy.Symbol, list[sympy.Expr]]
    partials: list[Partial] = field(default_factory=list)


class ReversePass:
    """One mode's coordinate and reverse pass (see the module docstring); its closed forms
    are :class:`derivgen.derive.closed_forms.Deriver`'s."""

    def __init__(self, spec: Spec, mode: Mode) -> None:
        self.spec, self.mode = spec, mode
        self.channel = {p.symbol: p for p in spec.params if not p.scalar}
        self.scalar = {p.symbol: p for p in spec.params if p.scalar}
        # element values the closed forms read as symbols: the masks (no gradient), the
        # output's windows (their gradient reaches x through the transposed window) and the
        # block statistics (theirs through the same block means: reverse)
        self.blocks = mode.blocks
        self.masks = set(spec.mask_symbols) | set(spec.window_symbols) | {b.symbol for b in mode.blocks}
        self.masks |= spec.constant_tensor_symbols  # tensor inputs without a gradient: element constants
        self.tensors = [t.symbol for t in spec.grad_tensors]  # element values with a gradient, as x
        self.cotangents = set(spec.cotangents)
        self._use_normalized(spec.normalized.symbol if spec.normalized else None, spec.normalized_expr)
        varying = {X, G, *self.cotangents, *self.channel, *self.masks, *self.tensors}
        varying |= {self.xhat} if self.xhat is not None else set()
        self.alg = ReductionAlgebra(varying, active={G, *self.cotangents})
        inputs = {i.symbol for i in spec.inputs}
        self.program = Program(spec, mode.statistics, self.alg, inputs | set(self.scalar))
        self.group_diff = set(self.program.active)  # every group value with an adjoint
        self.implicit: ImplicitCoordinate | None = None
        if self.xhat is None and not spec.outputs:
            self._adopt(find_implicit(spec, self.program.stats, self.y_full, self.alg))
        self._use_coordinate(*closed_form_coordinate(spec, self.program.stats, self.y_full, self.alg, self.implicit))
        self.element_diff = [X, *self.channel, *self.tensors]
        self.bfacts = block_facts(mode.blocks, self.element, set(self.channel))

    def _use_normalized(self, xhat: sympy.Symbol | None, xhat_def: sympy.Expr | None) -> None:
        """The spec's x̂ (if any): y in full, y in x̂, and g = ∂L/∂y·∂y/∂x̂ where y uses x̂."""
        spec = self.spec
        self.xhat, self.xhat_def = xhat, xhat_def
        self.y_full = spec.output.xreplace({xhat: xhat_def}) if xhat is not None else spec.output
        self.y_hat = spec.output  # y with x̂ as a symbol (or y itself)
        self.others = [(o.cotangent, o.expr) for o in spec.outputs]  # the outputs beside y, x̂ as a symbol
        dy_dxhat = sympy.diff(spec.output, xhat) if xhat is not None else sympy.S.Zero
        if xhat is not None and any(e.has(xhat) for _, e in self.others):
            # several outputs read x̂: g is the adjoint of x̂ over all of them, Σ_k ∂L/∂y_k·∂y_k/∂x̂
            self.g_def = Add(DY * dy_dxhat, *(c * sympy.diff(e, xhat) for c, e in self.others))
            self.xhat_adjoint = G
            return
        self._set_g(dy_dxhat, xhat)

    def _set_g(self, dy_dxhat: sympy.Expr, xhat: sympy.Symbol | None) -> None:
        """The adjoint of x̂, ∂L/∂y·∂y/∂x̂ = c·g, with c the factors of ∂y/∂x̂ that are one value
        per group (an input, a scalar, N) kept out of g, so that they come out of the group
        means: g = ∂L/∂y·(the factors that vary within a group), or ∂L/∂y itself (no g)."""
        if dy_dxhat == 0:
            self.g_def, self.xhat_adjoint = None, sympy.S.Zero
            return
        varying = {X, DY, *self.channel, *self.masks, *self.tensors} | ({xhat} if xhat is not None else set())
        per_group, per_element = [], []
        for f in Mul.make_args(dy_dxhat):
            (per_element if f.free_symbols & varying else per_group).append(f)
        scale, h = Mul(*per_group), Mul(*per_element)
        if h == 1:
            self.g_def, self.xhat_adjoint = None, scale * DY
        else:
            self.g_def, self.xhat_adjoint = DY * h, scale * G

    def _use_coordinate(self, coord: Named | None, coord_def: sympy.Expr | None) -> None:
        """The closed forms' element coordinate: an element symbol, x written in it where it is
        affine in x, and the element symbols of the closed forms."""
        self.coord, self.coord_def = coord, coord_def
        xhat = coord.symbol if coord is not None else None
        if xhat is not None:
            self.alg.varying.add(xhat)
        self.to_xhat = _solver(xhat, coord_def) if xhat is not None else None
        self.element = {X, G, *self.cotangents, *self.channel, *self.masks, *self.tensors}
        self.element |= {xhat} if xhat is not None else set()

    def _adopt(self, implicit: ImplicitCoordinate | None) -> None:
        """Write the backward in the coordinate the output uses without naming it (x̂ = u,
        g = ∂L/∂y·∂y/∂u), as for a spec that names it."""
        if implicit is None:
            return
        u = implicit.named.symbol
        self.implicit = implicit
        self.xhat, self.xhat_def, self.y_hat = u, implicit.definition, implicit.output
        self._set_g(sympy.diff(implicit.output, u), u)
        self.alg.varying.add(u)

    def dL(self, v: sympy.Symbol) -> sympy.Expr:
        """∂L/∂y·∂y/∂v for one element, with the path through x̂ written in g = ∂L/∂y·∂y/∂x̂
        (the adjoint of x̂) and the direct paths in ∂L/∂y: γ·x̂ + β + t·x gives g·∂x̂/∂x + ∂L/∂y·t."""
        direct = DY * sympy.diff(self.y_hat, v) + Add(*(c * sympy.diff(e, v) for c, e in self.others))
        if self.g_def is not None and direct != 0 and not self.others:  # ∂L/∂y·exp(x̂)/S² is g/S² for g = ∂L/∂y·exp(x̂)
            q = sympy.cancel(direct / self.g_def)
            if not q.free_symbols & (self.element - {G}):
                direct = q * G
        if self.xhat_def is None or self.xhat_adjoint == 0:
            return direct
        return self.xhat_adjoint * sympy.diff(self.xhat_def, v) + direct

    def reverse(self) -> _Adjoints:
        """∂L/∂s of every statistic, latest first, and the element-level terms of ∂L/∂x, ∂L/∂p."""
        group = {
            v: sympy.S.Zero if v in self.scalar else self.alg.canon(N * Mean(self.dL(v)))
            for v in sorted(self.group_diff, key=sympy.default_sort_key)
        }
        terms = {e: [self.dL(e)] for e in [X, *self.channel, *self.tensors]}
        terms.update({p: [] for p in self.scalar})  # element terms beside dL(p): through block statistics
        for w in self.spec.windows:  # W_i = Σ_d e(x_{i+d}): ∂L/∂x_j = e'(x_j)·Σ_d ∂L/∂W_{j-d}
            terms[X].append(sympy.diff(w.body, X) * w.expr.transpose(self.dL(w.symbol)))
        adj = _Adjoints(group, terms)
        self._through_blocks(adj)
        for st in reversed(list(self.program.stats)):
            if isinstance(st.expr, SELECTIONS):
                self._through_selection(st, adj)
                continue
            hidden, table = hide_means(st.expr, prefix=f"{st.name}_R")
            self._through_group_values(st, hidden, table, adj)
            for r, atom in table.items():
                coef = self.program.partial(st, r, hidden).xreplace(table)
                if coef != 0:
                    self._through_mean(st, coef, atom, adj)
        return adj

    def _through_blocks(self, adj: _Adjoints) -> None:
        """The block statistics, latest first: each one's adjoint is an element value (∂L/∂y·∂y/∂b
        and what later block statistics pass on); through b = F(x, ..., B(u)) it reaches the
        variables F names directly by ∂F/∂v, and those inside a block mean B(u) by the same
        block mean of the adjoint, B(b̄·∂F/∂B)·∂u/∂v (a block mean is its own transpose);
        group values get N·⟨b̄·∂F/∂s⟩. Block means are rewritten exactly as they are made
        (B(x - m) = 0 for m = B(x)), so what vanishes costs nothing."""
        if not self.blocks:
            return
        badj = {b.symbol: self.dL(b.symbol) for b in self.blocks}
        for b in reversed(self.blocks):
            a = self.bfacts.rewrite(badj[b.symbol])
            if a != 0:
                self._spread(a, b.expr, b, adj, badj)

    def _spread(
        self, a: sympy.Expr, e: sympy.Expr, b: Statistic, adj: _Adjoints, badj: dict[sympy.Symbol, sympy.Expr]
    ) -> None:
        """The adjoint ``a`` of the element value ``e`` (part of block statistic ``b``) to what it reads."""
        hidden, back = hide_blocks(e)
        where = f"statistics.{b.name}"
        for v in sorted(hidden.free_symbols, key=sympy.default_sort_key):
            d = sympy.diff(hidden, v).xreplace(back)
            check_derivatives(self.spec, where, d)
            if d == 0:
                continue
            if v in back:  # inside a block mean B(u): B(a·∂e/∂B) to what u reads
                inner = self.bfacts.rewrite(block_mean(a * d, back[v].kind))
                if inner != 0:
                    self._spread(inner, back[v].body, b, adj, badj)
            elif v == X or v in self.channel or v in self.scalar or v in self.tensors:
                adj.terms[v].append(a * d)
            elif v in badj:
                badj[v] = badj[v] + a * d
            elif v in self.group_diff:
                adj.group[v] = adj.group[v] + self.alg.canon(N * Mean(expand(a * d)))

    def _through_group_values(
        self, st: Statistic, hidden: sympy.Expr, table: dict[sympy.Dummy, Mean], adj: _Adjoints
    ) -> None:
        """s̄·∂s/∂v to every earlier group value v the definition of s names outside a mean."""
        sbar = adj.group[st.symbol]
        for v in sorted(hidden.free_symbols & self.group_diff, key=sympy.default_sort_key):
            d = self.program.partial(st, v, hidden).xreplace(table)
            check_derivatives(self.spec, f"statistics.{st.name}", d)
            if d != 0:
                adj.group[v] = adj.group[v] + sbar * d
                adj.partials.append(Partial(st, v, "group", d))

    def _through_mean(self, st: Statistic, coef: sympy.Expr, atom: Mean, adj: _Adjoints) -> None:
        """s̄·∂s/∂⟨r⟩ through one mean ⟨r⟩ of s: (1/N)·∂r/∂x_i to the elements, ⟨∂r/∂v⟩ to
        the group values inside r -- zero by the definitions of the statistics, or kept."""
        abar = adj.group[st.symbol] * coef
        rarg = atom.args[0]
        for elem in self.element_diff:
            de = sympy.diff(rarg, elem)
            check_derivatives(self.spec, f"statistics.{st.name}", de)
            if de != 0:
                adj.terms[elem].append(abar / N * de)
                adj.partials.append(Partial(st, elem, "element", sympy.factor_terms(coef / N * de), atom=atom))
        for v in sorted(rarg.free_symbols & self.group_diff, key=sympy.default_sort_key):
            raw = Mean(sympy.diff(rarg, v))
            val = self.alg.canon(raw)
            if any(not m.has(*self.cotangents, G) for m in means(val)):
                val = self._forward_mean(raw, st, adj.group)
            dr = Mean(sympy.factor_terms(sympy.diff(rarg, v)))
            if val == 0:
                lin = sympy.factor_terms(ReductionAlgebra(self.alg.varying).canon(raw))
                used = tuple(t for t in self.program.stats if isinstance(t.expr, Mean) and lin.has(t.symbol))
                adj.partials.append(Partial(st, v, "zero", sympy.S.Zero, atom=atom, raw=dr, linear=lin, because=used))
            else:
                adj.partials.append(
                    Partial(
                        st, v, "kept", sympy.factor_terms(coef * val), atom=atom, raw=dr, linear=sympy.factor_terms(val)
                    )
                )
                adj.group[v] = adj.group[v] + abar * val

    def _through_selection(self, st: Statistic, adj: _Adjoints) -> None:
        """s = max(r) (or min) over the group: s̄ goes to the elements where r_i = s, split
        evenly among them (PyTorch's amax), through ∂r_i/∂x_i -- unless s̄ is exactly zero by
        the algebra (a softmax's maximum: y does not change when s shifts), which is
        recorded as a vanishing term and costs the backward nothing."""
        r = st.expr.args[0]
        written = adj.group[st.symbol]
        if self.g_def is not None:  # g is a name for ∂L/∂y·h: the means of both must meet
            written = written.xreplace({G: self.g_def})
        sbar = self.alg.canon(expand(self.alg.canon(written)))
        if sbar == 0:
            adj.partials.append(Partial(st, X, "selection", sympy.S.Zero, atom=st.expr, raw=adj.group[st.symbol]))
            return
        tie = selection_tie(st)
        count = self.program.auxiliary(
            Mean(tie), st, "the share of the group that attains the " + _selection_kind(st.expr)
        )
        self.group_diff.add(count)
        adj.group.setdefault(count, sympy.S.Zero)
        share = tie / (N * count)
        for elem in self.element_diff:
            de = sympy.diff(r, elem)
            check_derivatives(self.spec, f"statistics.{st.name}", de)
            if de != 0:
                adj.terms[elem].append(adj.group[st.symbol] * share * de)
                adj.partials.append(Partial(st, elem, "selection", share * de, atom=st.expr))
        for v in sorted(r.free_symbols & self.group_diff, key=sympy.default_sort_key):
            d = self.alg.canon(Mean(tie * sympy.diff(r, v))) / count
            if d != 0:
                adj.group[v] = adj.group[v] + adj.group[st.symbol] * d
                adj.partials.append(Partial(st, v, "group", d))

    def _forward_mean(self, raw: Mean, st: Statistic, group_adj: dict[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
        """A mean of x alone that no statistic determines (⟨(x - μ)³⟩ from differentiating a
        fourth moment through μ, ⟨sign(x - μ)⟩ from a mean absolute deviation): an auxiliary
        the forward computes as written, two-pass, rather than a reduction of the backward or
        an expansion in raw moments of x."""
        _, vary = self.alg.split(sympy.factor_terms(raw.args[0]))
        sym = self.program.auxiliary(Mean(vary), st, "a mean the backward needs")
        group_adj.setdefault(sym, sympy.S.Zero)
        return self.alg.canon(raw)


def _solver(xhat: sympy.Symbol, xhat_def: sympy.Expr) -> sympy.Expr | None:
    """x as a function of x̂ when x̂ is affine in x with a group-constant slope."""
    slope = sympy.diff(xhat_def, X)
    if slope == 0 or slope.has(X):
        return None
    intercept = xhat_def.subs(X, 0)
    return sympy.expand((xhat - intercept) / slope)
