"""The derivation engine: reverse mode through group reductions, in general N.

For one mode of a spec (statistics s_1..s_K, normalized coordinate x̂, output
y) it derives, as a careful person does by hand:

1. the local partial derivatives (∂y/∂x, ∂y/∂s_k, ∂s_k/∂s_m, ∂s_k/∂x_i),
2. the adjoint of every statistic, latest first (∂L/∂s_k), with the terms
   that vanish by the definition of the statistics shown and explained
   (∂σ²/∂μ ∝ Σ(x-μ) = 0),
3. ∂L/∂x, rewritten in the normalized coordinate x̂ and in g = ∂L/∂y · ∂y/∂x̂,
   where it collapses to a compact closed form with few group reductions,
4. the parameter gradients (reductions over the non-parameter axes) and the
   gradients of per-group inputs.

No ``sympy.simplify``: only linearity of means, known statistics (from
:mod:`derivgen.reduce`), substitution of x̂, ``expand`` on small expressions
and ``factor_terms``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
from sympy import Add, Mul

from .reduce import Mean, ReductionAlgebra, hide_means, means
from .document import latex_expr, text_expr
from .spec import DY, N, X, Named, Spec, Statistic

G = sympy.Symbol("g")
G_NAMED = Named("g", G, "g", "g")
DY_NAMED = Named("dy", DY, r"\frac{\partial L}{\partial y}", "∂L/∂y")


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


@dataclass
class Reduction:
    """A per-group reduction the backward computes at run time: name = Mean(arg)."""
    name: str
    symbol: sympy.Symbol
    arg: sympy.Expr

    @property
    def atom(self) -> Mean:
        return Mean(self.arg)


@dataclass
class ModeDerivation:
    spec: Spec
    mode: str
    statistics: tuple[Statistic, ...]
    normalized_expr: sympy.Expr | None      # x̂ in terms of x and statistics
    output: sympy.Expr                       # y in terms of x̂ (or x) and params
    g: sympy.Expr | None                     # g = dy * ∂y/∂x̂, when used
    dx: sympy.Expr                           # closed form, Mean atoms over g, x̂, dy
    dparams: dict[str, sympy.Expr]           # per-element contribution, summed over non-param axes
    dinputs: dict[str, sympy.Expr]           # per-group value
    reductions: list[Reduction]              # run-time reductions of the backward
    vanishing: list[tuple[str, str]]         # (what, why) exactly-zero terms
    kept: list[tuple[str, str]]              # terms that look like they vanish but do not
    steps: list[Step]

    def lowered(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace Mean atoms by the reduction symbols of the backward program."""
        return expr.xreplace({r.atom: r.symbol for r in self.reductions})

    @property
    def dx_lowered(self) -> sympy.Expr:
        return self.lowered(self.dx)


def partial_latex(num: str, den: str) -> str:
    return r"\frac{\partial %s}{\partial %s}" % (num, den)


def partial_text(num: str, den: str) -> str:
    return f"∂{num}/∂{den}"


def _reduction_name(arg: sympy.Expr, names: dict[sympy.Symbol, str]) -> str:
    parts = []
    for f in sorted(Mul.make_args(arg), key=sympy.default_sort_key):
        b, e = f.as_base_exp()
        base = names.get(b, None) if isinstance(b, sympy.Symbol) else None
        if base is None:
            return ""
        parts.append(base if e == 1 else f"{base}{e}" if e.is_Integer and e > 0 else "")
        if not parts[-1]:
            return ""
    return "mean_" + "_".join(parts)


class _PowerRules:
    """b**e -> (s/c)**(e/q) for statistics defined as s = c * b**q."""

    def __init__(self):
        self.rules: list[tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]] = []

    def add(self, stat: sympy.Symbol, definition: sympy.Expr):
        const, powers = [], []
        for f in Mul.make_args(definition):
            if f.is_Pow and f.exp.is_Rational and not f.exp.is_Integer:
                powers.append(f)
            else:
                const.append(f)
        if len(powers) == 1 and not any(c.free_symbols - {N} for c in const if not c.is_number):
            p = powers[0]
            self.rules.append((p.base, p.exp, Mul(*const), stat))

    def apply(self, expr: sympy.Expr) -> sympy.Expr:
        for base, q, c, s in self.rules:
            expr = expr.replace(lambda e: e.is_Pow and e.base == base,
                                lambda e: (s / c) ** (e.exp / q))
        return expr


def derive_mode(spec: Spec, mode_name: str | None = None) -> ModeDerivation:
    mode = spec.mode(mode_name)
    stats = mode.statistics
    stat_syms = [s.symbol for s in stats]
    group_syms = set(stat_syms) | {i.symbol for i in spec.inputs}
    named = spec.symbols
    sym_named = {n.symbol: n for n in named.values()}

    xhat = spec.normalized.symbol if spec.normalized else None
    xhat_def = spec.normalized_expr
    y_full = spec.output.xreplace({xhat: xhat_def}) if xhat is not None else spec.output
    params = {p.name: p.symbol for p in spec.params}

    varying = {X, DY, G, *params.values()} | ({xhat} if xhat is not None else set())
    alg = ReductionAlgebra(varying)
    rules = _PowerRules()
    canon_defs: dict[sympy.Symbol, sympy.Expr] = {}
    for st in stats:
        canon_defs[st.symbol] = alg.learn(st.symbol, st.expr)
    for st in stats:
        hidden, _ = hide_means(st.expr, prefix=f"{st.name}_R")
        rules.add(st.symbol, hidden)

    steps: list[Step] = []
    vanishing: list[tuple[str, str]] = []
    kept: list[tuple[str, str]] = []

    def _txt(e) -> str:
        return text_expr(e, spec)

    def _ltx(e) -> str:
        return latex_expr(e, spec, subscript=False)

    def L(sym):  # latex name
        return sym_named[sym].latex if sym in sym_named else sympy.latex(sym)

    def T(sym):
        return sym_named[sym].text if sym in sym_named else str(sym)

    # ---- 1. definitions -------------------------------------------------
    defs = Step("Definitions",
                "One normalization group holds N elements x_i. Angle brackets are the mean over "
                "the group, ⟨e⟩ = (1/N) Σ_j e_j. The statistics, in order:")
    for st in stats:
        defs.equations.append(Equation(st.latex, st.text, st.expr))
    if xhat is not None:
        defs.equations.append(Equation(spec.normalized.latex + "_i", spec.normalized.text, xhat_def))
    defs.equations.append(Equation("y_i", "y", spec.output))
    steps.append(defs)

    # ---- 2. local partials of the output ---------------------------------
    dy_dx = sympy.diff(y_full, X)
    local = Step("Local partial derivatives",
                 "y_i depends on x_i directly and on every statistic; each statistic depends "
                 "on all x_j of the group. With L the loss and ∂L/∂y_i given, the chain rule "
                 "runs through the statistics latest first:")
    chain_l = partial_latex("L", "x_i") + " = " + partial_latex("L", "y_i") + partial_latex("y_i", "x_i") + \
        "".join(" + " + partial_latex("L", L(s)) + partial_latex(L(s), "x_i")
                for s in stat_syms if mode_depends_on_x(canon_defs, s, stat_syms))
    chain_t = "∂L/∂x_i = ∂L/∂y_i·∂y_i/∂x_i" + "".join(
        f" + ∂L/∂{T(s)}·∂{T(s)}/∂x_i" for s in stat_syms if mode_depends_on_x(canon_defs, s, stat_syms))
    local.equations.append(Equation(chain_l, chain_t, None))
    if xhat is not None:
        dy_dxhat = sympy.diff(spec.output, xhat)
        local.equations.append(Equation(partial_latex("y", spec.normalized.latex), partial_text("y", spec.normalized.text), dy_dxhat))
        local.equations.append(Equation(partial_latex(spec.normalized.latex, "x"), partial_text(spec.normalized.text, "x"),
                                        sympy.diff(xhat_def, X)))
        for s in stat_syms:
            d = sympy.diff(xhat_def, s)
            if d != 0:
                local.equations.append(Equation(partial_latex(spec.normalized.latex, L(s)),
                                                partial_text(spec.normalized.text, T(s)), d))
    else:
        local.equations.append(Equation(partial_latex("y", "x"), "∂y/∂x", dy_dx))
    steps.append(local)

    # ---- 3. reverse pass through the statistics --------------------------
    adj: dict[sympy.Symbol, sympy.Expr] = {}
    for s in list(stat_syms) + [i.symbol for i in spec.inputs]:
        adj[s] = alg.canon(N * Mean(DY * sympy.diff(y_full, s)))
    dx_terms = [DY * dy_dx]
    stat_partials = Step("Partial derivatives of the statistics",
                         "Each statistic is a function of group means; a mean ⟨r⟩ contributes "
                         "(1/N)·∂r/∂x_i to ∂s/∂x_i and ⟨∂r/∂s'⟩ to ∂s/∂s' for an earlier statistic s'. "
                         "These last terms are where hand derivations go wrong:")
    adjoint_step = Step("Gradients with respect to the statistics",
                        "Latest statistic first; each collects ∂L/∂y through y and through every "
                        "later statistic:")
    for st in reversed(stats):
        s = st.symbol
        hidden, table = hide_means(st.expr, prefix=f"{st.name}_R")
        sbar = adj[s]
        for v in sorted(hidden.free_symbols & group_syms, key=sympy.default_sort_key):
            d = rules.apply(sympy.diff(hidden, v)).xreplace(table)
            if d != 0:
                adj[v] = adj[v] + sbar * d
                stat_partials.equations.append(Equation(partial_latex(st.latex, L(v)), partial_text(st.text, T(v)), d))
        for r, atom in table.items():
            coef = rules.apply(sympy.diff(hidden, r)).xreplace(table)
            if coef == 0:
                continue
            abar = sbar * coef
            rarg = atom.args[0]
            dr_dx = sympy.diff(rarg, X)
            if dr_dx != 0:
                dx_terms.append(abar / N * dr_dx)
                stat_partials.equations.append(Equation(partial_latex(st.latex, "x_i"), partial_text(st.text, "x_i"),
                                                        sympy.factor_terms(coef / N * dr_dx)))
            for v in sorted(rarg.free_symbols & group_syms, key=sympy.default_sort_key):
                raw = Mean(sympy.diff(rarg, v))
                val = alg.canon(raw)
                lhs_l = partial_latex(st.latex, L(v)) + r"\ \text{via}\ " + _ltx(atom)
                lhs_t = partial_text(st.text, T(v)) + " via " + _txt(atom)
                dr = Mean(sympy.factor_terms(sympy.diff(rarg, v)))
                if val == 0:
                    # linearity alone, then the definitions of the statistics it involves
                    lin = sympy.factor_terms(ReductionAlgebra(varying).canon(raw))
                    used = [t for t in stats if isinstance(t.expr, Mean) and lin.has(t.symbol)]
                    why = f"{_txt(dr)} = {_txt(lin)} = 0 because " + _why_zero(used, _txt)
                    why_l = f"${_ltx(dr)} = {_ltx(lin)} = 0$ because " + _why_zero(used, lambda e: "$" + _ltx(e) + "$")
                    vanishing.append((f"∂{st.text}/∂{T(v)} through the mean {_txt(atom)}", why))
                    stat_partials.equations.append(Equation(lhs_l, lhs_t, sympy.S.Zero, note=why, note_latex=why_l))
                else:
                    fv = sympy.factor_terms(val)
                    why = f"{_txt(dr)} = {_txt(fv)}, which is not zero in general: kept"
                    why_l = f"${_ltx(dr)} = {_ltx(fv)}$, which is not zero in general: kept"
                    kept.append((f"∂{st.text}/∂{T(v)} through the mean {_txt(atom)}", why))
                    stat_partials.equations.append(Equation(lhs_l, lhs_t, sympy.factor_terms(coef * val),
                                                            note=why, note_latex=why_l))
                    adj[v] = adj[v] + abar * val
    steps.append(stat_partials)

    # ---- 4. normalized coordinates and g ----------------------------------
    to_xhat = _solver(xhat, xhat_def) if xhat is not None else None
    if to_xhat is not None:
        for k in (1, 2):
            val = alg.canon(Mean(xhat_def ** k))
            if not val.has(Mean):
                alg.known[xhat ** k] = sympy.factor_terms(val)
    g_def = None
    if xhat is not None:
        d = sympy.diff(spec.output, xhat)
        if d != 0:
            g_def = DY * d

    def finish(expr: sympy.Expr, use_g: bool = True) -> sympy.Expr:
        e = expr
        if to_xhat is not None:
            e = e.subs(X, to_xhat)
        e = alg.canon(sympy.expand(alg.canon(e), power_base=False, log=False))
        if use_g and g_def is not None:
            eg = alg.canon(e.subs(DY, G / (g_def / DY)))
            if not (eg.free_symbols & set(params.values())) and not eg.has(DY):
                e = eg
        e = sympy.expand(e, power_base=False, log=False)
        e = sympy.collect(e, means(e), func=sympy.factor_terms) if e.has(Mean) else e
        return sympy.factor_terms(e)

    for st in reversed(stats):
        adjoint_step.equations.append(Equation(partial_latex("L", st.latex), partial_text("L", st.text),
                                               finish(adj[st.symbol])))
    steps.append(adjoint_step)

    dx = finish(Add(*dx_terms))
    dparams = {name: finish(DY * sympy.diff(spec.output if xhat is not None else y_full, sym), use_g=False)
               for name, sym in params.items()}
    dinputs = {i.name: finish(adj[i.symbol]) for i in spec.inputs}

    # run-time reductions: means that still contain dy or g
    atoms = set()
    for e in [dx, *dinputs.values()]:
        atoms |= set(means(e))
    red_names = {X: "x", DY: "dy", G: "g", **{p: n for n, p in params.items()}}
    if xhat is not None:
        red_names[xhat] = spec.normalized.name
    reductions = []
    for i, atom in enumerate(sorted(atoms, key=sympy.default_sort_key)):
        nm = _reduction_name(atom.args[0], red_names) or f"mean_{i}"
        reductions.append(Reduction(nm, sympy.Symbol(nm), atom.args[0]))

    closed = Step("Closed form",
                  "Substituting x = x(x̂) and " + (f"g = {_txt(g_def)}, " if g_def is not None else "")
                  + "applying linearity of ⟨·⟩ and the definitions of the statistics:")
    if g_def is not None and dx.has(G):
        closed.equations.append(Equation("g_i", "g", g_def))
    closed.equations.append(Equation(partial_latex("L", "x_i"), "∂L/∂x", dx))
    closed.prose += f" the backward needs {len(reductions)} reduction(s) per group: " + \
        ", ".join(_txt(r.atom) for r in reductions) + "."
    if xhat is not None and alg.known.get(xhat, None) == 0:
        why = "exactly, so any term proportional to it — the “1/N²” term that hand derivations " \
              "drop as negligible — is not small but exactly zero"
        lin = sympy.factor_terms(ReductionAlgebra(varying).canon(Mean(xhat_def)))
        note = f"{_txt(Mean(xhat))} = {_txt(lin)} = 0 {why}."
        note_l = f"$\\langle {spec.normalized.latex} \\rangle = 0$ {why}."
        vanishing.append(("Σ_j x̂_j", note))
        closed.equations.append(Equation(r"\sum_j " + spec.normalized.latex + "_j", "Σ x̂", sympy.S.Zero,
                                         note=note, note_latex=note_l))
    steps.append(closed)

    pstep = Step("Parameter gradients",
                 "Parameters do not enter the statistics, so their gradients are plain sums of "
                 "∂L/∂y·∂y/∂p over the axes the parameter does not span:")
    for p in spec.params:
        pstep.equations.append(Equation(partial_latex("L", p.latex), partial_text("L", p.text), dparams[p.name],
                                        note="summed over the non-parameter axes"))
    steps.append(pstep)
    if spec.inputs:
        istep = Step("Gradients of the per-group inputs",
                     "Summed over groups when the input is a single scalar:")
        for i in spec.inputs:
            istep.equations.append(Equation(partial_latex("L", i.latex), partial_text("L", i.text), dinputs[i.name]))
        steps.append(istep)
    if spec.buffers and mode.name == "train":
        bstep = Step("Running buffers (not differentiated)", "Updated in place in training mode:")
        for b in spec.buffers:
            bstep.equations.append(Equation(b.latex + r" \leftarrow", b.text + " ←", b.update))
        steps.append(bstep)

    return ModeDerivation(spec=spec, mode=mode.name, statistics=stats, normalized_expr=xhat_def,
                          output=spec.output, g=g_def if (g_def is not None and (dx.has(G) or any(e.has(G) for e in dinputs.values()))) else None,
                          dx=dx, dparams=dparams, dinputs=dinputs,
                          reductions=reductions, vanishing=vanishing, kept=kept, steps=steps)


def mode_depends_on_x(canon_defs, s, stat_syms) -> bool:
    e = canon_defs[s]
    return bool(e.has(Mean)) or any(mode_depends_on_x(canon_defs, t, stat_syms)
                                    for t in e.free_symbols if t in canon_defs)


def _solver(xhat: sympy.Symbol, xhat_def: sympy.Expr) -> sympy.Expr | None:
    """x as a function of x̂ when x̂ is affine in x with a group-constant slope."""
    slope = sympy.diff(xhat_def, X)
    if slope == 0 or slope.has(X):
        return None
    intercept = xhat_def.subs(X, 0)
    return sympy.expand((xhat - intercept) / slope)


def _why_zero(stats, txt) -> str:
    defs = [f"{s.text} = {txt(s.expr)}" for s in stats]
    return " and ".join(defs) if defs else "its terms cancel"



