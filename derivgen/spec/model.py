"""Normalization layers as data: TOML specs -> validated :class:`Spec`.

A spec names the layout (which axes form a normalization group and which axes
the learnable parameters span), the learnable parameters, scalar options,
per-group inputs (differentiable, e.g. previous running moments), buffers
(non-differentiable state updated in place, e.g. running statistics), the
statistics in order, the normalized coordinate and the output.  Every
expression goes through :mod:`derivgen.spec.expr`; nothing is evaluated as code.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import sympy

from derivgen.spec import reserved
from derivgen.spec.expr import ExprError, leading_option, leading_symbol, parse_expr
from derivgen.symbolic import domain, functions
from derivgen.symbolic.block import BlockFacts, BlockMean, block_kinds
from derivgen.symbolic.domain import domain_error
from derivgen.symbolic.reduce import GroupMax, Mean, hide_reductions, selections
from derivgen.symbolic.window import Window

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

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
TOP_LEVEL_FIELDS = {
    "name",
    "title",
    "summary",
    "notes",
    "second_order_notes",
    "layout",
    "params",
    "options",
    "inputs",
    "buffers",
    "statistics",
    "normalized",
    "output",
    "modes",
    "tensors",
    "values",
}

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


def catalogue_dir() -> Traversable:
    """The folder of the built-in layers' TOML files (inside the installed package)."""
    return resources.files("derivgen.spec") / "catalogue"


def catalogue_names() -> list[str]:
    """The names of the built-in layers, sorted."""
    return sorted(p.name[:-5] for p in catalogue_dir().iterdir() if p.name.endswith(".toml"))


def zoo_dir() -> Traversable:
    """The folder of the zoo: published layers written as specs, shipped with the package."""
    return resources.files("derivgen.spec") / "zoo"


def zoo_names() -> list[str]:
    """The names of the zoo's layers, sorted (none is also a catalogue name)."""
    return sorted(p.name[:-5] for p in zoo_dir().iterdir() if p.name.endswith(".toml"))


def load_catalogue(name: str) -> Spec:
    """The built-in layer ``name`` -- of the catalogue, else of the zoo -- parsed; SpecError
    for a name that is neither."""

    def unknown() -> SpecError:
        return SpecError(
            f"unknown layer {name!r}; the catalogue has {', '.join(catalogue_names())} "
            f"(and the zoo {len(zoo_names())} more: `derivgen list`)"
        )

    if not isinstance(name, str) or not IDENT.match(name):
        raise unknown()
    for kind, folder in (("catalogue", catalogue_dir()), ("zoo", zoo_dir())):
        res = folder / f"{name}.toml"
        if res.is_file():
            return parse_spec(res.read_text(encoding="utf-8"), source=f"{kind}/{name}.toml")
    raise unknown()


def load_spec_file(path: str | Path) -> Spec:
    """The spec in the TOML file ``path``, parsed; its source is the file's name, made safe
    to print into generated headers."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{p}: cannot read spec: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p}: spec is not UTF-8 text") from None
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", p.name)[:80]  # it is printed into generated headers
    return parse_spec(text, source=safe)


class _Ctx:
    """Reading one spec's TOML data: typed field access that raises :class:`SpecError`
    naming the source and the field."""

    def __init__(self, source: str, data: dict) -> None:
        self.source = source
        self.data = data

    def err(self, where: str, msg: str) -> NoReturn:
        """Reject the field ``where``."""
        raise SpecError(f"{self.source}: {where}: {msg}")

    def table(self, key: str, required: bool = False) -> dict:
        """The top-level table ``key`` (empty when absent and not ``required``)."""
        v = self.data.get(key, None)
        if v is None:
            if required:
                self.err(key, "missing required table")
            return {}
        if not isinstance(v, dict):
            self.err(key, "must be a table")
        return v

    def string(self, where: str, v: Any, *, allow_empty: bool = False) -> str:
        """``v`` as a string of at most 2000 characters (non-blank unless ``allow_empty``)."""
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            self.err(where, "must be a non-empty string")
        if len(v) > 2000:
            self.err(where, "string too long")
        return v

    def prose(self, where: str, v: Any, *, allow_empty: bool = False) -> str:
        """One line of text that ends up in generated comments and docstrings: it
        must not be able to close them (no triple quotes, comment delimiters,
        backslashes or control characters)."""
        t = self.string(where, v, allow_empty=allow_empty)
        bad = next((tok for tok in (3 * '"', 3 * "'", "*/", "/*", "\\") if tok in t), None)
        if bad is None and any(ord(ch) < 32 or ord(ch) == 127 for ch in t):
            bad = "a control character or line break"
        if bad is not None:
            self.err(where, f"must not contain {bad!r} (the text is copied into generated code comments)")
        return t

    def number(self, where: str, v: Any) -> float:
        """``v`` as a finite float (a bool is not a number)."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.err(where, f"must be a finite number, got {v!r}")
        return float(v)

    def ident(self, where: str, name: str, taken: dict[str, str]) -> str:
        """``name`` if a spec may declare it and it is not ``taken`` yet (name -> what it is)."""
        why = reserved_reason(name)
        if why is not None:
            self.err(where, f"invalid or reserved name {name!r}: {why}")
        if name in taken:
            self.err(where, f"name {name!r} is already declared as {taken[name]}")
        return name

    def display(self, where: str, name: str, entry: dict) -> tuple[str, str]:
        """(latex, text) of ``name``: the entry's own, else a Greek letter's (``mu``: μ),
        else the name itself; TeX primitives are rejected."""
        latex, text = _GREEK.get(name, (None, None))
        if latex is None:
            escaped = name.replace("_", "\\_")
            latex = f"\\mathrm{{{escaped}}}"
            text = name
        if "latex" in entry:
            latex = self.string(f"{where}.latex", entry["latex"])
            if re.search(r"\\(input|include|write|openout|immediate|def|catcode|read)", latex):
                self.err(f"{where}.latex", "TeX primitives are not allowed")
        if "text" in entry:
            text = self.string(f"{where}.text", entry["text"])
        return latex, text

    def keys(self, where: str, entry: dict, allowed: set[str]) -> None:
        """Reject fields of ``entry`` outside ``allowed``."""
        extra = set(entry) - allowed
        if extra:
            self.err(where, f"unknown field(s) {', '.join(sorted(extra))} (allowed: {', '.join(sorted(allowed))})")

    def entry(self, where: str, v: Any, main: str | None) -> dict:
        """A table entry, or a bare value standing for its ``main`` field."""
        if isinstance(v, dict):
            return v
        if main is None:
            self.err(where, "must be a table")
        return {main: v}


class _Parser:
    """parse_spec's state: the declared names so far and their symbols."""

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx = ctx
        self.taken: dict[str, str] = {}  # name -> what it is
        self.names: dict[str, sympy.Expr] = {"x": X, "N": N}
        self.stat_order: list[str] = []
        self.channel_params: set[sympy.Symbol] = set()
        self.option_names: frozenset[str] = frozenset()
        self.mask_fields: dict[sympy.Symbol, str] = {}  # mask symbol -> the first field that uses it
        self.window_fields: list[tuple[str, Window]] = []  # (field, window) for each window written
        self.blocks: dict[str, str] = {}  # the block kinds mean(e, kind) may name (symbolic.block)
        self.block_symbols: set[sympy.Symbol] = set()  # every block statistic's symbol, any mode
        self.tensor_fields: dict[sympy.Symbol, str] = {}  # tensor symbol -> its field
        self.value_symbols: set[sympy.Symbol] = set()  # the element values' symbols
        self.value_reads: dict[sympy.Symbol, str] = {}  # value -> the first statistic that reads it

    def declare(self, where: str, name: str, what: str, sym: sympy.Expr) -> None:
        """Declare ``name`` (``what`` it is, for messages) with its symbol."""
        self.ctx.ident(where, name, self.taken)
        self.taken[name] = what
        self.names[name] = sym

    def expr(self, where: str, text: Any, scope: dict, reductions: bool = True) -> sympy.Expr:
        """The expression ``text`` over the names in ``scope`` (means allowed if ``reductions``),
        defined somewhere; a statistic used before its definition is named as such."""
        ctx = self.ctx
        t = ctx.string(where, text)
        try:
            e = parse_expr(
                t, scope, group_size=N, allow_reductions=reductions, options=self.option_names, blocks=self.blocks
            )
        except ExprError as exc:
            msg = str(exc)
            m = re.match(r"unknown name '([a-z0-9_]+)'", msg)
            if m and m.group(1) in self.stat_order:
                msg = (
                    f"statistic {m.group(1)!r} is used before it is defined (statistics are evaluated in "
                    f"order and may refer only to earlier ones; cycles are not allowed): {t!r}"
                )
            ctx.err(where, msg)
        why = domain_error(e)
        if why is not None:
            ctx.err(where, f"{why} in {t!r}")
        for m in sorted(e.free_symbols, key=str):
            if leading_option(m) is not None:
                self.mask_fields.setdefault(m, where)
        for w in sorted(e.atoms(Window), key=sympy.default_sort_key):
            self.window_fields.append((where, w))
        return e

    # ---- declarations -------------------------------------------------
    def header(self, data: dict) -> tuple[str, str, str, list[str]]:
        """(name, title, summary, notes); the prose fields are safe to copy into comments."""
        ctx = self.ctx
        if "name" not in data:
            ctx.err("name", "missing required field")
        name = ctx.string("name", data["name"])
        if not IDENT.match(name):
            ctx.err(
                "name",
                f"must be a lower-case identifier (a letter, then letters, digits and underscores,"
                f" at most 31), got {name!r}",
            )
        title = ctx.prose("title", data.get("title", name))
        summary = ctx.prose("summary", data.get("summary", ""), allow_empty=True)
        return name, title, summary, self.prose_list(data, "notes")

    def prose_list(self, data: dict, key: str) -> list[str]:
        """An optional list of prose strings (``notes``, ``second_order_notes``)."""
        items = data.get(key, [])
        if not isinstance(items, list) or not all(isinstance(n, str) for n in items):
            self.ctx.err(key, "must be a list of strings")
        return [self.ctx.prose(f"{key}[{i}]", n) for i, n in enumerate(items)]

    def layout(self) -> tuple[str, str, int]:
        """(kind, reduce, axes) of ``[layout]``: which axes form a group and which the
        parameters span."""
        ctx = self.ctx
        t = ctx.table("layout", required=True)
        ctx.keys("layout", t, {"kind", "reduce", "axes"})
        kind = t.get("kind")
        if kind not in LAYOUTS:
            ctx.err("layout.kind", f"must be one of {', '.join(LAYOUTS)}, got {kind!r}")
        reduce_ = t.get("reduce", LAYOUTS[kind][0])
        if reduce_ not in LAYOUTS[kind]:
            ctx.err("layout.reduce", f"for kind {kind!r} must be one of {', '.join(LAYOUTS[kind])}, got {reduce_!r}")
        axes = t.get("axes", 1)
        if isinstance(axes, bool) or not isinstance(axes, int) or not 1 <= axes <= 8:
            ctx.err("layout.axes", f"must be an integer in 1..8, got {axes!r}")
        if "axes" in t and kind != "trailing":
            ctx.err("layout.axes", "only a 'trailing' layout has normalized axes to count")
        return kind, reduce_, axes

    def params(self) -> list[Param]:
        """The learnable parameters, declared (per-channel ones remembered: they may appear
        in a statistic only inside a mean)."""
        ctx, out = self.ctx, []
        for pname, v in ctx.table("params").items():
            where = f"params.{pname}"
            entry = ctx.entry(where, v, None)
            ctx.keys(where, entry, {"init", "role", "shape", "latex", "text"})
            role = entry.get("role", "scale")
            if role not in ("scale", "shift"):
                ctx.err(f"{where}.role", "must be 'scale' or 'shift'")
            shape = entry.get("shape", "channel")
            if shape not in ("channel", "scalar"):
                ctx.err(
                    f"{where}.shape",
                    f"must be 'channel' (one value per channel / normalized feature) or 'scalar', got {shape!r}",
                )
            init = ctx.number(f"{where}.init", entry.get("init", 1.0 if role == "scale" else 0.0))
            sym = domain.symbol(pname)
            self.declare(where, pname, "a parameter", sym)
            if shape == "channel":
                self.channel_params.add(sym)
            out.append(
                Param(pname, sym, *ctx.display(where, pname, entry), init=init, role=role, scalar=shape == "scalar")
            )
        return out

    def options(self) -> list[Option]:
        """The scalar options, declared with the sign their ``min`` gives."""
        ctx, out = self.ctx, []
        for oname, v in ctx.table("options").items():
            where = f"options.{oname}"
            entry = ctx.entry(where, v, "default")
            ctx.keys(where, entry, {"default", "min", "max", "integer", "latex", "text"})
            integer = entry.get("integer", False)
            if not isinstance(integer, bool):
                ctx.err(f"{where}.integer", f"must be true or false, got {integer!r}")
            lo = ctx.number(f"{where}.min", entry["min"]) if "min" in entry else None
            hi = ctx.number(f"{where}.max", entry["max"]) if "max" in entry else None
            if lo is not None and hi is not None and lo > hi:
                ctx.err(where, f"min {lo} is greater than max {hi}")
            default = ctx.number(f"{where}.default", entry["default"]) if "default" in entry else None
            if integer and default is not None and default != int(default):
                ctx.err(f"{where}.default", f"must be a whole number (the option is an integer), got {default}")
            if default is not None and ((lo is not None and default < lo) or (hi is not None and default > hi)):
                ctx.err(
                    f"{where}.default",
                    f"{default} is outside [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]",
                )
            level = (
                domain.REAL
                if lo is None
                else (domain.POSITIVE if lo > 0 else domain.NONNEG if lo == 0 else domain.REAL)
            )
            sym = domain.symbol(oname, level)
            self.declare(where, oname, "an option", sym)
            out.append(
                Option(oname, sym, *ctx.display(where, oname, entry), default=default, min=lo, max=hi, integer=integer)
            )
        self.option_names = frozenset(o.name for o in out)
        return out

    def masks(self, options: list[Option], layout: str) -> list[Mask]:
        """The ``leading(option)`` masks the expressions used, in option order; they need a
        trailing layout (a position among the normalized features)."""
        out = []
        for o in options:
            sym = leading_symbol(o.name)
            if sym not in self.mask_fields:
                continue
            if layout != "trailing":
                self.ctx.err(
                    self.mask_fields[sym],
                    f"leading({o.name}) needs a 'trailing' layout: it selects by position among the "
                    f"normalized features, and a {layout!r} group has no such order",
                )
            out.append(Mask(sym.name, sym, f"[i < \\lfloor {o.latex} N \\rfloor]", f"[i<⌊{o.text}·N⌋]", option=o.name))
        return out

    def windows(
        self, options: list[Option], layout: str, reduce_: str, output: sympy.Expr
    ) -> tuple[sympy.Expr, list[WindowValue]]:
        """The output with each distinct ``window(e, k)`` replaced by an element symbol, and the
        windows in the order written. A window sums a function of x alone (x, options,
        numbers) along the group's one ordered axis: a trailing layout's features, or the
        channels at one position (``reduce = "position"``); only the output may use one."""
        ctx, out, seen = self.ctx, [], {}
        by_symbol = {o.symbol: o for o in options}
        for where, w in self.window_fields:
            if where != "output":
                ctx.err(where, f"window() may appear only in the output (an element value of y): {w}")
            if layout != "trailing" and reduce_ != "position":
                ctx.err(
                    where,
                    "window() needs a 'trailing' layout or a 'channels' layout with reduce = 'position': "
                    f"it sums neighbouring features or channels, and a {reduce_!r} group has no such order",
                )
            if w.body.has(Window) or not w.body.has(X) or w.body.free_symbols - {X} - set(by_symbol):
                ctx.err(where, f"window()'s argument must be a function of x, options and numbers: {w.body}")
            opt = by_symbol.get(w.size)
            if opt is not None and not (opt.integer and opt.min is not None and opt.min >= 1):
                ctx.err(
                    f"options.{opt.name}",
                    "is a window size: declare it 'integer = true' with 'min' at least 1",
                )
            if w not in seen:
                k = len(seen) + 1
                sym = domain.symbol(f"Win{k}", domain.sign_level(w.body))
                sub = "" if len(self.window_fields) == 1 else f"_{{{k}}}"
                seen[w] = WindowValue(sym.name, sym, f"W{sub}", "W" + ("" if not sub else str(k)), expr=w)
        out = list(seen.values())
        return output.xreplace({w.expr: w.symbol for w in out}), out

    def inputs(self) -> list[Input]:
        """The per-group differentiable inputs, declared."""
        ctx, out = self.ctx, []
        for iname, v in ctx.table("inputs").items():
            where = f"inputs.{iname}"
            entry = ctx.entry(where, v, None)
            ctx.keys(where, entry, {"latex", "text"})
            sym = domain.symbol(iname)
            self.declare(where, iname, "an input", sym)
            out.append(Input(iname, sym, *ctx.display(where, iname, entry)))
        return out

    def tensors(self, layout: str) -> list[Tensor]:
        """The tensor inputs beside x, declared (each an element symbol)."""
        ctx, out = self.ctx, []
        for tname, v in ctx.table("tensors").items():
            where = f"tensors.{tname}"
            entry = ctx.entry(where, v, None)
            ctx.keys(where, entry, {"shape", "grad", "mask", "latex", "text"})
            shape = entry.get("shape", "x")
            if shape not in TENSOR_SHAPES[layout]:
                ctx.err(
                    f"{where}.shape",
                    f"a {layout!r} layout has no axes {shape!r}; one of: "
                    + "; ".join(f"{k!r} ({v})" for k, v in TENSOR_SHAPES[layout].items()),
                )
            for flag in ("grad", "mask"):
                if not isinstance(entry.get(flag, False), bool):
                    ctx.err(f"{where}.{flag}", f"must be true or false, got {entry[flag]!r}")
            mask = entry.get("mask", False)
            if mask and entry.get("grad", False):
                ctx.err(f"{where}.grad", "a mask (0/1 values) has no gradient; drop grad = true or mask = true")
            grad = entry.get("grad", not mask)
            sym = domain.symbol(tname, domain.NONNEG if mask else domain.REAL)
            self.declare(where, tname, "a tensor input", sym)
            self.tensor_fields[sym] = where
            out.append(Tensor(tname, sym, *ctx.display(where, tname, entry), shape=shape, grad=grad, mask=mask))
        return out

    def values(self) -> list[Value]:
        """The element values computed before the statistics, in order: elementwise in x,
        tensor inputs, parameters, options, inputs and earlier values."""
        ctx, out = self.ctx, []
        for vname, v in ctx.table("values").items():
            where = f"values.{vname}"
            entry = ctx.entry(where, v, "expr")
            ctx.keys(where, entry, {"expr", "latex", "text"})
            if "expr" not in entry:
                ctx.err(f"{where}.expr", "missing required field")
            scope = {k: s for k, s in self.names.items() if k != "N"}
            expr = self.expr(f"{where}.expr", entry["expr"], scope, reductions=False)
            if expr.has(Window) or any(leading_option(s) is not None for s in expr.free_symbols):
                ctx.err(
                    f"{where}.expr",
                    f"window() and leading() belong in the statistics and the output: {entry['expr']!r}",
                )
            sym = domain.symbol(vname, domain.sign_level(expr))
            self.declare(where, vname, "a value", sym)
            self.value_symbols.add(sym)
            out.append(Value(vname, sym, *ctx.display(where, vname, entry), expr=expr, expr_text=entry["expr"]))
        return out

    def buffer_entries(self) -> list[tuple[str, str, dict, sympy.Symbol]]:
        """The buffers declared, as (name, field, entry, symbol); their updates are read once
        the statistics are known (:meth:`buffers`)."""
        ctx, out = self.ctx, []
        for bname, v in ctx.table("buffers").items():
            where = f"buffers.{bname}"
            entry = ctx.entry(where, v, None)
            ctx.keys(where, entry, {"init", "update", "latex", "text"})
            if "update" not in entry:
                ctx.err(f"{where}.update", "missing required field")
            sym = domain.symbol(bname)
            self.declare(where, bname, "a buffer", sym)
            out.append((bname, where, entry, sym))
        return out

    # ---- statistics ---------------------------------------------------
    def statistics(
        self, where_root: str, table: dict, base: dict[str, Statistic] | None, bound: dict[str, int]
    ) -> tuple[list[Statistic], dict, dict[str, int]]:
        """The statistics of one mode, in order; ``base`` is the training mode's (for a
        redefinition); ``bound`` caps the sign each statistic may be declared with (a
        sign must hold in every mode). Returns (statistics, scope, inferred signs)."""
        ctx = self.ctx
        scope = dict(self.names)
        out: list[Statistic] = []
        taken = dict(self.taken)
        inferred: dict[str, int] = {}
        block_kinds_of: dict[sympy.Symbol, frozenset[str]] = {}
        if base is not None:
            extra = set(table) - set(base)
            if extra:
                ctx.err(where_root, f"redefines unknown statistic(s) {', '.join(sorted(extra))}")
        items = list(base.items()) if base is not None else list(table.items())
        for sname, v in items:
            where = f"{where_root}.{sname}"
            if base is not None:
                prev = v
                if sname in table:
                    entry = ctx.entry(where, table[sname], "expr")
                    ctx.keys(where, entry, {"expr"})
                    expr_text = entry["expr"]
                else:
                    expr_text = prev.expr_text
                expr = self.expr(f"{where}.expr", expr_text, scope)
                latex, text = prev.latex, prev.text
            else:
                entry = ctx.entry(where, v, "expr")
                ctx.keys(where, entry, {"expr", "latex", "text"})
                ctx.ident(where, sname, taken)
                if "expr" not in entry:
                    ctx.err(f"{where}.expr", "missing required field")
                expr_text = entry["expr"]
                expr = self.expr(f"{where}.expr", expr_text, scope)
                latex, text = ctx.display(where, sname, entry)
                taken[sname] = "a statistic"
            block = expr.has(BlockMean) or bool(expr.free_symbols & set(block_kinds_of))
            inferred[sname] = domain.sign_level(expr)
            sym = domain.symbol(sname, min(inferred[sname], bound.get(sname, domain.POSITIVE)))
            if block:
                kinds = self.check_block_level(f"{where}.expr", expr, expr_text, block_kinds_of)
                st = BlockStatistic(sname, sym, latex, text, expr=expr, expr_text=expr_text, kinds=kinds)
                block_kinds_of[sym] = kinds
                self.block_symbols.add(sym)
            else:
                self.check_group_level(f"{where}.expr", expr, expr_text)
                st = Statistic(sname, sym, latex, text, expr=expr, expr_text=expr_text)
            scope[sname] = st.symbol
            for v in expr.free_symbols & self.value_symbols:
                self.value_reads.setdefault(v, where)
            out.append(st)
        return out, scope, inferred

    def check_block_level(
        self, where: str, expr: sympy.Expr, text: str, earlier: dict[sympy.Symbol, frozenset[str]]
    ) -> frozenset[str]:
        """A block statistic is one value per block of some kind: x and per-channel parameters
        only inside block means (or per-channel parameters where the block holds one channel),
        no group reduction written inline. Returns the kinds it is one value on."""
        if expr.free_symbols & (self.value_symbols | set(self.tensor_fields)):
            self.ctx.err(where, f"a block statistic of tensor inputs or values is not supported yet: {text!r}")
        if expr.has(Mean, GroupMax):
            self.ctx.err(
                where,
                f"a group reduction of a block mean or of a block statistic is not supported (a statistic "
                f"that reads one is one value per block): {text!r}",
            )
        facts = BlockFacts({X}, earlier, self.channel_params, {})
        kinds = frozenset(k for k, how in self.blocks.items() if how == "block" and facts.constant(expr, k))
        if not kinds:
            self.ctx.err(
                where,
                f"a block statistic must be one value per block: x only inside mean(e, kind), and "
                f"block statistics of kinds whose blocks hold each other: {text!r}",
            )
        return kinds

    def check_group_level(self, where: str, expr: sympy.Expr, text: str) -> None:
        """A statistic is one value per group: x, per-channel parameters and masks only inside
        mean()/sum()."""
        for sel in selections(expr):
            kind = "max" if type(sel) is GroupMax else "min"
            if sel.args[0].free_symbols & self.channel_params:
                self.ctx.err(where, f"{kind}() of a per-channel parameter is not supported; {kind}() of x: {text!r}")
            if any(leading_option(s) is not None for s in sel.args[0].free_symbols):
                self.ctx.err(where, f"{kind}() of an expression with leading() is not supported: {text!r}")
        outside = hide_reductions(expr).free_symbols
        for b in sorted(outside & self.block_symbols, key=str):
            self.ctx.err(where, f"the block statistic {b} varies within a normalization group: {text!r}")
        if X in outside:
            self.ctx.err(
                where, f"x appears outside mean()/sum()/max()/min(): a statistic is one value per group: {text!r}"
            )
        for t in sorted(outside & (self.value_symbols | set(self.tensor_fields)), key=str):
            self.ctx.err(where, f"{t} varies within a normalization group; use it inside mean()/sum(): {text!r}")
        for m in sorted(outside, key=str):
            if leading_option(m) is not None:
                self.ctx.err(
                    where,
                    f"leading({leading_option(m)}) varies within a normalization group; use it inside mean()/sum(): {text!r}",
                )
        for p in sorted(outside & self.channel_params, key=str):
            self.ctx.err(
                where,
                f"the per-channel parameter {p} varies within a normalization group; use it "
                f"inside mean()/sum(), or declare it shape = 'scalar': {text!r}",
            )

    def modes(self, stats_t: dict) -> tuple[list[Mode], dict[str, sympy.Expr]]:
        """The modes (training first, then eval if the spec redefines statistics for it) and
        the scope the later expressions see (every name and the training statistics). A
        statistic's sign is declared only as strong as it holds in every mode."""
        ctx = self.ctx
        self.stat_order = list(stats_t)
        modes_t = ctx.table("modes")
        for mname, mt in modes_t.items():
            where = f"modes.{mname}"
            if mname not in ("train", "eval"):
                ctx.err(where, "modes may be 'train' or 'eval'")
            if not isinstance(mt, dict):
                ctx.err(where, "must be a table")
            ctx.keys(where, mt, {"statistics", "min_group_size"})
        eval_t = modes_t.get("eval")
        if eval_t is not None and not isinstance(eval_t.get("statistics", {}), dict):
            ctx.err("modes.eval.statistics", "must be a table")

        def min_size(mname: str) -> int:
            """The mode's ``min_group_size`` (1 by default)."""
            v = ctx.number(f"modes.{mname}.min_group_size", modes_t.get(mname, {}).get("min_group_size", 1))
            if v != int(v) or not 1 <= v <= 1 << 20:
                ctx.err(f"modes.{mname}.min_group_size", f"must be a positive integer, got {v}")
            return int(v)

        # a statistic's sign must hold in every mode: weaken until it does (a few rounds at most)
        bound: dict[str, int] = {}
        while True:
            train, scope, signs = self.statistics("statistics", stats_t, None, bound)
            modes = [_mode("train", train, min_size("train"))]
            if eval_t is not None:
                ev, _, ev_signs = self.statistics(
                    "modes.eval.statistics", eval_t.get("statistics", {}), {s.name: s for s in train}, bound
                )
                for k, lv in ev_signs.items():
                    signs[k] = min(signs[k], lv)
                modes.append(_mode("eval", ev, min_size("eval")))
            new = {k: min(v, bound.get(k, domain.POSITIVE)) for k, v in signs.items()}
            if all(
                new[s.name] >= domain.level_of_symbol(s.symbol)
                for m in modes
                for s in (*m.statistics, *m.blocks)
                if s.name in new
            ):
                for st in (*modes[0].statistics, *modes[0].blocks):
                    self.taken[st.name] = "a statistic"
                return modes, scope
            bound = new

    # ---- what uses the statistics ---------------------------------------
    def buffers(self, entries: list[tuple[str, str, dict, sympy.Symbol]], scope: dict) -> list[Buffer]:
        """The buffers with their update expressions (one value per group, no reductions)."""
        ctx, out = self.ctx, []
        for bname, where, entry, sym in entries:
            upd = self.expr(f"{where}.update", entry["update"], scope, reductions=False)
            self.check_group_level(f"{where}.update", upd, entry["update"])
            out.append(
                Buffer(
                    bname,
                    sym,
                    *ctx.display(where, bname, entry),
                    init=ctx.number(f"{where}.init", entry.get("init", 0.0)),
                    update=upd,
                    update_text=entry["update"],
                )
            )
        return out

    def normalized(self, data: dict, scope: dict) -> tuple[Named | None, sympy.Expr | None, dict]:
        """The optional normalized coordinate: (Named, expression, the output's scope). Its
        expression must be affine in x with a slope that is one value per group."""
        ctx = self.ctx
        out_scope = dict(scope)
        norm_t = data.get("normalized")
        if norm_t is None:
            return None, None, out_scope
        if not isinstance(norm_t, dict):
            ctx.err("normalized", "must be a table")
        ctx.keys("normalized", norm_t, {"name", "expr", "latex", "text"})
        for f in ("name", "expr"):
            if f not in norm_t:
                ctx.err(f"normalized.{f}", "missing required field")
        nname = ctx.ident("normalized.name", ctx.string("normalized.name", norm_t["name"]), self.taken)
        expr = self.expr("normalized.expr", norm_t["expr"], scope, reductions=False)
        read = sorted(self.value_reads, key=str)
        if len(read) > 1:
            names = ", ".join(str(v) for v in read)
            ctx.err(
                min(self.value_reads.values()),
                f"the statistics may read one value in place of x, not several ({names})",
            )
        core = read[0] if read else X
        if not expr.has(core):
            ctx.err("normalized.expr", "must depend on x" if core == X else f"must depend on {core}")
        slope = sympy.diff(expr, core)
        per_element = (
            self.channel_params
            | set(self.mask_fields)
            | self.block_symbols
            | self.value_symbols
            | set(self.tensor_fields)
        )
        if slope.has(core) or (slope.free_symbols | expr.subs(core, 0).free_symbols) & per_element:
            ctx.err(
                "normalized.expr",
                f"must be affine in x with a slope that is one value per group "
                f"(a*x + b, a and b statistics, options or numbers): {norm_t['expr']!r}",
            )
        nsym = domain.symbol(nname)
        self.taken[nname] = "the normalized coordinate"
        out_scope[nname] = nsym
        return Named(nname, nsym, *ctx.display("normalized", nname, norm_t)), expr, out_scope

    def output(
        self, data: dict, scope: dict, normalized: Named | None, normalized_expr: sympy.Expr | None
    ) -> tuple[sympy.Expr, str, list[Output]]:
        """The output y (``output = "..."`` or ``[output] y = "..."``) and its text, and the
        outputs beside it (``[output] NAME = "..."``, in order). y must depend on x, directly,
        through a value or through the normalized coordinate; an output named as a value
        must be that value (``h = "h"``)."""
        ctx = self.ctx
        out_t = data.get("output")
        if out_t is None:
            ctx.err("output", "missing required field")
        extra: list[Output] = []
        if isinstance(out_t, dict):
            if "y" not in out_t:
                ctx.err("output.y", "missing required field")
            for oname, text in out_t.items():
                if oname == "y":
                    continue
                where = f"output.{oname}"
                if not isinstance(text, str):
                    ctx.err(where, f"unknown field {oname!r} (an output beside y is an expression string)")
                e = self.expr(where, text, scope, reductions=False)
                if self.taken.get(oname) == "a value" and e != scope.get(oname):
                    ctx.err(where, f"an output named as the value {oname!r} must be that value ({oname} = {oname!r})")
                if self.taken.get(oname) != "a value":
                    ctx.ident(where, oname, self.taken)
                    self.taken[oname] = "an output"
                elif oname in {o.name for o in extra}:
                    ctx.err(where, f"output {oname!r} is declared twice")
                cot = domain.symbol("d" + oname)
                extra.append(
                    Output(oname, domain.symbol(oname), oname, oname, expr=e, expr_text=str(text), cotangent=cot)
                )
            out_t = out_t["y"]
            where_y = "output.y" if extra else "output"
        else:
            where_y = "output"
        output = self.expr(where_y, out_t, scope, reductions=False)
        output_full = output.xreplace({normalized.symbol: normalized_expr}) if normalized is not None else output
        if not output_full.has(X, *self.value_symbols):
            ctx.err(where_y, "must depend on x")
        for o in extra:
            if o.expr.has(Window) or (o.expr.free_symbols & self.mask_fields.keys()):
                ctx.err(f"output.{o.name}", "window() and leading() may appear only in y")
        return output, str(out_t), extra

    def core(
        self,
        values: list[Value],
        tensors: list[Tensor],
        modes: list[Mode],
        normalized: sympy.Expr | None,
        output: sympy.Expr,
        extra: list[Output],
        buffers: list[Buffer],
    ) -> tuple[Value | None, sympy.Expr | None, sympy.Expr, list[Output]]:
        """The value the statistics read in place of x (at most one: the layer's core), and
        the normalized coordinate and outputs with every other value written out. With a
        core, x and the tensors it is computed from with a gradient appear nowhere else but
        through it (the derivation goes through the core by the chain rule)."""
        ctx = self.ctx
        by_symbol = {v.symbol: v for v in values}
        read = {}
        for m in modes:
            for st in (*m.statistics, *m.blocks):
                for sym in st.expr.free_symbols & set(by_symbol):
                    read.setdefault(sym, f"{'statistics' if m.name == 'train' else 'modes.eval.statistics'}.{st.name}")
        if len(read) > 1:
            names = ", ".join(sorted(by_symbol[s].name for s in read))
            ctx.err(min(read.values()), f"the statistics may read one value in place of x, not several ({names})")
        core = by_symbol[next(iter(read))] if read else None
        inline = {}
        for v in values:  # earlier values written out in later ones, then every non-core value
            e = v.expr.xreplace(inline)
            if v is not core:
                inline[v.symbol] = e
        if core is not None:
            core = dataclasses.replace(core, expr=core.expr.xreplace(inline))
        normalized = normalized.xreplace(inline) if normalized is not None else None
        output = output.xreplace(inline)
        extra = [dataclasses.replace(o, expr=o.expr.xreplace(inline)) for o in extra]
        if core is not None:
            owned = {X} | {t.symbol for t in tensors if t.grad and core.expr.has(t.symbol)}
            if not core.expr.has(X):
                ctx.err(f"values.{core.name}.expr", "the value the statistics read must depend on x")
            places = [(f"output{'.y' if extra else ''}", output), *((f"output.{o.name}", o.expr) for o in extra)]
            places += [("normalized.expr", normalized)] if normalized is not None else []
            places += [(f"statistics.{st.name}", st.expr) for m in modes for st in (*m.statistics, *m.blocks)]
            places += [(f"buffers.{b.name}.update", b.update) for b in buffers]
            for where, e in places:
                bad = sorted(str(s) for s in e.free_symbols & owned)
                if bad:
                    ctx.err(
                        where,
                        f"reads {', '.join(bad)} outside the value {core.name!r} the statistics normalize; "
                        f"write it through {core.name}",
                    )
        used = set(output.free_symbols)
        for e in [o.expr for o in extra] + ([normalized] if normalized is not None else []):
            used |= e.free_symbols
        for m in modes:
            for st in (*m.statistics, *m.blocks):
                used |= st.expr.free_symbols
        if core is not None:
            used |= core.expr.free_symbols
        for t in tensors:
            if t.symbol not in used:
                ctx.err(f"tensors.{t.name}", f"the tensor input {t.name!r} is used nowhere")
        return core, normalized, output, extra

    def check_gradient_names(self) -> None:
        """Gradients are named d<name>: a declared d<name> would collide with one."""
        declared = list(self.taken)
        for n in declared:
            if "d" + n in declared:
                self.ctx.err(n, f"names {n!r} and {'d' + n!r} collide: the gradient of {n!r} is called {'d' + n!r}")


def _mode(name: str, stats: list[Statistic], min_group_size: int) -> Mode:
    """A mode from its statistics in order: the group statistics, then the block statistics."""
    group = tuple(s for s in stats if not isinstance(s, BlockStatistic))
    return Mode(name, group, min_group_size, tuple(s for s in stats if isinstance(s, BlockStatistic)))


def parse_spec(text: str, source: str = "<spec>") -> Spec:
    """Parse and validate the TOML text of a spec into a :class:`Spec`; ``source`` names it
    in error messages and generated headers. Raises :class:`SpecError` naming the field."""
    if len(text) > 200_000:
        raise SpecError(f"{source}: spec file too large")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: invalid TOML: {exc}") from None
    ctx = _Ctx(source, data)
    ctx.keys("<top level>", data, TOP_LEVEL_FIELDS)
    parser = _Parser(ctx)
    name, title, summary, notes = parser.header(data)
    kind, reduce_, axes = parser.layout()
    parser.blocks = block_kinds(kind, reduce_)
    params = parser.params()
    options = parser.options()
    inputs = parser.inputs()
    tensors = parser.tensors(kind)
    values = parser.values()
    buffer_entries = parser.buffer_entries()
    stats_t = ctx.table("statistics")  # none: an elementwise layer (Dynamic Tanh)
    modes, scope = parser.modes(stats_t)
    buffers = parser.buffers(buffer_entries, scope)
    normalized, normalized_expr, out_scope = parser.normalized(data, scope)
    output, output_text, outputs = parser.output(data, out_scope, normalized, normalized_expr)
    core, normalized_expr, output, outputs = parser.core(
        values, tensors, modes, normalized_expr, output, outputs, buffers
    )
    parser.check_gradient_names()
    masks = parser.masks(options, kind)
    output, windows = parser.windows(options, kind, reduce_, output)
    return Spec(
        name=name,
        title=title,
        summary=summary,
        source=source,
        layout=kind,
        reduce=reduce_,
        axes=axes,
        params=tuple(params),
        options=tuple(options),
        inputs=tuple(inputs),
        buffers=tuple(buffers),
        modes=tuple(modes),
        normalized=normalized,
        normalized_expr=normalized_expr,
        output=output,
        output_text=output_text,
        notes=tuple(notes),
        second_order_notes=tuple(parser.prose_list(data, "second_order_notes")),
        masks=tuple(masks),
        windows=tuple(windows),
        tensors=tuple(tensors),
        values=tuple(values),
        outputs=tuple(outputs),
        core=core,
    )
