"""What the derivation stage hands on, as plain frozen data: the first order of one mode
(:class:`ModeDerivation`, with its :class:`Partial` derivatives, :class:`ParamGrad`
gradients, run-time :class:`Reduction` s and the :class:`MeanFacts` the second order goes
on from) and its second order (:class:`SecondOrder`); the name of the element symbol
g = ∂L/∂y·∂y/∂x̂ (:data:`G`), the run-time reductions named (:func:`name_reductions`), and
:class:`DerivationError` with the check that raises it (:func:`check_derivatives`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sympy
from sympy import Mul

from derivgen.spec.model import DY, Named, Spec, Statistic, X
from derivgen.symbolic.block import BLOCK_AXES, BlockMean
from derivgen.symbolic.reduce import SELECTIONS, Mean, ReductionAlgebra, means

if TYPE_CHECKING:
    from derivgen.derive.program import _SelfRule


G = sympy.Symbol("g", real=True)


class DerivationError(ValueError):
    """The engine cannot derive what a spec asks for; the message names the file and field."""


@dataclass(frozen=True)
class Reduction:
    """A per-group reduction the backward computes at run time: name = Mean(arg)."""

    name: str
    symbol: sympy.Symbol
    arg: sympy.Expr

    @property
    def atom(self) -> Mean:
        """The mean this reduction computes, as a Mean atom of the closed forms."""
        return Mean(self.arg)


@dataclass(frozen=True)
class Partial:
    """One partial derivative of a statistic, as the derivation shows it.

    kind: "group" (∂s/∂v for an earlier group value v), "element" (∂s/∂x_i or
    ∂s/∂p_i through a mean), "zero" (∂s/∂v through a mean that vanishes by the
    definitions of the statistics) or "kept" (one that looks like it might
    vanish but does not)."""

    stat: Statistic
    wrt: sympy.Symbol
    kind: str
    value: sympy.Expr
    atom: Mean | None = None
    raw: sympy.Expr | None = None  # the mean of ∂r/∂v as written (zero / kept)
    linear: sympy.Expr | None = None  # the same after linearity alone (zero) / canonical (kept)
    because: tuple[Statistic, ...] = ()  # the statistics whose definitions make it zero


@dataclass(frozen=True)
class ParamGrad:
    """∂L/∂p = (sum of ``element`` over the axes p does not span) + (sum of ``group`` over groups)."""

    element: sympy.Expr
    group: sympy.Expr = sympy.S.Zero


@dataclass(frozen=True)
class MeanFacts:
    """What the engine's reduction algebra knew when a derivation finished: the element
    symbols, those whose means are never known (∂L/∂y, g), the element symbols defined
    through x (the coordinate), and every mean the statistics determine. Later stages
    (the second order) build their own working algebra from it (:meth:`algebra`)."""

    varying: frozenset[sympy.Symbol]
    active: frozenset[sympy.Symbol]
    derived: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    known: tuple[tuple[sympy.Expr, sympy.Expr], ...]

    @classmethod
    def of(cls, alg: ReductionAlgebra) -> MeanFacts:
        """A copy of what ``alg`` knows now."""
        return cls(frozenset(alg.varying), frozenset(alg.active), tuple(alg.derived.items()), tuple(alg.known.items()))

    def algebra(self, element: frozenset[sympy.Symbol] = frozenset()) -> ReductionAlgebra:
        """A fresh algebra that knows these facts, with ``element`` as further element
        symbols whose means are never known (the second order's cotangents and tangents)."""
        alg = ReductionAlgebra(self.varying | element, dict(self.derived), active=self.active | element)
        alg.known.update(self.known)
        return alg


@dataclass(frozen=True)
class ModeDerivation:
    """The first-order derivation of one mode, as plain data: the program of statistics,
    the partial derivatives, the adjoints, the closed forms and their reductions -- and what
    later stages need to go on from them (the coordinate, the algebra's facts, the rules of
    the statistics' elementary functions). Made by
    :func:`~derivgen.derive.first.derive_mode`; never changed."""

    spec: Spec
    mode: str
    user_statistics: tuple[Statistic, ...]  # as the spec writes them
    statistics: tuple[Statistic, ...]  # the program: user statistics and auxiliaries, in order
    normalized_expr: sympy.Expr | None  # x̂ in terms of x and statistics
    output: sympy.Expr  # y in terms of x̂ (or x) and params
    g: sympy.Expr | None  # g = dy * ∂y/∂x̂, when used
    dx: sympy.Expr  # closed form, Mean atoms over g, x̂, dy
    grads: dict[str, ParamGrad]  # per parameter
    dinputs: dict[str, sympy.Expr]  # per-group value
    reductions: tuple[Reduction, ...]  # run-time reductions of the backward
    partials: tuple[Partial, ...] = ()
    adjoints: dict[sympy.Symbol, sympy.Expr] = field(default_factory=dict)  # ∂L/∂s, closed form
    sum_xhat_zero: bool = False  # mean(x̂) = 0 exactly (the "negligible" term)
    coordinate: Named | None = None  # the closed forms' element coordinate: x̂, or the centred x - μ
    coordinate_expr: sympy.Expr | None = None
    implicit_coordinate: bool = False  # x̂ named by the engine: the output uses it without [normalized]
    output_in_coordinate: sympy.Expr | None = None  # y written in that x̂ (direct paths keep x)
    x_in_coordinate: sympy.Expr | None = None  # x written in the coordinate (when it is affine in x)
    element: frozenset[sympy.Symbol] = frozenset()  # the element symbols of the closed forms
    mean_facts: MeanFacts | None = field(default=None, repr=False)
    self_rules: dict[sympy.Symbol, _SelfRule] = field(default_factory=dict, repr=False)  # s = c·F(u)
    blocks: tuple[Statistic, ...] = ()  # the block statistics (element values, one per block), in order
    dtensors: dict[str, sympy.Expr] = field(default_factory=dict)  # element-level ∂L/∂t per tensor input
    dcore: sympy.Expr | None = None  # ∂L/∂h for the spec's core value h (dx = dcore·∂h/∂x)
    chain: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂h/∂v for x and each tensor in h
    direct: dict[str, sympy.Expr] = field(default_factory=dict)  # a tensor's gradient beside dcore·chain (the outputs')

    @property
    def dparams(self) -> dict[str, sympy.Expr]:
        """The element-level part of each parameter gradient (all of it unless the parameter
        is a scalar that enters the statistics)."""
        return {k: v.element for k, v in self.grads.items()}

    @property
    def aux(self) -> tuple[Statistic, ...]:
        """The auxiliary statistics the engine named."""
        return tuple(s for s in self.statistics if s.aux)

    @property
    def normalized_symbol(self) -> sympy.Symbol | None:
        """x̂: the spec's, or the one the engine named for an output that normalizes x inline."""
        if self.spec.normalized is not None or self.implicit_coordinate:
            return self.coordinate.symbol
        return None

    @property
    def output_in_normalized(self) -> sympy.Expr:
        """y with x̂ as a symbol (y itself when there is no x̂)."""
        return self.output_in_coordinate if self.implicit_coordinate else self.output

    @property
    def block_reductions(self) -> tuple[BlockMean, ...]:
        """The block means of ∂L/∂y the backward computes at run time (one pass each: instance,
        then sample, then batch ones), beside its group means (:attr:`reductions`)."""
        exprs = [self.dx, *self.dinputs.values(), *(g.element + g.group for g in self.grads.values())]
        found = {b for e in exprs for b in e.atoms(BlockMean) if b.has(*self.spec.cotangents, G)}
        order = list(BLOCK_AXES)
        return tuple(sorted(found, key=lambda b: (order.index(b.kind), sympy.default_sort_key(b))))

    @property
    def reduction_counts(self) -> dict[str, int]:
        """The backward's run-time means by kind: {"group": n} and, where it has block means,
        their count per kind ("instance", "sample", "batch"), in that order."""
        out = {"group": len(self.reductions)}
        for b in self.block_reductions:
            out[b.kind] = out.get(b.kind, 0) + 1
        return out

    @property
    def reduction_summary(self) -> str:
        """The counts as a reader sees them: "2" (group means only), "2 group + 2 instance",
        "2 sample + 2 batch" (no group mean)."""
        counts = self.reduction_counts
        if len(counts) == 1:
            return str(counts["group"])
        return " + ".join(f"{n} {kind}" for kind, n in counts.items() if n)

    def lowered(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace Mean atoms by the reduction symbols of the backward program."""
        return expr.xreplace({r.atom: r.symbol for r in self.reductions})

    @property
    def dx_lowered(self) -> sympy.Expr:
        """∂L/∂x over the reduction symbols."""
        return self.lowered(self.dx)


def check_derivatives(spec: Spec, where: str, e: sympy.Expr) -> None:
    """Raise :class:`DerivationError` where SymPy could not differentiate (an unevaluated
    Derivative or Subs) or the derivative is undefined (zoo, nan)."""
    if e.has(sympy.Derivative, sympy.Subs) or e.has(sympy.zoo, sympy.nan):
        raise DerivationError(
            f"{spec.source}: {where}: cannot differentiate this expression "
            f"(it is not differentiable where the layer is defined)"
        )


def _reduction_name(arg: sympy.Expr, names: dict[sympy.Symbol, str]) -> str:
    """``Mean_g_xhat2`` for a monomial of named element symbols with positive integer powers,
    else ""."""
    parts = []
    for f in sorted(Mul.make_args(arg), key=sympy.default_sort_key):
        b, e = f.as_base_exp()
        base = names.get(b, None) if isinstance(b, sympy.Symbol) else None
        if base is None or not (e == 1 or (e.is_Integer and e > 0)):
            return ""
        parts.append(base if e == 1 else f"{base}{e}")
    return "Mean_" + "_".join(parts)


def name_reductions(
    spec: Spec,
    coordinate: Named | None,
    exprs: Iterable[sympy.Expr],
    extra: dict[sympy.Symbol, str] | None = None,
) -> tuple[Reduction, ...]:
    """The Mean atoms of ``exprs`` as named reductions (Mean_g_xhat ...), in a fixed order;
    ``extra`` names further element symbols (the second order's cotangents and tangents)."""
    atoms = set()
    for e in exprs:
        atoms |= set(means(e))
    names = {X: "x", DY: "dy", G: "g", **{p.symbol: p.name for p in spec.params}, **(extra or {})}
    names.update({t.symbol: t.name for t in spec.tensors})
    names.update({o.cotangent: o.cotangent.name for o in spec.outputs})
    if spec.core is not None:
        names[spec.core.symbol] = spec.core.name
    names.update({m.symbol: m.name for m in spec.masks})  # Mean_Lead_p_dx_x
    if coordinate is not None:
        names[coordinate.symbol] = coordinate.name
    out, used = [], set()
    for i, atom in enumerate(sorted(atoms, key=sympy.default_sort_key)):
        nm = _reduction_name(atom.args[0], names) or f"Mean_{i}"
        while nm in used:
            nm += "_"
        used.add(nm)
        out.append(Reduction(nm, sympy.Symbol(nm, real=True), atom.args[0]))
    return tuple(out)


def mode_depends_on_x(mode: ModeDerivation, s: sympy.Symbol) -> bool:
    """Does the statistic ``s`` of ``mode`` depend on x (through a mean, or another statistic)?"""
    defs = {st.symbol: st.expr for st in mode.statistics}
    e = defs[s]
    return bool(e.has(Mean, *SELECTIONS)) or any(mode_depends_on_x(mode, t) for t in e.free_symbols if t in defs)


@dataclass(frozen=True)
class SecondOrder:
    """The second-order closed forms of one mode (expressions over Mean atoms, like
    :class:`ModeDerivation`'s; ``lowered`` gives them over the reductions).

    With tensor inputs, outputs beside y or a core value, the double backward's cotangents
    are δx, δp, δi and δt (``cot_tensors``) and its gradients dx, ddy, ``ddouts``, grads,
    dinputs and ``dtensors``; the JVP's tangents ẋ, ṗ, i̇ and ṫ (``tan_tensors``) and its
    results ty and ``touts``. A core layer's closed forms read h and the element
    temporaries δh, ḣ (``cot_core``/``tan_core``, defined by ``cot_core_expr``/``tan_core_expr``
    in the seeds); ∂L₂/∂v = ``dcore``·``chain[v]`` + ``direct[v]`` for x and every tensor and
    parameter h is computed from (``dx`` and ``dtensors``/``grads`` hold the sums written out)."""

    first: ModeDerivation  # the first order it is derived from
    # the double backward: cotangents of the backward's outputs ...
    cot_x: Named  # δx: of dx (element)
    cot_params: dict[str, Named]  # δp: of dp (per channel, or one value for a scalar p)
    cot_inputs: dict[str, Named]  # δi: of di (per group)
    # ... and the gradients of L₂ = Σ δx·dx + Σ δp·dp + Σ δi·di
    dx: sympy.Expr  # ∂L₂/∂x (element)
    ddy: sympy.Expr  # ∂L₂/∂(∂L/∂y) (element)
    grads: dict[str, ParamGrad]  # ∂L₂/∂p: element part summed like dp, group part per group
    dinputs: dict[str, sympy.Expr]  # ∂L₂/∂i per group
    reductions: tuple[Reduction, ...]
    # the JVP: tangents of the forward's inputs, and ẏ
    tan_x: Named
    tan_params: dict[str, Named]
    tan_inputs: dict[str, Named]
    ty: sympy.Expr
    jvp_reductions: tuple[Reduction, ...]
    element: frozenset[sympy.Symbol] = frozenset()  # the element symbols of these closed forms
    # tensor inputs with a gradient and outputs beside y (empty for a layer without them)
    cot_tensors: dict[str, Named] = field(default_factory=dict)  # δt: of dt (element), per tensor with a gradient
    dtensors: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂L₂/∂t (element; summed over t's broadcast like dt)
    ddouts: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂L₂/∂(d<out>) (element), per output beside y
    tan_tensors: dict[str, Named] = field(default_factory=dict)  # ṫ (element), per tensor with a gradient
    touts: dict[str, sympy.Expr] = field(default_factory=dict)  # the tangent of each output beside y (element)
    # a layer with a core value h = f(x, t, p) (None / empty otherwise): the closed forms read the
    # element temporaries δh and ḣ, computed from the seeds before anything else
    cot_core: Named | None = None  # δh: the cotangent the backward in h sees
    cot_core_expr: sympy.Expr | None = None  # δh = δx·∂f/∂x + Σ_t δt·∂f/∂t + Σ_p δp·∂f/∂p
    tan_core: Named | None = None  # ḣ
    tan_core_expr: sympy.Expr | None = None  # ḣ = ∂f/∂x·ẋ + Σ_t ∂f/∂t·ṫ + Σ_p ∂f/∂p·ṗ
    dcore: sympy.Expr | None = None  # ∂L₂/∂h at fixed δh (element)
    chain: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂f/∂v for x, each tensor and parameter in h
    direct: dict[str, sympy.Expr] = field(default_factory=dict)  # ∂L₂/∂v - dcore·chain[v], same keys

    @property
    def spec(self) -> Spec:
        """The layer's spec."""
        return self.first.spec

    def lowered(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace the double backward's Mean atoms by its reduction symbols."""
        return expr.xreplace({r.atom: r.symbol for r in self.reductions})

    def jvp_lowered(self, expr: sympy.Expr) -> sympy.Expr:
        """Replace the JVP's Mean atoms by its reduction symbols."""
        return expr.xreplace({r.atom: r.symbol for r in self.jvp_reductions})

    @property
    def names(self) -> dict[str, Named]:
        """Every symbol this adds, by name (for printers and documents)."""
        out = {self.cot_x.name: self.cot_x, self.tan_x.name: self.tan_x}
        for d in (
            self.cot_params,
            self.cot_inputs,
            self.tan_params,
            self.tan_inputs,
            self.cot_tensors,
            self.tan_tensors,
        ):
            out.update({n.name: n for n in d.values()})
        for n in (self.cot_core, self.tan_core):
            if n is not None:
                out[n.name] = n
        return out
