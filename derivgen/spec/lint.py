"""Lint for specs: what is valid but almost certainly a mistake, as plain data.

A spec that parses is a layer derivgen derives, proves and generates; some valid specs
still do not do what their author meant. :func:`lint` returns one :class:`LintWarning`
(file, field, message) for each of:

* **unused**: a parameter, option, input, tensor input, value, statistic or normalized
  coordinate that nothing reads (a parameter's gradient is then 0, and training leaves
  it unchanged); a parameter read only inside ``stop_gradient`` or by buffer updates
  (its gradient is 0 too);
* **domain**: a division by (a negative power of), a logarithm of, or a fractional power
  of a value the domain analysis (:mod:`derivgen.symbolic.domain`) cannot prove positive,
  where a group of values makes it zero (or negative): ``1/sqrt(var)`` without eps is
  zero when every element of a group is equal. The values are found by evaluating the
  spec on simple groups -- every element equal, every element 0, a group of one element
  where ``min_group_size`` allows it -- with the options at their defaults, the parameters
  at their initial values and the buffers at theirs; a value the analysis cannot prove
  positive and that no such group makes zero is not reported (no false warnings);
* **constant**: a statistic that reads the data and still has the same value on every
  group (``mean(x - mean(x))``), or that is a plain number.

Nothing here changes the spec or refuses it: the CLI prints the warnings (``derivgen
lint``; ``derive`` and ``check`` on stderr) and ``--strict`` makes them errors.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import sympy

from derivgen.spec.model import BlockStatistic, Mode, Spec, X
from derivgen.symbolic import domain, functions
from derivgen.symbolic.block import BlockMean
from derivgen.symbolic.reduce import GroupMax, GroupMin, Mean
from derivgen.symbolic.window import Window

__all__ = ["LintWarning", "lint"]

KINDS = ("unused", "domain", "constant")


@dataclass(frozen=True, order=True)
class LintWarning:
    """One warning: the spec's file (its ``source``), the field (``params.alpha``,
    ``statistics.rstd``), the message, and its kind (``unused``, ``domain``, ``constant``)."""

    file: str
    field: str
    message: str
    kind: str = "unused"

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.message}"


def lint(spec: Spec, *, all_zero: bool = False) -> tuple[LintWarning, ...]:
    """The warnings of a parsed spec: the unused names, then the domain hazards, then the
    constant statistics (no duplicates). ``all_zero`` also reports a value that only the
    group of zeros makes zero (weight normalization's norm, an RMS norm without eps): every
    layer that divides by a norm of x is undefined there by its definition, so it is off by
    default."""
    out: list[LintWarning] = []
    for field, message, kind in (*_unused(spec), *_domain(spec, all_zero), *_constant(spec)):
        w = LintWarning(spec.source, field, message, kind)
        if w not in out:
            out.append(w)
    return tuple(out)


# ---------------------------------------------------------------- where each expression is


def _output_field(spec: Spec) -> str:
    return "output.y" if spec.outputs else "output"


def _stat_field(mode: Mode, name: str) -> str:
    return f"statistics.{name}" if mode.name == "train" else f"modes.{mode.name}.statistics.{name}"


def _mode_stats(mode: Mode) -> tuple:
    return (*mode.statistics, *mode.blocks)


# ---------------------------------------------------------------- unused


def _without_stop_gradient(e: sympy.Expr) -> sympy.Expr:
    """``e`` with every stop_gradient(...) taken out (what a gradient can flow through)."""
    fn = functions.TABLE["stop_gradient"]
    stopped = sympy.Dummy("stopped", real=True)  # a value without a gradient
    return e.replace(lambda n: fn.node is not None and isinstance(n, fn.node), lambda *a: stopped)


def _reads(spec: Spec, mode: Mode, differentiable: bool) -> dict[sympy.Symbol, set[sympy.Symbol]]:
    """What each defined symbol of ``mode`` reads (its definition's free symbols, masks by
    their option); with ``differentiable``, only through what a gradient flows through."""

    def syms(e: sympy.Expr) -> set[sympy.Symbol]:
        if differentiable:
            e = _without_stop_gradient(e)
        return set(e.free_symbols)

    reads: dict[sympy.Symbol, set[sympy.Symbol]] = {}
    for st in _mode_stats(mode):
        reads[st.symbol] = syms(st.expr)
    for v in spec.values:
        reads[v.symbol] = syms(v.expr)
    if spec.normalized is not None and spec.normalized_expr is not None:
        reads[spec.normalized.symbol] = syms(spec.normalized_expr)
    for w in spec.windows:
        reads[w.symbol] = syms(w.body) | set(w.size.free_symbols)
    for m in spec.masks:
        opt = next((o.symbol for o in spec.options if o.name == m.option), None)
        reads[m.symbol] = {opt} if opt is not None else set()
    return reads


def _closure(roots: Iterable[sympy.Symbol], reads: dict[sympy.Symbol, set[sympy.Symbol]]) -> set[sympy.Symbol]:
    seen: set[sympy.Symbol] = set()
    todo = list(roots)
    while todo:
        s = todo.pop()
        if s in seen:
            continue
        seen.add(s)
        todo.extend(reads.get(s, ()))
    return seen


def _roots(spec: Spec, differentiable: bool) -> set[sympy.Symbol]:
    """The symbols the outputs read (y and the outputs beside it)."""
    exprs = [spec.output, *(o.expr for o in spec.outputs)]
    if differentiable:
        exprs = [_without_stop_gradient(e) for e in exprs]
    return set().union(*(e.free_symbols for e in exprs))


def _unused(spec: Spec) -> Iterator[tuple[str, str, str]]:
    used: set[sympy.Symbol] = set()  # read by an output or a buffer update, in some mode
    grad: set[sympy.Symbol] = set()  # reached by a gradient from an output, in some mode
    for mode in spec.modes:
        used |= _closure(_roots(spec, False), _reads(spec, mode, False))
        grad |= _closure(_roots(spec, True), _reads(spec, mode, True))
    if spec.buffers:  # the buffers' updates run in training mode, with its statistics
        train = spec.modes[0]
        upd = set().union(*(b.update.free_symbols for b in spec.buffers))
        used |= _closure(upd, _reads(spec, train, False))
    if spec.core is not None:  # the statistics read x and the tensors through the core value
        used |= set(spec.core.expr.free_symbols) if spec.core.symbol in used else set()
    for p in spec.params:
        if p.symbol in grad:
            continue
        where = f"params.{p.name}"
        if p.symbol in used:
            yield (
                where,
                (
                    "read only inside stop_gradient() or by buffer updates, which are not differentiated "
                    "(its gradient is 0 and training leaves it unchanged)"
                ),
                "unused",
            )
        else:
            yield where, "used nowhere (its gradient is 0 and training leaves it unchanged)", "unused"
    for o in spec.options:
        if o.symbol not in used:
            yield f"options.{o.name}", "used nowhere (setting it changes nothing)", "unused"
    for i in spec.inputs:
        if i.symbol not in used:
            yield f"inputs.{i.name}", "used nowhere (its gradient is 0 and its value changes nothing)", "unused"
    for t in spec.tensors:
        if t.symbol not in used:
            yield f"tensors.{t.name}", "used nowhere (its value changes nothing)", "unused"
    # the spec inlines every value but the core where it is read: find those by their names
    texts = [("", spec.output_text), *(("", o.expr_text) for o in spec.outputs)]
    texts += [(v.name, v.expr_text) for v in spec.values]
    texts += [("", st.expr_text) for m in spec.modes for st in _mode_stats(m)]
    texts += [("", b.update_text) for b in spec.buffers]
    output_names = {o.name for o in spec.outputs}
    for v in spec.values:
        read = any(re.search(rf"\b{re.escape(v.name)}\b", t) for owner, t in texts if owner != v.name)
        if v.symbol not in used and v.name not in output_names and not read:
            yield f"values.{v.name}", "used nowhere (no statistic and no output reads it)", "unused"
    seen: set[str] = set()
    for mode in spec.modes:
        for st in _mode_stats(mode):
            if st.aux or st.name in seen:
                continue
            if not any(s.symbol in used for m in spec.modes for s in _mode_stats(m) if s.name == st.name):
                seen.add(st.name)
                yield (
                    _stat_field(mode, st.name),
                    "used nowhere (no output, statistic or buffer update reads it; the forward computes it for nothing)",
                    "unused",
                )
    if spec.normalized is not None and spec.normalized.symbol not in used:
        yield (
            "normalized.name",
            (
                f"{spec.normalized.name} is used nowhere: the output does not read it, so the closed forms are "
                "not written in it"
            ),
            "unused",
        )


# ---------------------------------------------------------------- evaluation on simple groups


class _Undefined(Exception):
    """A value is undefined on the group (a division by zero, a root of a negative value)."""


@dataclass
class _Group:
    """A group of element values with a value for every other symbol: ``points`` holds each
    element's element symbols (x, tensors, masks, per-channel parameters, values), ``env`` the
    group-level ones (options, scalar parameters, inputs, buffers, N, statistics)."""

    points: list[dict[sympy.Symbol, float]]
    env: dict[sympy.Symbol, float]


def _value(e: sympy.Expr, g: _Group, point: dict[sympy.Symbol, float] | None) -> float:
    """``e`` evaluated on group ``g`` (at one element ``point`` for element values)."""
    if e.is_Symbol:
        if point is not None and e in point:
            return point[e]
        if e in g.env:
            v = g.env[e]
            if isinstance(v, float) and math.isnan(v):
                raise _Undefined(str(e))
            return v
        if point is None and g.points and e in g.points[0]:  # an element value the group shares
            return g.points[0][e]
        raise _Undefined(f"no value for {e}")
    if e.is_number:
        v = complex(e)
        if v.imag:
            raise _Undefined(str(e))
        return v.real
    if isinstance(e, (Mean, BlockMean)):  # every block of a simple group is alike
        body = e.args[0]
        return math.fsum(_value(body, g, p) for p in g.points) / len(g.points)
    if isinstance(e, GroupMax):  # GroupMin too
        vals = [_value(e.args[0], g, p) for p in g.points]
        return min(vals) if isinstance(e, GroupMin) else max(vals)
    if isinstance(e, Window):  # an interior element of a constant group: k times the body
        return _value(e.size, g, point) * _value(e.body, g, point)
    if e.is_Add:
        return math.fsum(_value(a, g, point) for a in e.args)
    if e.is_Mul:
        out = 1.0
        for a in e.args:
            out *= _value(a, g, point)
        return out
    if e.is_Pow:
        b, q = _value(e.args[0], g, point), _value(e.args[1], g, point)
        if b == 0 and q < 0:
            raise _Undefined(f"division by zero: {e}")
        if b < 0 and q != int(q):
            raise _Undefined(f"a fractional power of a negative value: {e}")
        try:
            return float(b**q)
        except OverflowError:
            raise _Undefined(str(e)) from None
    fn = functions.of_node(e)
    if fn is not None:
        args = [_value(a, g, point) for a in e.args]
        try:
            v = fn.scalar(*args)
        except (ValueError, OverflowError, ZeroDivisionError):
            raise _Undefined(str(e)) from None
        return float(v)
    raise _Undefined(f"cannot evaluate {e}")


def _scalar_values(spec: Spec, mode: Mode) -> dict[sympy.Symbol, float]:
    """The group-level values the simple groups use: options at their defaults (a required
    option inside its bounds), scalar parameters at their initial values, inputs at 1,
    buffers at their initial values."""
    env: dict[sympy.Symbol, float] = {}
    for o in spec.options:
        if o.default is not None:
            v = o.default
        elif o.min is not None and o.max is not None:
            v = (o.min + o.max) / 2
        elif o.min is not None:
            v = o.min + 1
        elif o.max is not None:
            v = o.max - 1
        else:
            v = 1.0
        if o.integer:
            v = float(max(round(v), 1))
        env[o.symbol] = float(v)
    for p in spec.params:
        env[p.symbol] = float(p.init)
    for i in spec.inputs:
        env[i.symbol] = 1.0
    for b in spec.buffers:
        env[b.symbol] = float(b.init)
    return env


def _element_symbols(spec: Spec) -> dict[sympy.Symbol, float]:
    """Each element's values other than x (and the core value): tensors and masks at 1,
    per-channel parameters at their initial values."""
    pt: dict[sympy.Symbol, float] = {}
    for t in spec.tensors:
        pt[t.symbol] = 1.0
    for m in spec.masks:
        pt[m.symbol] = 1.0
    for p in spec.params:
        if not p.scalar:
            pt[p.symbol] = float(p.init)
    return pt


def _group(spec: Spec, mode: Mode, xs: list[float], n: int | None = None) -> _Group:
    """The group of elements ``xs`` (of size ``n``: N is ``len(xs)`` unless given) with its
    statistics computed in order (an undefined one is NaN)."""
    from derivgen.spec.model import N

    env = _scalar_values(spec, mode)
    env[N] = float(n if n is not None else len(xs))
    base = _element_symbols(spec)
    points = []
    for xv in xs:
        pt = dict(base)
        pt[X] = xv
        g0 = _Group([pt], env)
        for v in spec.values:
            pt[v.symbol] = _or_nan(v.expr, g0, pt)
        if spec.core is not None:  # the statistics read the core value: the pattern is its values
            pt[spec.core.symbol] = xv
        points.append(pt)
    g = _Group(points, env)
    for st in _mode_stats(mode):
        env[st.symbol] = _or_nan(st.expr, g, None)
    for w in spec.windows:
        for pt in points:
            pt[w.symbol] = _or_nan(w.expr, g, pt)
    if spec.normalized is not None and spec.normalized_expr is not None:
        for pt in points:
            pt[spec.normalized.symbol] = _or_nan(spec.normalized_expr, g, pt)
    return g


# ---------------------------------------------------------------- domain

_EQUAL = (0.75, -1.25, 2.5)  # the values of groups whose elements are all equal (exact in binary)
_SIZE = 8


def _show(e: sympy.Expr, spec: Spec) -> str:
    """``e`` as a spec would write it."""
    rep: dict = {w.symbol: w.expr for w in spec.windows}
    for m in spec.masks:
        rep[m.symbol] = sympy.Function("leading")(sympy.Symbol(m.option))
    text = str(e.xreplace(rep))
    return text.replace("GroupMax(", "max(").replace("GroupMin(", "min(").replace("Mean(", "mean(")


def _sites(spec: Spec) -> Iterator[tuple[str, Mode, sympy.Expr]]:
    """Every expression of the spec: (field, the mode it is evaluated in, expression)."""
    seen: set[tuple[str, sympy.Expr]] = set()
    for mode in spec.modes:
        for st in _mode_stats(mode):
            key = (st.name, st.expr)
            if key not in seen:
                seen.add(key)
                yield _stat_field(mode, st.name), mode, st.expr
    train = spec.modes[0]
    for v in spec.values:
        yield f"values.{v.name}.expr", train, v.expr
    for b in spec.buffers:
        yield f"buffers.{b.name}.update", train, b.update
    if spec.normalized is not None and spec.normalized_expr is not None:
        for mode in spec.modes:
            yield "normalized.expr", mode, spec.normalized_expr
    for mode in spec.modes:
        for w in spec.windows:
            yield _output_field(spec), mode, w.body
        yield _output_field(spec), mode, spec.output
        for o in spec.outputs:
            yield f"output.{o.name}", mode, o.expr


def _hazards(e: sympy.Expr) -> Iterator[tuple[sympy.Expr, str, sympy.Expr]]:
    """The nodes of ``e`` whose argument must be positive or non-negative: (node, what,
    argument), ``what`` one of ``divide`` (a negative integer power: not zero), ``rdivide``
    (a negative fractional power: positive), ``log`` (positive) and ``root`` (a fractional
    power: non-negative)."""
    for node in sympy.preorder_traversal(e):
        if node.is_Pow:
            b, q = node.args
            if q.is_number and q.is_negative:
                yield node, ("divide" if q.is_integer else "rdivide"), b
            elif q.is_number and not q.is_integer:
                yield node, "root", b
            continue
        fn = functions.of_node(node)
        if fn is not None and len(node.args) == 1 and fn.requires >= domain.NONNEG:
            yield node, ("log" if fn.requires == domain.POSITIVE else "root"), node.args[0]


def _bad(what: str, vals: list[float] | None) -> str | None:
    """What is wrong with the values ``vals`` of an argument that ``what`` needs (``zero``,
    ``negative``), or None. The simple groups' values are exact in binary: a zero is a zero."""
    if vals is None:
        return None
    tol = 1e-30
    if what != "root" and any(abs(v) <= tol for v in vals):
        return "zero"
    if what != "divide" and any(v < -tol for v in vals):
        return "negative"
    return None


def _values_at(spec: Spec, mode: Mode, arg: sympy.Expr, xs: list[float], n: int | None = None) -> list[float] | None:
    """``arg`` at every element of the group ``xs``; None where it is undefined there for
    another reason (an earlier statistic already undefined)."""
    g = _group(spec, mode, xs, n)
    out = []
    for pt in g.points:
        try:
            out.append(_value(arg, g, pt))
        except _Undefined:
            return None
    return out


def _witness(spec: Spec, mode: Mode, what: str, arg: sympy.Expr, all_zero: bool) -> tuple[str, str] | None:
    """(what is wrong, the simple groups on which it is, in words), or None."""
    core = spec.core.name if spec.core is not None else None
    elem = f"value {core}" if core else "element"
    hits = [_bad(what, _values_at(spec, mode, arg, [c] * _SIZE)) for c in _EQUAL]
    if all(hits):
        spread = _bad(what, _values_at(spec, mode, arg, [0.25 * k - 1 for k in range(_SIZE)]))
        if spread:
            return (
                spread,
                "for any group, with the options at their defaults and the parameters at their initial values",
            )
        return hits[0], f"when every {elem} of a group is equal"
    for c in (0.0, 1.0, -1.0) if all_zero else (1.0, -1.0):
        bad = _bad(what, _values_at(spec, mode, arg, [c] * _SIZE))
        if bad:
            return bad, f"when every {elem} of a group is {c:g}"
    if mode.min_group_size < 2:
        bad = _bad(what, _values_at(spec, mode, arg, [0.75], 1))
        if bad:
            return bad, f"for a group of one element (set [modes.{mode.name}] min_group_size = 2)"
    if any(hits):
        c = _EQUAL[hits.index(next(h for h in hits if h))]
        return next(h for h in hits if h), f"when every {elem} of a group is {c:g}"
    return None


def _describe(node: sympy.Expr, what: str, arg: sympy.Expr, spec: Spec) -> str:
    if what in ("divide", "rdivide"):
        q = node.args[1]
        if q == -1:
            shown = _show(arg, spec)
        elif q == sympy.Rational(-1, 2):
            shown = f"sqrt({_show(arg, spec)})"
        else:
            shown = _show(arg**-q, spec)
        return f"division by {shown}"
    if what == "log":
        return f"logarithm of {_show(arg, spec)}"
    return f"{_show(node, spec)}, a fractional power of {_show(arg, spec)}"


def _domain(spec: Spec, all_zero: bool) -> Iterator[tuple[str, str, str]]:
    told: set[tuple[str, str]] = set()
    for field, mode, expr in _sites(spec):
        for node, what, arg in _hazards(expr):
            level = domain.sign_level(arg)
            if level == domain.POSITIVE or (what == "root" and level >= domain.NONNEG):
                continue
            found = _witness(spec, mode, what, arg, all_zero)
            if found is None:
                continue
            bad, where = found
            head = _describe(node, what, arg, spec)
            if (field, head) in told:
                continue
            told.add((field, head))
            hint = " (add eps where it is 0)" if bad == "zero" and "equal" in where else ""
            mode_note = f" in {mode.name} mode" if len(spec.modes) > 1 and not field.startswith("modes.") else ""
            if bad == "negative":
                what_is = f"where {_show(arg, spec)} is negative"
            else:
                what_is = "which is zero" if what != "log" else f"where {_show(arg, spec)} is zero"
            yield field, f"{head}, {what_is} {where}{mode_note}{hint}", "domain"


# ---------------------------------------------------------------- constant statistics


def _random_group(spec: Spec, mode: Mode, rng: random.Random, n: int) -> _Group:
    """A group of ``n`` random elements with random parameters, inputs and buffers."""
    from derivgen.spec.model import N

    env = _scalar_values(spec, mode)
    for s in [*spec.params, *spec.inputs, *spec.buffers]:
        if s.symbol in env:
            env[s.symbol] = rng.uniform(0.5, 1.5)
    env[N] = float(n)
    points = []
    for _ in range(n):
        pt = _element_symbols(spec)
        for p in spec.params:
            if not p.scalar:
                pt[p.symbol] = rng.uniform(0.5, 1.5)
        for t in spec.tensors:
            pt[t.symbol] = float(rng.random() < 0.8) if t.mask else rng.uniform(-1, 1)
        pt[X] = rng.uniform(-2, 2)
        g0 = _Group([pt], env)
        for v in spec.values:
            pt[v.symbol] = _or_nan(v.expr, g0, pt)
        points.append(pt)
    g = _Group(points, env)
    for st in _mode_stats(mode):
        env[st.symbol] = _or_nan(st.expr, g, None)
    return g


def _or_nan(expr: sympy.Expr, group, pt):
    """``_value``, or NaN where the expression is undefined at the point."""
    try:
        return _value(expr, group, pt)
    except _Undefined:
        return math.nan


def _data_symbols(spec: Spec) -> set[sympy.Symbol]:
    out = {X, *(t.symbol for t in spec.tensors), *(v.symbol for v in spec.values), *spec.mask_symbols}
    return out


def _constant(spec: Spec) -> Iterator[tuple[str, str, str]]:
    data = _data_symbols(spec)
    told: set[str] = set()
    for mode in spec.modes:
        flagged: set[sympy.Symbol] = set()  # a statistic constant through these is not told again
        full: dict[sympy.Symbol, sympy.Expr] = {}
        for st in _mode_stats(mode):
            full[st.symbol] = st.expr.xreplace(full)
        groups: list[_Group] | None = None
        for st in _mode_stats(mode):
            if st.name in told or st.aux or st.expr.free_symbols & flagged:
                continue
            e = full[st.symbol]
            if e.is_number and mode.name != spec.modes[0].name:
                continue  # a mode redefining a statistic as a number (batch renorm's eval r = 1) switches it off
            if e.is_number:
                told.add(st.name)
                flagged.add(st.symbol)
                yield (
                    _stat_field(mode, st.name),
                    f"constant: it is {e} on every group (write the number where it is used)",
                    "constant",
                )
                continue
            if not (e.free_symbols & data) or isinstance(st, BlockStatistic) or e.has(Window):
                continue
            if groups is None:
                rng = random.Random(12345)
                groups = [_random_group(spec, mode, rng, n) for n in (5, 7, 9, 6)]
            vals = [g.env[st.symbol] for g in groups]
            if any(math.isnan(v) for v in vals):
                continue
            scale = max(1.0, max(abs(v) for v in vals))
            if max(vals) - min(vals) <= 1e-9 * scale:
                told.add(st.name)
                flagged.add(st.symbol)
                shown = 0.0 if abs(vals[0]) < 1e-12 else vals[0]
                yield (
                    _stat_field(mode, st.name),
                    (
                        f"constant: it reads the data but is {shown:.6g} on every group "
                        f"({_show(st.expr, spec)} does not change with x)"
                    ),
                    "constant",
                )
