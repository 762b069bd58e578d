"""What the second order starts from: its new symbols -- the cotangents of the backward's
outputs (δx, δp, δi, δt) and the tangents of the forward's inputs (ẋ, ṗ, i̇, ṫ),
:class:`_Seeds` --, derivatives almost everywhere (|u|'s second derivative dropped,
:func:`almost_everywhere`), and the closer that brings its expressions to the first
order's closed forms (:class:`_Closer`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import sympy

from derivgen.derive.results import ModeDerivation
from derivgen.derive.rewrite import closed_form
from derivgen.spec.model import Named, Spec
from derivgen.symbolic.naming import derived
from derivgen.symbolic.reduce import Mean, ReductionAlgebra


def _named(name: str, latex: str, text: str) -> Named:
    """A new real element or group symbol with its display forms."""
    return Named(name, sympy.Symbol(name, real=True), latex, text)


def _cotangent(item: Named) -> Named:
    """δp: the cotangent of ``item``'s gradient (named ``p_Dd``)."""
    return _named(derived(item.name, "Dd"), rf"\delta {item.latex}", f"δ{item.text}")


def _tangent(item: Named) -> Named:
    """ṗ: the tangent of ``item`` (named ``p_T``)."""
    return _named(derived(item.name, "T"), rf"\dot{{{item.latex}}}", f"{item.text}\u0307")


def almost_everywhere(e: sympy.Expr) -> sympy.Expr:
    """The derivative of sign(u) (from |u| in a layer) is zero wherever it is defined (u ≠ 0),
    as the first order's sign(u) is |u|'s derivative wherever that is defined: DiracDelta
    terms, and derivatives of sign that SymPy leaves unevaluated, are dropped."""
    if e.has(sympy.Derivative):
        e = e.replace(
            lambda a: isinstance(a, sympy.Derivative) and isinstance(a.expr, sympy.sign), lambda a: sympy.S.Zero
        )
    if e.has(sympy.DiracDelta):
        e = e.replace(lambda a: isinstance(a, sympy.DiracDelta), lambda a: sympy.S.Zero)
    return e


def _diff(expr: sympy.Expr, u: sympy.Symbol) -> sympy.Expr:
    """∂expr/∂u almost everywhere (see :func:`almost_everywhere`)."""
    return almost_everywhere(sympy.diff(expr, u))


def _sorted(symbols: Iterable[sympy.Symbol]) -> list[sympy.Symbol]:
    """``symbols`` in SymPy's canonical order (a deterministic derivation)."""
    return sorted(symbols, key=sympy.default_sort_key)


@dataclass(frozen=True)
class _Seeds:
    """The second order's new symbols: cotangents of the backward's outputs (δx, δp, δi, δt)
    and tangents of the forward's inputs (ẋ, ṗ, i̇, ṫ)."""

    cot_x: Named
    tan_x: Named
    cot_params: dict[str, Named]
    cot_inputs: dict[str, Named]
    tan_params: dict[str, Named]
    tan_inputs: dict[str, Named]
    cot_tensors: dict[str, Named] = field(default_factory=dict)  # per tensor input with a gradient
    tan_tensors: dict[str, Named] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: Spec) -> _Seeds:
        """The seeds of one layer, named after its parameters, inputs and tensor inputs."""
        return cls(
            cot_x=_named("X_Dd", r"\delta x", "δx"),
            tan_x=_named("X_T", r"\dot{x}", "ẋ"),
            cot_params={p.name: _cotangent(p) for p in spec.params},
            cot_inputs={i.name: _cotangent(i) for i in spec.inputs},
            tan_params={p.name: _tangent(p) for p in spec.params},
            tan_inputs={i.name: _tangent(i) for i in spec.inputs},
            cot_tensors={t.name: _cotangent(t) for t in spec.grad_tensors},
            tan_tensors={t.name: _tangent(t) for t in spec.grad_tensors},
        )

    def element(self, spec: Spec) -> frozenset[sympy.Symbol]:
        """The seeds that are element values: δx, ẋ and those of per-channel parameters and
        of tensor inputs."""
        channel = [p.name for p in spec.params if not p.scalar]
        tensors = [t.name for t in spec.grad_tensors]
        return frozenset(
            {self.cot_x.symbol, self.tan_x.symbol}
            | {self.cot_params[p].symbol for p in channel}
            | {self.tan_params[p].symbol for p in channel}
            | {self.cot_tensors[t].symbol for t in tensors}
            | {self.tan_tensors[t].symbol for t in tensors}
        )

    def reduction_names(self, spec: Spec) -> dict[sympy.Symbol, str]:
        """How the reductions' names spell the element seeds (Mean_dx_xhat ...)."""
        return {
            self.cot_x.symbol: "dx",
            self.tan_x.symbol: "tx",
            **{self.cot_params[p.name].symbol: "d" + p.name for p in spec.params},
            **{self.tan_params[p.name].symbol: "t" + p.name for p in spec.params},
            **{self.cot_tensors[t.name].symbol: "d" + t.name for t in spec.grad_tensors},
            **{self.tan_tensors[t.name].symbol: "t" + t.name for t in spec.grad_tensors},
        }


class _Closer:
    """Brings second-order expressions to closed form in the first order's coordinate, with a
    working algebra of its own built from the first order's facts."""

    def __init__(self, first: ModeDerivation, seeds: frozenset[sympy.Symbol]) -> None:
        self.alg: ReductionAlgebra = first.mean_facts.algebra(seeds)
        self.x_in_coordinate = first.x_in_coordinate
        self.element = first.element | seeds
        self.unlower = {r.symbol: Mean(r.arg) for r in first.reductions}

    def __call__(self, e: sympy.Expr | int) -> sympy.Expr:
        """A closed form: the first order's reductions as means again, |u|'s second
        derivative dropped where it is defined, reduced and tidied like the first order."""
        return closed_form(
            almost_everywhere(sympy.sympify(e).xreplace(self.unlower)), self.alg, self.x_in_coordinate, self.element
        )
