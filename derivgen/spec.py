"""Normalization layers as data: TOML specs -> validated :class:`Spec`.

A spec names the layout (which axes form a normalization group and which axes
the learnable parameters span), the learnable parameters, scalar options,
per-group inputs (differentiable, e.g. previous running moments), buffers
(non-differentiable state updated in place, e.g. running statistics), the
statistics in order, the normalized coordinate and the output.  Every
expression goes through :mod:`derivgen.expr`; nothing is evaluated as code.
"""

from __future__ import annotations

import keyword
import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import sympy

from .expr import ExprError, parse_expr

# The group size inside expressions.
N = sympy.Symbol("N", positive=True, integer=True)
X = sympy.Symbol("x")
DY = sympy.Symbol("dy")

LAYOUTS = {
    # kind -> allowed reduce values
    "trailing": ("features",),
    "channels": ("batch", "instance", "group"),
}
IDENT = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
C_RESERVED = set("""
auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef
union unsigned void volatile while _Bool _Complex _Imaginary bool complex imaginary
main errno assert abs fabs sqrt exp log pow fmax fmin isnan isinf nan inf size_t
""".split())
# names the engine or the generated code uses itself
ENGINE_RESERVED = {
    "x", "dy", "g", "N", "y", "dx", "sum", "sqrt", "exp", "log", "abs", "np", "numpy",
    "out", "cache", "grads", "training", "num_groups", "self", "cls", "i", "j", "k", "n", "c",
    "s", "o", "nn", "threads", "derivgen", "backend", "shape", "dtype", "min", "max",
    # loop variables and locals of the generated C and NumPy code
    "grp", "b", "m", "cg", "ch", "idx", "off", "base", "blocks", "block_stride", "n_groups", "nth",
    "nthreads", "tid", "part", "mine", "xv", "dyv", "call", "partial", "rt", "meta", "float",
    "int", "none", "true", "false",
}
RESERVED_SUFFIXES = ("_t", "_g", "_v", "_in", "_out", "_stride", "_part")


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
    init: float = 1.0
    role: str = "scale"          # "scale" or "shift" (documentation only)
    scalar: bool = False         # one value for the whole tensor instead of one per channel/feature


@dataclass(frozen=True)
class Option(Named):
    default: float | None = None
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class Input(Named):
    """Per-group (or scalar) differentiable input, e.g. a previous running mean."""


@dataclass(frozen=True)
class Buffer(Named):
    """Per-group state, updated in place in training mode, never differentiated."""
    init: float = 0.0
    update: sympy.Expr = sympy.S.Zero
    update_text: str = ""


@dataclass(frozen=True)
class Statistic(Named):
    expr: sympy.Expr = sympy.S.Zero
    expr_text: str = ""


@dataclass(frozen=True)
class Mode:
    """A forward mode; statistics may be redefined (batch norm eval)."""
    name: str
    statistics: tuple[Statistic, ...]
    min_group_size: int


@dataclass(frozen=True)
class Spec:
    name: str
    title: str
    summary: str
    source: str                   # where the spec came from (for headers/errors)
    layout: str
    reduce: str
    axes: int                     # trailing layout: normalized axes when no parameter spans them
    params: tuple[Param, ...]
    options: tuple[Option, ...]
    inputs: tuple[Input, ...]
    buffers: tuple[Buffer, ...]
    modes: tuple[Mode, ...]       # first mode is the training / default mode
    normalized: Named | None
    normalized_expr: sympy.Expr | None
    output: sympy.Expr
    output_text: str
    notes: tuple[str, ...] = field(default=())

    @property
    def symbols(self) -> dict[str, Named]:
        out: dict[str, Named] = {"x": _X_NAMED, "N": _N_NAMED}
        for group in (self.params, self.options, self.inputs, self.buffers):
            for item in group:
                out[item.name] = item
        for mode in self.modes:
            for st in mode.statistics:
                out[st.name] = st
        if self.normalized is not None:
            out[self.normalized.name] = self.normalized
        return out

    def mode(self, name: str | None = None) -> Mode:
        if name is None:
            return self.modes[0]
        for m in self.modes:
            if m.name == name:
                return m
        raise KeyError(name)


_X_NAMED = Named("x", X, "x", "x")
_N_NAMED = Named("N", N, "N", "N")

_GREEK = {"alpha": ("\\alpha", "α"), "beta": ("\\beta", "β"), "gamma": ("\\gamma", "γ"),
          "eps": ("\\varepsilon", "ε"), "mu": ("\\mu", "μ"), "sigma": ("\\sigma", "σ"),
          "momentum": ("m", "m")}


def catalogue_dir():
    return resources.files("derivgen") / "catalogue"


def catalogue_names() -> list[str]:
    return sorted(p.name[:-5] for p in catalogue_dir().iterdir() if p.name.endswith(".toml"))


def load_catalogue(name: str) -> Spec:
    if not isinstance(name, str) or not IDENT.match(name):
        raise SpecError(f"unknown layer {name!r}; known: {', '.join(catalogue_names())}")
    res = catalogue_dir() / f"{name}.toml"
    if not res.is_file():
        raise SpecError(f"unknown layer {name!r}; known: {', '.join(catalogue_names())}")
    return parse_spec(res.read_text(encoding="utf-8"), source=f"catalogue/{name}.toml")


def load_spec_file(path: str | Path) -> Spec:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{p}: cannot read spec: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p}: spec is not UTF-8 text") from None
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", p.name)[:80]     # it is printed into generated headers
    return parse_spec(text, source=safe)


class _Ctx:
    def __init__(self, source: str, data: dict):
        self.source = source
        self.data = data

    def err(self, where: str, msg: str):
        raise SpecError(f"{self.source}: {where}: {msg}")

    def table(self, key: str, required: bool = False) -> dict:
        v = self.data.get(key, None)
        if v is None:
            if required:
                self.err(key, "missing required table")
            return {}
        if not isinstance(v, dict):
            self.err(key, "must be a table")
        return v

    def string(self, where: str, v: Any, *, allow_empty=False) -> str:
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            self.err(where, "must be a non-empty string")
        if len(v) > 2000:
            self.err(where, "string too long")
        return v

    def prose(self, where: str, v: Any, *, allow_empty=False) -> str:
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
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.err(where, f"must be a finite number, got {v!r}")
        return float(v)

    def ident(self, where: str, name: str, taken: dict) -> str:
        if not IDENT.match(name) or keyword.iskeyword(name) or name in C_RESERVED \
                or name in ENGINE_RESERVED or name.startswith(("d_", "tmp", "acc", "mean_", "sum_", "k_", "grad_", "cse", "_")) \
                or name.endswith(RESERVED_SUFFIXES):
            self.err(where, f"invalid or reserved name {name!r} (lower-case identifier, "
                            "not a C/Python keyword nor one of derivgen's own names)")
        if name in taken:
            self.err(where, f"name {name!r} is already declared as {taken[name]}")
        return name

    def display(self, where: str, name: str, entry: dict) -> tuple[str, str]:
        latex, text = _GREEK.get(name, (None, None))
        if latex is None:
            latex = "\\mathrm{%s}" % name.replace("_", "\\_")
            text = name
        if "latex" in entry:
            latex = self.string(f"{where}.latex", entry["latex"])
            if re.search(r"\\(input|include|write|openout|immediate|def|catcode|read)", latex):
                self.err(f"{where}.latex", "TeX primitives are not allowed")
        if "text" in entry:
            text = self.string(f"{where}.text", entry["text"])
        return latex, text

    def keys(self, where: str, entry: dict, allowed: set[str]):
        extra = set(entry) - allowed
        if extra:
            self.err(where, f"unknown field(s) {', '.join(sorted(extra))} "
                            f"(allowed: {', '.join(sorted(allowed))})")


def _entry(ctx: _Ctx, where: str, v: Any, main: str | None) -> dict:
    """A table entry, or a bare value standing for its ``main`` field."""
    if isinstance(v, dict):
        return v
    if main is None:
        ctx.err(where, "must be a table")
    return {main: v}


def parse_spec(text: str, source: str = "<spec>") -> Spec:
    if len(text) > 200_000:
        raise SpecError(f"{source}: spec file too large")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: invalid TOML: {exc}") from None
    ctx = _Ctx(source, data)
    ctx.keys("<top level>", data, {"name", "title", "summary", "notes", "layout", "params",
                                   "options", "inputs", "buffers", "statistics", "normalized",
                                   "output", "modes"})
    if "name" not in data:
        ctx.err("name", "missing required field")
    name = ctx.string("name", data["name"])
    if not IDENT.match(name):
        ctx.err("name", f"must be a lower-case identifier, got {name!r}")
    title = ctx.prose("title", data.get("title", name))
    summary = ctx.prose("summary", data.get("summary", ""), allow_empty=True)
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        ctx.err("notes", "must be a list of strings")
    notes = [ctx.prose(f"notes[{i}]", n) for i, n in enumerate(notes)]

    layout_t = ctx.table("layout", required=True)
    ctx.keys("layout", layout_t, {"kind", "reduce", "axes"})
    kind = layout_t.get("kind")
    if kind not in LAYOUTS:
        ctx.err("layout.kind", f"must be one of {', '.join(LAYOUTS)}, got {kind!r}")
    reduce_ = layout_t.get("reduce", LAYOUTS[kind][0])
    if reduce_ not in LAYOUTS[kind]:
        ctx.err("layout.reduce", f"for kind {kind!r} must be one of "
                                 f"{', '.join(LAYOUTS[kind])}, got {reduce_!r}")

    axes = layout_t.get("axes", 1)
    if isinstance(axes, bool) or not isinstance(axes, int) or not 1 <= axes <= 8:
        ctx.err("layout.axes", f"must be an integer in 1..8, got {axes!r}")
    if "axes" in layout_t and kind != "trailing":
        ctx.err("layout.axes", "only a 'trailing' layout has normalized axes to count")

    taken: dict[str, str] = {}
    names: dict[str, sympy.Expr] = {"x": X, "N": N}
    varying = {X}

    params = []
    for pname, v in ctx.table("params").items():
        where = f"params.{pname}"
        entry = _entry(ctx, where, v, None)
        ctx.keys(where, entry, {"init", "role", "shape", "latex", "text"})
        ctx.ident(where, pname, taken)
        role = entry.get("role", "scale")
        if role not in ("scale", "shift"):
            ctx.err(f"{where}.role", "must be 'scale' or 'shift'")
        shape = entry.get("shape", "channel")
        if shape not in ("channel", "scalar"):
            ctx.err(f"{where}.shape", f"must be 'channel' (one value per channel / normalized feature) or "
                                      f"'scalar', got {shape!r}")
        init = ctx.number(f"{where}.init", entry.get("init", 1.0 if role == "scale" else 0.0))
        sym = sympy.Symbol(pname)
        params.append(Param(pname, sym, *ctx.display(where, pname, entry), init=init, role=role,
                            scalar=shape == "scalar"))
        taken[pname] = "a parameter"
        names[pname] = sym
        varying.add(sym)

    options = []
    for oname, v in ctx.table("options").items():
        where = f"options.{oname}"
        entry = _entry(ctx, where, v, "default")
        ctx.keys(where, entry, {"default", "min", "max", "latex", "text"})
        ctx.ident(where, oname, taken)
        lo = ctx.number(f"{where}.min", entry["min"]) if "min" in entry else None
        hi = ctx.number(f"{where}.max", entry["max"]) if "max" in entry else None
        default = ctx.number(f"{where}.default", entry["default"]) if "default" in entry else None
        if default is not None and ((lo is not None and default < lo) or (hi is not None and default > hi)):
            ctx.err(f"{where}.default", f"{default} is outside [{lo}, {hi}]")
        sym = sympy.Symbol(oname, real=True)
        options.append(Option(oname, sym, *ctx.display(where, oname, entry),
                              default=default, min=lo, max=hi))
        taken[oname] = "an option"
        names[oname] = sym

    inputs = []
    for iname, v in ctx.table("inputs").items():
        where = f"inputs.{iname}"
        entry = _entry(ctx, where, v, None)
        ctx.keys(where, entry, {"latex", "text"})
        ctx.ident(where, iname, taken)
        sym = sympy.Symbol(iname, real=True)
        inputs.append(Input(iname, sym, *ctx.display(where, iname, entry)))
        taken[iname] = "an input"
        names[iname] = sym

    buffer_entries = []
    for bname, v in ctx.table("buffers").items():
        where = f"buffers.{bname}"
        entry = _entry(ctx, where, v, None)
        ctx.keys(where, entry, {"init", "update", "latex", "text"})
        ctx.ident(where, bname, taken)
        if "update" not in entry:
            ctx.err(f"{where}.update", "missing required field")
        sym = sympy.Symbol(bname, real=True)
        buffer_entries.append((bname, where, entry, sym))
        taken[bname] = "a buffer"
        names[bname] = sym

    stat_order = list(ctx.table("statistics").keys())

    def parse(where: str, text: Any, scope: dict, reductions: bool = True) -> sympy.Expr:
        t = ctx.string(where, text)
        try:
            return parse_expr(t, scope, group_size=N, allow_reductions=reductions)
        except ExprError as exc:
            msg = str(exc)
            m = re.match(r"unknown name '([a-z0-9_]+)'", msg)
            if m and m.group(1) in stat_order:
                msg = (f"statistic {m.group(1)!r} is used before it is defined (statistics are evaluated in "
                       f"order and may refer only to earlier ones; cycles are not allowed): {t!r}")
            ctx.err(where, msg)

    def statistics(where_root: str, table: dict, base: dict[str, Statistic] | None):
        scope = dict(names)
        out: list[Statistic] = []
        local_taken = dict(taken)
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
                    entry = _entry(ctx, where, table[sname], "expr")
                    ctx.keys(where, entry, {"expr"})
                    expr_text = entry["expr"]
                    expr = parse(f"{where}.expr", expr_text, scope)
                else:
                    expr_text, expr = prev.expr_text, None
                    expr = parse(f"{where}.expr", expr_text, scope)
                st = Statistic(sname, prev.symbol, prev.latex, prev.text, expr=expr, expr_text=expr_text)
            else:
                entry = _entry(ctx, where, v, "expr")
                ctx.keys(where, entry, {"expr", "latex", "text"})
                ctx.ident(where, sname, local_taken)
                if "expr" not in entry:
                    ctx.err(f"{where}.expr", "missing required field")
                expr = parse(f"{where}.expr", entry["expr"], scope)
                st = Statistic(sname, sympy.Symbol(sname, real=True), *ctx.display(where, sname, entry),
                               expr=expr, expr_text=entry["expr"])
                local_taken[sname] = "a statistic"
            scope[sname] = st.symbol
            out.append(st)
        return out, scope

    stats_t = ctx.table("statistics", required=True)
    if not stats_t:
        ctx.err("statistics", "at least one statistic is required")
    train_stats, scope = statistics("statistics", stats_t, None)
    for st in train_stats:
        taken[st.name] = "a statistic"

    modes_t = ctx.table("modes")
    mode_specs: list[tuple[str, dict]] = []
    for mname, mt in modes_t.items():
        where = f"modes.{mname}"
        if mname not in ("train", "eval"):
            ctx.err(where, "modes may be 'train' or 'eval'")
        if not isinstance(mt, dict):
            ctx.err(where, "must be a table")
        ctx.keys(where, mt, {"statistics", "min_group_size"})
        mode_specs.append((mname, mt))
    train_min = 1
    for mname, mt in mode_specs:
        if mname == "train":
            train_min = int(ctx.number("modes.train.min_group_size", mt.get("min_group_size", 1)))
    modes = [Mode("train", tuple(train_stats), train_min)]
    for mname, mt in mode_specs:
        if mname != "eval":
            continue
        st_t = mt.get("statistics", {})
        if not isinstance(st_t, dict):
            ctx.err("modes.eval.statistics", "must be a table")
        eval_stats, _ = statistics("modes.eval.statistics", st_t,
                                   {s.name: s for s in train_stats})
        modes.append(Mode("eval", tuple(eval_stats),
                          int(ctx.number("modes.eval.min_group_size", mt.get("min_group_size", 1)))))

    buffers = []
    for bname, where, entry, sym in buffer_entries:
        upd = parse(f"{where}.update", entry["update"], scope, reductions=False)
        buffers.append(Buffer(bname, sym, *ctx.display(where, bname, entry),
                              init=ctx.number(f"{where}.init", entry.get("init", 0.0)),
                              update=upd, update_text=entry["update"]))

    # the normalized coordinate (optional but strongly recommended)
    normalized = normalized_expr = None
    out_scope = dict(scope)
    norm_t = data.get("normalized")
    if norm_t is not None:
        if not isinstance(norm_t, dict):
            ctx.err("normalized", "must be a table")
        ctx.keys("normalized", norm_t, {"name", "expr", "latex", "text"})
        for f in ("name", "expr"):
            if f not in norm_t:
                ctx.err(f"normalized.{f}", "missing required field")
        nname = ctx.ident("normalized.name", ctx.string("normalized.name", norm_t["name"]), taken)
        normalized_expr = parse("normalized.expr", norm_t["expr"], scope, reductions=False)
        if not normalized_expr.has(X):
            ctx.err("normalized.expr", "must depend on x")
        nsym = sympy.Symbol(nname)
        normalized = Named(nname, nsym, *ctx.display("normalized", nname, norm_t))
        out_scope[nname] = nsym
        taken[nname] = "the normalized coordinate"

    out_t = data.get("output")
    if out_t is None:
        ctx.err("output", "missing required field")
    if isinstance(out_t, dict):
        ctx.keys("output", out_t, {"y"})
        out_t = out_t.get("y")
    output = parse("output", out_t, out_scope, reductions=False)
    if normalized is not None:
        output_full = output.xreplace({normalized.symbol: normalized_expr})
    else:
        output_full = output
    if not output_full.has(X):
        ctx.err("output", "must depend on x")

    # gradients are named d<name>: a declared d<name> would collide with one
    declared = [n for n in taken] + [st.name for st in train_stats]
    for n in declared:
        if "d" + n in declared:
            ctx.err(n, f"names {n!r} and {'d' + n!r} collide: the gradient of {n!r} is called {'d' + n!r}")
    # every statistic must be used, and statistics may not use later ones
    # (guaranteed by scoping); statistics must not reference parameters
    for mode in modes:
        for st in mode.statistics:
            if st.expr.free_symbols & {p.symbol for p in params}:
                ctx.err(f"statistics.{st.name}.expr", "statistics may not depend on parameters")
    return Spec(name=name, title=title, summary=summary, source=source, layout=kind,
                reduce=reduce_, axes=axes, params=tuple(params), options=tuple(options),
                inputs=tuple(inputs), buffers=tuple(buffers), modes=tuple(modes),
                normalized=normalized, normalized_expr=normalized_expr, output=output,
                output_text=str(out_t), notes=tuple(notes))
