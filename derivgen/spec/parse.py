"""Reading a spec: the TOML text parsed and validated into a frozen :class:`Spec`
(:func:`parse_spec`). :mod:`derivgen.spec.declare` reads the fields and the sections that
declare names; this module the statistics of every mode (each one value per group, or per
block), the buffers' updates, the normalized coordinate, the output and the outputs beside
it, the value the statistics read in place of x, the masks and windows the expressions
use, and puts the spec together. Every expression goes through :mod:`derivgen.spec.expr`;
nothing is evaluated as code.
"""

from __future__ import annotations

import dataclasses
import tomllib

import sympy

from derivgen.spec.declare import Declarations, FieldReader
from derivgen.spec.expr import leading_option, leading_symbol
from derivgen.spec.model import (
    BlockStatistic,
    Buffer,
    Mask,
    Mode,
    Named,
    Option,
    Output,
    Spec,
    SpecError,
    Statistic,
    Tensor,
    Value,
    WindowValue,
    X,
)
from derivgen.symbolic import domain
from derivgen.symbolic.block import BlockFacts, BlockMean, block_kinds
from derivgen.symbolic.reduce import GroupMax, Mean, hide_reductions, selections
from derivgen.symbolic.window import Window

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


class _Parser(Declarations):
    """parse_spec's reader: the declarations (:class:`Declarations`), then the statistics and
    everything that reads them."""

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

    # ---- masks and windows: once every expression is read ---------------
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
    ctx = FieldReader(source, data)
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
