"""Restricted expression language for specs.

Spec expressions are parsed with Python's :mod:`ast` into a syntax tree and
then *walked* by hand into SymPy objects.  Nothing is ever evaluated as code:
no ``eval``, no ``sympy.sympify``/``parse_expr`` (both call ``eval``).  Only
these forms are accepted:

* numbers (``2``, ``0.5``, ``1e-5``; converted exactly to rationals) and the
  constant ``pi``,
* declared names,
* ``+ - * / **`` and unary ``+``/``-``,
* the functions of :mod:`derivgen.symbolic.functions` (``sqrt(e)``, ``exp(e)``,
  ``log(e)``, ``abs(e)``, ``tanh(e)``, ``sigmoid(e)``, ``erf(e)``, ``stop_gradient(e)``,
  ``maximum(a, b)``, ``minimum(a, b)``, ``clip(e, lo, hi)``),
* the group reductions ``mean(e)``, ``sum(e)`` (``sum(e)`` is ``N*mean(e)``), ``max(e)`` and
  ``min(e)``,
* the block mean ``mean(e, "instance")`` (``"sample"``, ``"batch"``): in a channel layout,
  the mean of ``e`` over the block of the group the element lies in (its positions; its
  sample's channels and positions; its channel's samples and positions), an element value
  that is one value per block (:mod:`derivgen.symbolic.block`); a kind that spans the
  whole group is the group mean,
* the position mask ``leading(p)`` of an option ``p``: 1 on the first ⌊p·N⌋ elements of
  the group (in memory order), 0 on the rest -- an element value without a gradient, so
  ``mean(leading(p)*e)/mean(leading(p))`` is the mean of ``e`` over a leading slice,
* the window ``window(e, k)``: at each element, the sum of ``e`` over the ``k`` neighbouring
  elements of its group centred on it (zero padded; :mod:`derivgen.symbolic.window`), ``k``
  a positive integer or the name of an option.

Everything else -- attribute access, subscripts, lambdas, comprehensions,
keyword arguments, strings (but a block mean's kind), comparisons, calls to anything else -- is rejected
with a message naming the offending text.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from fractions import Fraction
from typing import NoReturn

import sympy

from derivgen.symbolic import functions
from derivgen.symbolic.block import block_mean
from derivgen.symbolic.reduce import GroupMax, GroupMin, Mean, hide_reductions
from derivgen.symbolic.window import Window

MAX_EXPR_CHARS = 2000
MAX_DEPTH = 40
MAX_NODES = 400
MAX_EXPONENT = 16  # |constant exponent| allowed in ``a ** k``

REDUCTIONS = ("mean", "sum", "max", "min")
BLOCK_SIZE_NAMES = ("size", "numel", "count", "block_size")  # what a user may try for a block's size
LEADING = "leading"
WINDOW = "window"


_LEADING_PREFIX = "Lead_"


def leading_symbol(option: str) -> sympy.Symbol:
    """The element symbol of ``leading(option)``: 1 on the first ⌊option·N⌋ elements of a
    group, 0 on the rest (a name in derivgen's upper-case namespace: no spec name reaches it)."""
    return sympy.Symbol(_LEADING_PREFIX + option, nonnegative=True)


def leading_option(sym: sympy.Basic) -> str | None:
    """The option of a ``leading(option)`` symbol, or None for any other expression."""
    name = getattr(sym, "name", "")
    return name[len(_LEADING_PREFIX) :] if sym.is_Symbol and name.startswith(_LEADING_PREFIX) else None


def _callable_names() -> str:
    """The functions a call may name, for messages: the table's, then the reductions."""
    return ", ".join((*functions.language(), *REDUCTIONS, LEADING, WINDOW))


def _arguments(n: int) -> str:
    """``n`` positional argument(s), in words for messages."""
    return "one positional argument" if n == 1 else f"{n} positional arguments"


class ExprError(ValueError):
    """A spec expression was rejected; the message names the offending text."""


def _short(text: str, limit: int = 80) -> str:
    """repr() of text, cut in the middle when long (error messages stay one readable line)."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit // 2 - 2] + "..." + r[-(limit // 2 - 2) :]


def parse_expr(
    text: str,
    names: Mapping[str, sympy.Expr],
    *,
    group_size: sympy.Expr,
    allow_reductions: bool = True,
    options: frozenset[str] = frozenset(),
    blocks: Mapping[str, str] | None = None,
) -> sympy.Expr:
    """Parse ``text`` into a SymPy expression over ``names``.

    ``names`` maps every identifier the expression may use to its SymPy object;
    ``group_size`` is the symbol ``sum(e)`` scales ``mean(e)`` by; ``options`` are the
    names ``leading()`` may take; ``blocks`` the block kinds ``mean(e, kind)`` may name
    (kind -> "block", or "group" where the kind spans the layout's group).
    """
    if not isinstance(text, str):
        raise ExprError(f"expected an expression string, got {type(text).__name__}")
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression is {len(text)} characters long (limit {MAX_EXPR_CHARS})")
    if not text.strip():
        raise ExprError("empty expression")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"bad syntax in {_short(text)}: {exc.msg}") from None
    except (ValueError, MemoryError, RecursionError):
        raise ExprError(f"cannot parse {_short(text)}") from None
    count = sum(1 for _ in ast.walk(tree))
    if count > MAX_NODES:
        raise ExprError(f"expression has {count} syntax nodes (limit {MAX_NODES})")
    return _Builder(text, names, group_size, allow_reductions, options, blocks or {}).build(tree.body, 0)


class _Builder:
    """The walk from a syntax tree to SymPy, one method per accepted form; anything else
    fails with a message naming the offending text."""

    def __init__(
        self,
        text: str,
        names: Mapping[str, sympy.Expr],
        group_size: sympy.Expr,
        allow_reductions: bool,
        options: frozenset[str] = frozenset(),
        blocks: Mapping[str, str] | None = None,
    ) -> None:
        self.text = text
        self.names = names
        self.group_size = group_size
        self.allow_reductions = allow_reductions
        self.options = options
        self.blocks = dict(blocks or {})

    def _snippet(self, node: ast.AST) -> str:
        """The source text of ``node`` (its node type where Python cannot give it)."""
        seg = ast.get_source_segment(self.text.strip(), node)
        return seg if seg is not None else type(node).__name__

    def fail(self, node: ast.AST, why: str) -> NoReturn:
        """Reject ``node``: an :class:`ExprError` naming its text and the whole expression."""
        raise ExprError(f"{why}: {_short(self._snippet(node), 60)} in {_short(self.text)}")

    def build(self, node: ast.AST, depth: int) -> sympy.Expr:
        """The SymPy expression of ``node``, ``depth`` levels down the tree."""
        if depth > MAX_DEPTH:
            self.fail(node, f"expression nested deeper than {MAX_DEPTH}")
        inner = depth + 1
        if isinstance(node, ast.Constant):
            return self.constant(node)
        if isinstance(node, ast.Name):
            return self.name(node)
        if isinstance(node, ast.UnaryOp):
            return self.unary(node, inner)
        if isinstance(node, ast.BinOp):
            return self.binary(node, inner)
        if isinstance(node, ast.Call):
            return self.call(node, inner)
        self.fail(node, f"unsupported syntax ({type(node).__name__})")

    def constant(self, node: ast.Constant) -> sympy.Expr:
        """A finite int or float, exactly: 0.1 is 1/10 (through its shortest decimal repr)."""
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(node, "only numeric constants are allowed")
        if isinstance(v, float) and not math.isfinite(v):
            self.fail(node, "non-finite constant")
        if isinstance(v, int) and abs(v) > 10**12:
            self.fail(node, "integer constant too large")
        return sympy.Rational(Fraction(repr(v))) if isinstance(v, float) else sympy.Integer(v)

    def name(self, node: ast.Name) -> sympy.Expr:
        """A declared name (a function's or reduction's name is not a value)."""
        if node.id in functions.language() or (node.id in (*REDUCTIONS, LEADING, WINDOW) and node.id not in self.names):
            self.fail(node, f"function {node.id!r} used as a value")
        if node.id not in self.names and node.id in functions.CONSTANTS:
            return functions.CONSTANTS[node.id]
        if node.id not in self.names:
            known = ", ".join(sorted(self.names)) or "none"
            self.fail(node, f"unknown name {node.id!r} (known: {known})")
        return self.names[node.id]

    def unary(self, node: ast.UnaryOp, depth: int) -> sympy.Expr:
        """``-e`` or ``+e``."""
        operand = self.build(node.operand, depth)
        if isinstance(node.op, ast.USub):
            return -operand
        if isinstance(node.op, ast.UAdd):
            return operand
        self.fail(node, "unsupported unary operator")

    def binary(self, node: ast.BinOp, depth: int) -> sympy.Expr:
        """``a + b``, ``a - b``, ``a * b``, ``a / b`` (not by a literal zero) and ``a ** k``
        (both operands are built first, left to right)."""
        left = self.build(node.left, depth)
        right = self.build(node.right, depth)
        op = node.op
        if isinstance(op, ast.Add):
            return left + right
        if isinstance(op, ast.Sub):
            return left - right
        if isinstance(op, ast.Mult):
            return left * right
        if isinstance(op, ast.Div):
            if right == 0:
                self.fail(node, "division by zero")
            return left / right
        if isinstance(op, ast.Pow):
            return self.power(node, left, right)
        self.fail(node, "unsupported operator (allowed: + - * / **)")

    def power(self, node: ast.BinOp, base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
        """``base ** exponent``: a real constant exponent of magnitude at most
        :data:`MAX_EXPONENT`, or one over declared names."""
        if exponent.is_number:
            if not exponent.is_real or abs(exponent) > MAX_EXPONENT:
                self.fail(node, f"constant exponent must be real with magnitude <= {MAX_EXPONENT}")
        elif not exponent.free_symbols:
            self.fail(node, "unsupported exponent")
        return sympy.Pow(base, exponent)

    def selection(self, kind: type, arg: sympy.Expr) -> sympy.Expr:
        """``max(e)`` or ``min(e)``; the terms of e that are one value per group (no x outside
        a reduction: max(x - mean(x)) is max(x) - mean(x)) come out of the selection."""
        x = self.names.get("x")
        terms = sympy.Add.make_args(arg)
        inner = [t for t in terms if x is not None and x in hide_reductions(t).free_symbols]
        if not inner or len(inner) == len(terms):
            return kind(arg)
        return kind(sympy.Add(*inner)) + sympy.Add(*[t for t in terms if t not in inner])

    def window(self, node: ast.Call, depth: int) -> sympy.Expr:
        """``window(e, k)``: ``e`` an element expression without reductions, ``k`` a positive
        integer or the name of an option (the spec checks that it is an integer option)."""
        body, size = node.args
        if isinstance(size, ast.Name):
            if size.id not in self.options:
                known = ", ".join(sorted(self.options)) or "none"
                self.fail(node, f"window()'s size must be a positive integer or an option (declared: {known})")
            k = self.names[size.id]
        else:
            k = self.build(size, depth)
            if not (k.is_Integer and k > 0):
                self.fail(node, "window()'s size must be a positive integer or an option")
        e = self.build(body, depth)
        if e.has(Mean, GroupMax, GroupMin):
            self.fail(node, "window() sums element values: its argument may not hold a group reduction")
        return Window(e, k, sympy.S.One)

    def block(self, node: ast.Call, depth: int) -> sympy.Expr:
        """``mean(e, "kind")``: the block mean of ``e`` (an element expression without group
        reductions), or the group mean where the kind spans the layout's group."""
        body, kind = node.args
        if not (isinstance(kind, ast.Constant) and isinstance(kind.value, str)):
            self.fail(node, 'mean()\'s second argument is a block kind in quotes, as mean(x, "instance")')
        if kind.value not in self.blocks:
            known = ", ".join(repr(k) for k in self.blocks) or "none: the layout's groups hold no smaller blocks"
            self.fail(node, f"block kind {kind.value!r} is not one of this layout's (allowed: {known})")
        if not self.allow_reductions:
            self.fail(node, "mean() is a reduction; define it under [statistics]")
        e = self.build(body, depth)
        if e.has(Mean, GroupMax, GroupMin):
            self.fail(node, "a block mean's argument may not hold a group reduction; name it as a statistic")
        return Mean(e) if self.blocks[kind.value] == "group" else block_mean(e, kind.value)

    def block_sum(self, node: ast.Call, depth: int) -> sympy.Expr:
        """``sum(e, "kind")``: N·mean(e) where the kind spans the layout's group; over a smaller
        block it would need the block's size, which cannot be written yet: refused, saying so."""
        kind = node.args[1]
        if not (isinstance(kind, ast.Constant) and isinstance(kind.value, str)) or kind.value not in self.blocks:
            self.block(node, depth)  # fails, saying what a kind is and which ones the layout has
        if self.blocks[kind.value] == "group":
            return self.group_size * self.block(node, depth)
        article = "an" if kind.value[0] in "aeiou" else "a"
        self.fail(
            node,
            f"sum(e, {kind.value!r}) needs the size of {article} {kind.value} block, and block sizes cannot "
            f"be written yet: use the block mean mean(e, {kind.value!r}) (an unbiased block variance, which "
            "divides by the block's size less one, is not available)",
        )

    def call(self, node: ast.Call, depth: int) -> sympy.Expr:
        """A call of a table function (derivgen.symbolic.functions) or of a group reduction."""
        if not isinstance(node.func, ast.Name):
            self.fail(node, f"only calls of {_callable_names()} are allowed")
        fname = node.func.id
        if fname == "mean" and len(node.args) == 2 and not node.keywords:
            return self.block(node, depth)
        if fname == "sum" and len(node.args) == 2 and not node.keywords:
            return self.block_sum(node, depth)
        if fname in BLOCK_SIZE_NAMES:
            self.fail(
                node,
                f"{fname}() is not part of the language: block sizes cannot be written yet "
                '(a block mean mean(e, "instance") can; N is the group\'s size)',
            )
        fn = functions.language().get(fname)
        arity = fn.arity if fn is not None else 2 if fname == WINDOW else 1
        if node.keywords:
            self.fail(node, f"{fname}() takes no keyword arguments: {_arguments(arity)}")
        if len(node.args) != arity or any(isinstance(a, ast.Starred) for a in node.args):
            self.fail(node, f"{fname}() takes exactly {_arguments(arity)}")
        if fname == LEADING:
            arg = node.args[0]
            if not isinstance(arg, ast.Name) or arg.id not in self.options:
                known = ", ".join(sorted(self.options)) or "none"
                self.fail(node, f"leading() takes the name of an option (declared: {known})")
            return leading_symbol(arg.id)
        if fname == WINDOW:
            return self.window(node, depth)
        if fname in REDUCTIONS:
            if not self.allow_reductions:
                self.fail(node, f"{fname}() is a group reduction; define it under [statistics]")
            arg = self.build(node.args[0], depth)
            if fname in ("max", "min"):
                return self.selection(GroupMax if fname == "max" else GroupMin, arg)
            return Mean(arg) if fname == "mean" else self.group_size * Mean(arg)
        if fn is not None:
            return fn.build(*(self.build(a, depth) for a in node.args))
        self.fail(node, f"unknown function {fname!r} (allowed: {_callable_names()})")
