"""Normalization layers as data: the frozen types a validated spec is made of.

A spec names the layout (which axes form a normalization group and which axes
the learnable parameters span), the learnable parameters, scalar options,
per-group inputs (differentiable, e.g. previous running moments), buffers
(non-differentiable state updated in place, e.g. running statistics), the
statistics in order, the normalized coordinate and the output. This module holds
the :class:`Spec` and the types it is made of, and the tables of the format (layouts,
tensor shapes, the names a spec may not declare); :mod:`derivgen.spec.parse` reads the
TOML text into them and :mod:`derivgen.spec.library` finds the built-in layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy

from derivgen.spec import reserved
from derivgen.symbolic import functions
from derivgen.symbolic.window import Window

# The group size inside expressions.
N = sympy.Symbol("N", positive=True, integer=True)
X = sympy.Symbol("x", real=True)
DY = sympy.Symbol("dy", real=True)

LAYOUTS = {
    # kind -> allowed reduce values
    "trailing": ("features",),
    "channels": ("batch", "instance", "group", "position", "all"),
}
IDENT = re.compile(r"^[a-z][a-z0-9_]{0,30}$")

# Names a spec may not declare. Everything the generated code names itself
# (loop variables, accumulators, reductions, coefficients, temporaries) lives
# in a namespace no spec identifier can reach: it starts with an upper-case
# letter or an underscore (see derivgen/symbolic/naming.py). What is left is the names
# the targets reserve (their keywords and the library names the generated code
# uses: derivgen/spec/reserved.py), and the names the spec format itself defines:
# the data and its gradient, the derivation's g, the keyword arguments every
# generated forward takes, and the functions of the expression language
# (derivgen/symbolic/functions.py).
FORMAT_NAMES = frozenset({"x", "y", "dy", "dx", "g", "out", "outs", "training", "num_groups", "leading", "window"})


def reserved_reason(name: str) -> str | None:
    """Why ``name`` cannot be declared in a spec, or None."""
    if not IDENT.match(name):
        return "not a lower-case identifier (a letter, then letters, digits and underscores, at most 31)"
    why = reserved.collision(name)
    if why is not None:
        return why
    if name in FORMAT_NAMES or name in functions.language() or name in functions.CONSTANTS:
        return "a name the spec format defines itself"
    grad = "d" + name
    if reserved.is_keyword(grad):
        return f"its gradient would be called {grad!r}, a keyword"
    return None


class SpecError(ValueError):
    """A spec is invalid; the message names the file and field."""


@dataclass(frozen=True)
class Named:
    """A named quantity with its display forms."""

    name: str
    symbol: sympy.Symbol
    latex: str
    text: str


@dataclass(frozen=True)
class Param(Named):
    """A learnable parameter: one value per channel / normalized feature, or one ``scalar``."""

    init: float = 1.0
    role: str = "scale"  # "scale" or "shift" (documentation only)
    scalar: bool = False  # one value for the whole tensor instead of one per channel/feature


@dataclass(frozen=True)
class Option(Named):
    """A scalar option (ε, momentum ...) with its default and declared bounds; the bounds
    give its sign (``min > 0``: positive) and the range proofs sample it from."""

    default: float | None = None
    min: float | None = None
    max: float | None = None
    integer: bool = False  # only whole numbers (a window's size)


@dataclass(frozen=True)
class Input(Named):
    """Per-group (or scalar) differentiable input, e.g. a previous running mean."""


# The shapes a tensor input may have, per layout kind: x's own, or broadcast over some of its
# axes (the gradient is then summed over them, as autograd sums a broadcast operand's).
TENSOR_SHAPES = {
    "trailing": {
        "x": "x's shape",
        "sample": "one value per sample and normalized feature: (x.shape[0], *normalized), broadcast over the axes between",
    },
    "channels": {
        "x": "x's shape",
        "sample": "one value per (sample, channel): (N, C), broadcast over the spatial axes",
        "position": "one value per (sample, position): (N, 1, *spatial), broadcast over the channels",
    },
}


@dataclass(frozen=True)
class Tensor(Named):
    """A tensor input beside x: of x's shape, or broadcast over some of its axes (``shape``:
    a key of :data:`TENSOR_SHAPES`); an element value in every expression. With ``grad`` its
    gradient is ``dNAME`` (summed over the broadcast axes); without, it is a constant to the
    derivatives (a mask, a dropout mask the caller draws)."""

    shape: str = "x"
    grad: bool = True
    mask: bool = False  # 0/1 values, checked at call time (never a gradient)


@dataclass(frozen=True)
class Value(Named):
    """An element value computed from x and tensor inputs before the statistics
    (``h = x + residual``); the statistics read x through at most one value, the layer's
    **core**, which the derivation differentiates through by the chain rule."""

    expr: sympy.Expr = sympy.S.Zero
    expr_text: str = ""


@dataclass(frozen=True)
class Output(Named):
    """An output beside y: an element expression, with its cotangent ``dNAME``."""

    expr: sympy.Expr = sympy.S.Zero
    expr_text: str = ""
    cotangent: sympy.Symbol = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Buffer(Named):
    """Per-group state, updated in place in training mode, never differentiated."""

    init: float = 0.0
    update: sympy.Expr = sympy.S.Zero
    update_text: str = ""


@dataclass(frozen=True)
class Mask(Named):
    """``leading(option)``: an element value, 1 on the first ⌊option·N⌋ elements of each
    group (in memory order) and 0 on the rest; it has no gradient. Each target computes it
    from the option and the element's position (a trailing layout's feature index)."""

    option: str = ""


@dataclass(frozen=True)
class WindowValue(Named):
    """``window(e, k)`` in the output: an element value, the sum of e (a function of x) over
    the k neighbours of the element in its group (:class:`derivgen.symbolic.window.Window`).
    The closed forms read it as a symbol; its gradient reaches x through the transposed window."""

    expr: Window = None  # type: ignore[assignment]

    @property
    def body(self) -> sympy.Expr:
        """e, the element values the window sums."""
        return self.expr.body

    @property
    def size(self) -> sympy.Expr:
        """k, an integer or an integer option's symbol."""
        return self.expr.size


@dataclass(frozen=True)
class Statistic(Named):
    """A per-group value defined from the data and earlier statistics: ``symbol`` = ``expr``."""

    expr: sympy.Expr = sympy.S.Zero
    expr_text: str = ""
    aux: bool = False  # named by the engine (a sub-expression of a user's statistic)


@dataclass(frozen=True)
class BlockStatistic(Statistic):
    """A value that is one value per block of a group (:mod:`derivgen.symbolic.block`): its
    expression reads x only inside block means ``mean(e, kind)``, and earlier statistics;
    ``kinds`` are the block kinds it is one value on. The closed forms read it as an element
    symbol; its gradient reaches x through the same block means."""

    kinds: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Mode:
    """A forward mode; statistics may be redefined (batch norm eval). ``statistics`` are
    one value per group, ``blocks`` one value per block (after them: no group statistic
    reads a block statistic)."""

    name: str
    statistics: tuple[Statistic, ...]
    min_group_size: int
    blocks: tuple[BlockStatistic, ...] = ()


@dataclass(frozen=True)
class Spec:
    """A validated layer: everything :func:`parse_spec` read from one TOML spec, frozen."""

    name: str
    title: str
    summary: str
    source: str  # where the spec came from (for headers/errors)
    layout: str
    reduce: str
    axes: int  # trailing layout: normalized axes when no parameter spans them
    params: tuple[Param, ...]
    options: tuple[Option, ...]
    inputs: tuple[Input, ...]
    buffers: tuple[Buffer, ...]
    modes: tuple[Mode, ...]  # first mode is the training / default mode
    normalized: Named | None
    normalized_expr: sympy.Expr | None
    output: sympy.Expr
    output_text: str
    notes: tuple[str, ...] = field(default=())
    second_order_notes: tuple[str, ...] = field(default=())  # prose for the second-order section
    masks: tuple[Mask, ...] = field(default=())  # the leading(option) masks the expressions use
    windows: tuple[WindowValue, ...] = field(default=())  # the output's window(e, k) values
    tensors: tuple[Tensor, ...] = field(default=())  # tensor inputs beside x
    values: tuple[Value, ...] = field(default=())  # element values computed before the statistics
    outputs: tuple[Output, ...] = field(default=())  # outputs beside y, in order
    core: Value | None = None  # the value the statistics read in place of x (None: x itself)

    @property
    def grad_tensors(self) -> tuple[Tensor, ...]:
        """The tensor inputs with a gradient."""
        return tuple(t for t in self.tensors if t.grad)

    @property
    def tensor_symbols(self) -> frozenset[sympy.Symbol]:
        """The element symbols of every tensor input."""
        return frozenset(t.symbol for t in self.tensors)

    @property
    def constant_tensor_symbols(self) -> frozenset[sympy.Symbol]:
        """The element symbols of the tensor inputs without a gradient (masks)."""
        return frozenset(t.symbol for t in self.tensors if not t.grad)

    @property
    def cotangents(self) -> tuple[sympy.Symbol, ...]:
        """The cotangents of the outputs, y's (dy) first."""
        return (DY, *(o.cotangent for o in self.outputs))

    @property
    def multi(self) -> bool:
        """Does the layer take tensor inputs beside x, or return outputs beside y?"""
        return bool(self.tensors or self.outputs or self.values)

    @property
    def mask_symbols(self) -> frozenset[sympy.Symbol]:
        """The element symbols of the masks: element values without a gradient."""
        return frozenset(m.symbol for m in self.masks)

    @property
    def window_symbols(self) -> frozenset[sympy.Symbol]:
        """The element symbols of the output's windows."""
        return frozenset(w.symbol for w in self.windows)

    @property
    def buffer_reads(self) -> tuple[str, ...]:
        """The names of the modes whose group statistics read the running buffers, in mode
        order (batch norm's eval mode; batch renormalization's training mode too): their
        kernels and operators take the buffers as inputs. Empty for a layer without buffers."""
        buffers = {b.symbol for b in self.buffers}
        return tuple(m.name for m in self.modes if any(st.expr.free_symbols & buffers for st in m.statistics))

    def reads_buffers(self, mode: str | None = None) -> bool:
        """Do the statistics of ``mode`` (the training mode for None) read the running buffers?"""
        return self.mode(mode).name in self.buffer_reads

    @property
    def symbols(self) -> dict[str, Named]:
        """Every named quantity of the layer, by name: x, N, parameters, options, inputs,
        buffers, the statistics of every mode and the normalized coordinate."""
        out: dict[str, Named] = {"x": _X_NAMED, "N": _N_NAMED}
        for group in (
            self.params,
            self.options,
            self.inputs,
            self.buffers,
            self.masks,
            self.windows,
            self.tensors,
            self.values,
        ):
            for item in group:
                out[item.name] = item
        for mode in self.modes:
            for st in (*mode.statistics, *mode.blocks):
                out[st.name] = st
        if self.normalized is not None:
            out[self.normalized.name] = self.normalized
        for o in self.outputs:  # the gradient arriving at an output h, shown as δh (∂L/∂h is the total)
            c = o.cotangent
            out[c.name] = Named(c.name, c, f"\\delta {o.latex}", f"δ{o.text}")
        return out

    def mode(self, name: str | None = None) -> Mode:
        """The mode called ``name`` (the first, training mode for None); KeyError if none is."""
        if name is None:
            return self.modes[0]
        for m in self.modes:
            if m.name == name:
                return m
        raise KeyError(name)


_X_NAMED = Named("x", X, "x", "x")
_N_NAMED = Named("N", N, "N", "N")

_GREEK = {
    "alpha": ("\\alpha", "α"),
    "beta": ("\\beta", "β"),
    "gamma": ("\\gamma", "γ"),
    "eps": ("\\varepsilon", "ε"),
    "mu": ("\\mu", "μ"),
    "sigma": ("\\sigma", "σ"),
    "momentum": ("m", "m"),
    "delta": ("\\delta", "δ"),
    "lambda_": ("\\lambda", "λ"),
    "tau": ("\\tau", "τ"),
    "rho": ("\\rho", "ρ"),
    "mu_t": ("\\mu_t", "μₜ"),
    "sigma_t": ("\\sigma_t", "σₜ"),
}
