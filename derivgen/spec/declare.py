"""The first half of reading a spec's TOML data: typed access to its fields
(:class:`FieldReader`, every error a :class:`SpecError` naming the source and the field) and
the sections that declare names (:class:`Declarations`: the header, the layout, parameters,
options, inputs, tensor inputs, values and buffers). :mod:`derivgen.spec.parse` reads the
statistics, the output and what reads them, and assembles the :class:`Spec`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any, NoReturn

import sympy

from derivgen.spec.expr import ExprError, leading_option, parse_expr
from derivgen.spec.model import (
    _GREEK,
    IDENT,
    LAYOUTS,
    TENSOR_SHAPES,
    Input,
    N,
    Option,
    Param,
    SpecError,
    Tensor,
    Value,
    X,
    reserved_reason,
)
from derivgen.symbolic import domain
from derivgen.symbolic.domain import domain_error
from derivgen.symbolic.window import Window


class FieldReader:
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

    def entries(self, section: str, main: str | None, allowed: set[str]) -> Iterator[tuple[str, str, dict]]:
        """(name, field, entry) of each entry of the top-level table ``section``, in order: a
        table with fields in ``allowed``, or a bare value standing for its ``main`` field."""
        for name, v in self.table(section).items():
            where = f"{section}.{name}"
            entry = self.entry(where, v, main)
            self.keys(where, entry, allowed)
            yield name, where, entry

    def entry(self, where: str, v: Any, main: str | None) -> dict:
        """A table entry, or a bare value standing for its ``main`` field."""
        if isinstance(v, dict):
            return v
        if main is None:
            self.err(where, "must be a table")
        return {main: v}


class Declarations:
    """parse_spec's state -- the declared names so far and their symbols -- and the readers of
    the sections that declare names (the statistics and what reads them: :mod:`derivgen.spec.parse`)."""

    def __init__(self, ctx: FieldReader) -> None:
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
        for pname, where, entry in ctx.entries("params", None, {"init", "role", "shape", "latex", "text"}):
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
        for oname, where, entry in ctx.entries(
            "options", "default", {"default", "min", "max", "integer", "latex", "text"}
        ):
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

    def inputs(self) -> list[Input]:
        """The per-group differentiable inputs, declared."""
        ctx, out = self.ctx, []
        for iname, where, entry in ctx.entries("inputs", None, {"latex", "text"}):
            sym = domain.symbol(iname)
            self.declare(where, iname, "an input", sym)
            out.append(Input(iname, sym, *ctx.display(where, iname, entry)))
        return out

    def tensors(self, layout: str) -> list[Tensor]:
        """The tensor inputs beside x, declared (each an element symbol)."""
        ctx, out = self.ctx, []
        for tname, where, entry in ctx.entries("tensors", None, {"shape", "grad", "mask", "latex", "text"}):
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
        for vname, where, entry in ctx.entries("values", "expr", {"expr", "latex", "text"}):
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
        for bname, where, entry in ctx.entries("buffers", None, {"init", "update", "latex", "text"}):
            if "update" not in entry:
                ctx.err(f"{where}.update", "missing required field")
            sym = domain.symbol(bname)
            self.declare(where, bname, "a buffer", sym)
            out.append((bname, where, entry, sym))
        return out
