"""Block means: means over a sub-block of a normalization group, as symbolic objects.

A channel layout's group holds the elements of several axes: a batch norm's group is one
channel over the samples and positions, a group of the ``all`` layout is the whole tensor.
A **block** is a smaller set of those elements, named by the axes it spans:

==========  ======================================  =============================
kind        one block                               axes of the (O, G, Cg, S) view
==========  ======================================  =============================
instance    one (sample, channel): its positions     S
sample      one sample: its channels and positions   G, Cg, S
batch       one channel: its samples and positions   O, S
==========  ======================================  =============================

``BlockMean(u, kind)`` is, at each element, the mean of the element values ``u`` over the
block of that kind the element lies in: an element value that is one value per block. It is
linear and its own transpose (for element values a and b, Σ_i a_i·B(b)_i = Σ_i B(a)_i·b_i,
both being Σ over blocks of |block|·mean(a)·mean(b)), so reverse mode carries an adjoint
back through it by taking the same block mean of the adjoint. A block of a kind that spans
the group's own axes is the group: ``mean(e, "batch")`` in a batch layout is ``mean(e)``.

Facts the engine uses, all exact:

* linearity: B(c·u + d·v) = c·B(u) + d·B(v) for c, d one value per block;
* B(b) = b for b one value per block (a block statistic of a coarser or the same kind, a
  group value), so B(x - B(x)) = 0, as the group mean's ⟨x - μ⟩ = 0;
* a value that is one value per block of kind k' is one value per block of every kind k
  whose blocks lie inside k''s (k's axes among k''s): a sample's statistic is one value
  on each of its instances; an instance statistic is not one value on a sample.
"""

from __future__ import annotations

import sympy
from sympy import Add, Mul
from sympy.core.symbol import Str

from derivgen.symbolic.reduce import SELECTIONS, Mean, SumFacts, expand

# kind -> the axes of the (O, G, Cg, S) view one block spans
BLOCK_AXES: dict[str, tuple[int, ...]] = {
    "instance": (3,),
    "sample": (1, 2, 3),
    "batch": (0, 3),
}

# (layout kind, reduce) -> the axes of the (O, G, Cg, S) view one group spans
GROUP_AXES: dict[tuple[str, str], tuple[int, ...]] = {
    ("trailing", "features"): (2,),
    ("channels", "instance"): (3,),
    ("channels", "group"): (2, 3),
    ("channels", "batch"): (0, 3),
    ("channels", "position"): (2,),
    ("channels", "all"): (0, 1, 2, 3),
}

# the axis of the view the channel index runs along (per-channel parameters vary along it)
CHANNEL_AXES = (1, 2)


def block_kinds(layout: str, reduce: str) -> dict[str, str]:
    """The block kinds a layout's groups hold: kind -> "block" (a strict sub-block of the
    group) or "group" (the kind spans the group: its mean is the group mean)."""
    group = set(GROUP_AXES[(layout, reduce)])
    out = {}
    for kind, axes in BLOCK_AXES.items():
        spans = set(axes)
        if layout != "channels" or not spans <= group:
            continue
        out[kind] = "group" if spans == group else "block"
    return out


def inside(k1: str, k2: str) -> bool:
    """Does every block of kind ``k1`` lie inside one block of kind ``k2``?"""
    return set(BLOCK_AXES[k1]) <= set(BLOCK_AXES[k2])


class BlockMean(SumFacts, sympy.Function):
    """The mean of ``u`` over the element's block of kind ``kind`` (a :class:`Str`)."""

    nargs = 2

    @classmethod
    def eval(cls, u: sympy.Expr, kind: Str) -> sympy.Expr | None:
        """Zero for a zero argument; otherwise never evaluated on construction."""
        if u == 0:
            return sympy.S.Zero
        return None

    @property
    def body(self) -> sympy.Expr:
        """The element values averaged."""
        return self.args[0]

    @property
    def kind(self) -> str:
        """instance, sample or batch."""
        return self.args[1].name

    @property
    def axes(self) -> tuple[int, ...]:
        """The axes of the (O, G, Cg, S) view one block spans."""
        return BLOCK_AXES[self.kind]

    def _eval_derivative(self, s: sympy.Symbol) -> sympy.Expr:
        """∂B(u)/∂s = B(∂u/∂s) for s one value per group (a statistic, a parameter, an
        option): the derivative of the block mean as a function of group values. Through
        element values the engine carries adjoints by the block mean instead (it hides
        block means before differentiating by one)."""
        return BlockMean(sympy.diff(self.body, s), self.args[1])

    def _eval_is_extended_positive(self) -> bool | None:
        return True if self.args[0].is_extended_positive else None

    def _latex(self, printer: sympy.printing.latex.LatexPrinter) -> str:
        if hasattr(printer, "_print_BlockMean"):
            return printer._print_BlockMean(self)
        return rf"\left\langle {printer._print(self.body)} \right\rangle_{{\mathrm{{{self.kind}}}}}"

    def _sympystr(self, printer: sympy.printing.str.StrPrinter) -> str:
        if hasattr(printer, "_print_BlockMean"):
            return printer._print_BlockMean(self)
        return f'mean({printer._print(self.body)}, "{self.kind}")'


def block_mean(u: sympy.Expr, kind: str) -> sympy.Expr:
    """``BlockMean(u, kind)``."""
    return BlockMean(u, Str(kind))


def blocks(e: sympy.Basic) -> set[BlockMean]:
    """The block means in ``e`` (outermost and nested)."""
    return e.atoms(BlockMean)


def outermost(e: sympy.Basic, cls: type | None = None) -> list:
    """The atoms of class ``cls`` (block means by default; windows too) in ``e`` that are not
    inside another one, in a fixed order."""
    cls = cls or BlockMean
    found: set = set()

    def walk(a: sympy.Basic) -> None:
        if isinstance(a, cls):
            found.add(a)
            return
        for arg in a.args:
            walk(arg)

    walk(e)
    return sorted(found, key=sympy.default_sort_key)


def hide_blocks(e: sympy.Expr) -> tuple[sympy.Expr, dict[sympy.Dummy, BlockMean]]:
    """``e`` with each outermost block mean replaced by a fresh real symbol (what reverse and
    forward mode differentiate by), and the table back: {symbol: block mean}."""
    table = {m: sympy.Dummy(f"B{k}", real=True) for k, m in enumerate(outermost(e))}
    return e.xreplace(table), {d: m for m, d in table.items()}


class BlockFacts:
    """What is one value per block, and the block statistics' definitions, for rewriting
    block means exactly (see the module docstring).

    ``element`` are the symbols that vary within a group (x, ∂L/∂y, g, the coordinate, the
    masks, per-channel parameters, the block statistics); ``kinds`` gives each block
    statistic the kinds of block it is one value on; ``channel`` are the per-channel
    parameters (one value on any block that does not span the channel axis); ``known``
    maps a block mean to the block statistic it defines (``B(x, instance) -> m_in``)."""

    def __init__(
        self,
        element: set[sympy.Symbol] | frozenset[sympy.Symbol],
        kinds: dict[sympy.Symbol, frozenset[str]],
        channel: set[sympy.Symbol] | frozenset[sympy.Symbol],
        known: dict[BlockMean, sympy.Symbol],
    ) -> None:
        self.element = set(element)
        self.kinds = dict(kinds)
        self.channel = set(channel)
        self.known = dict(known)

    def constant(self, e: sympy.Expr, kind: str) -> bool:
        """Is ``e`` one value on every block of ``kind``?"""
        spans_channels = bool(set(BLOCK_AXES[kind]) & set(CHANNEL_AXES))
        atoms = outermost(e)
        for b in atoms:  # a block mean inside another is averaged by it: only the outer ones count
            if not inside(kind, b.kind):
                return False
        outside = e.xreplace({b: sympy.Dummy() for b in atoms}) if atoms else e
        # a group mean, maximum or minimum is one value per group, so per block
        groupwise = outside.atoms(Mean, *SELECTIONS)
        if groupwise:
            outside = outside.xreplace({a: sympy.Dummy() for a in groupwise})
        for s in outside.free_symbols:
            if s in self.kinds:
                if kind not in self.kinds[s]:
                    return False
            elif s in self.channel:
                if spans_channels:
                    return False
            elif s in self.element:
                return False
        return True

    def rewrite(self, e: sympy.Expr) -> sympy.Expr:
        """``e`` with every block mean split by linearity, its per-block factors taken out,
        known block statistics put in (B(x) = m) and means of per-block values dropped."""
        if not e.has(BlockMean):
            return e
        return e.replace(lambda a: isinstance(a, BlockMean), self._one)

    def _one(self, b: BlockMean) -> sympy.Expr:
        body = self.rewrite(b.body)
        kind = b.kind
        total = sympy.S.Zero
        expanded = expand(body)  # products of sums multiplied out; functions and roots kept
        by_vary: dict[sympy.Expr, list[sympy.Expr]] = {}
        for term in Add.make_args(expanded):
            const, vary = [], []
            for f in Mul.make_args(term):
                (const if self.constant(f, kind) else vary).append(f)
            by_vary.setdefault(Mul(*vary), []).append(Mul(*const))
        for vary, consts in by_vary.items():
            c = Add(*consts)
            if vary == 1:
                total += c
                continue
            atom = block_mean(vary, kind)
            total += c * self.known.get(atom, atom)
        return total
