"""Block statistics in the C kernels (:mod:`derivgen.symbolic.block`): a pass per block mean,
the passes of one level of their dependencies walked together (``types.block_groups``).

A block mean mean(u, kind) is one value per block of its kind inside the group (an
instance: a (sample, channel)'s positions; a sample; a channel over the samples). Before
a sweep reads one, a block pass walks the group once and leaves the block's mean of u in
an array of the thread's scratch, ``Bm<k>_A``, one double per block of the group; the
sweep's element code reads it at its block, ``Bm<k>``, as it reads a per-channel
parameter (a block spans the positions, so its value is one per (block index, channel)).
A block mean inside u is a pass of its own, run first. The passes sum u in double, in
DG_LANES lanes per run of S positions, runs added in order: the sums do not depend on the
thread count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import sympy

from derivgen.codegen.c.types import BlockPass
from derivgen.symbolic.block import BLOCK_AXES, BlockMean, outermost


def block_index(axes: tuple[int, ...]) -> tuple[str, str, str]:
    """C text of a block kind's (index of the element's block, blocks per group, elements per
    block) in a channel kernel's loops: sample blocks ``Blk`` (O, when the group spans the
    samples), channel ``Ch - Gi * Cg`` of the group; ``axes`` those of the (O, G, Cg, S) view
    one block spans (every kind spans the positions S)."""
    per_o, per_c = 0 not in axes, 2 not in axes
    chan = "(Ch - Gi * Cg)"
    index = {(True, True): f"Blk * Cg + {chan}", (True, False): "Blk", (False, True): chan, (False, False): "0"}
    count = {(True, True): "Blocks * Cg", (True, False): "Blocks", (False, True): "Cg", (False, False): "1"}
    size = "*".join(f for f, on in (("Blocks", not per_o), ("Cg", not per_c), ("S", True)) if on)
    return index[(per_o, per_c)], count[(per_o, per_c)], f"(double)({size})"


class BlockSlots:
    """The block arrays of one mode's kernels for one element type: one slot per distinct
    block mean (its body, with the block means inside it hidden, and its kind)."""

    def __init__(self) -> None:
        self.keys: dict[tuple, int] = {}

    def slot(self, body: sympy.Expr, kind: str) -> int:
        """The slot of mean(body, kind), made on first use."""
        return self.keys.setdefault((body, kind), len(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


def hide_block_means(e: sympy.Expr, make) -> sympy.Expr:
    """``e`` with each outermost block mean replaced by ``make(body, kind)`` (a symbol), its
    body's block means replaced first."""
    if not e.has(BlockMean):
        return e
    return e.xreplace({b: make(hide_block_means(b.body, make), b.kind) for b in outermost(e)})


def block_slots_read(names: Iterable[str]) -> list[int]:
    """The block slots among the symbol names ``names`` (Bm<k>)."""
    return sorted(int(n[2:]) for n in names if n.startswith("Bm") and n[2:].isdigit())


def block_load(slot: int, kind_axes: tuple[int, ...]) -> str:
    """The declaration of block value ``Bm<slot>`` (double) at the element's block."""
    index, _, _ = block_index(kind_axes)
    return f"const double Bm{slot} = Bm{slot}_A[{index}];"


class BlockPasses:
    """One planner's block passes: the block means of its expressions hidden as ``Bm<k>``
    symbols (slots shared by the mode's kernels), each pass planned once by ``plan(slot,
    body, kind, temps)`` (a BlockPass)."""

    def __init__(self, slots: BlockSlots, plan) -> None:
        self.slots, self.plan = slots, plan
        self.passes: dict[int, BlockPass] = {}
        self.axes: dict[int, tuple[int, ...]] = {}

    def hide(self, e: sympy.Expr, temps: list[tuple[str, sympy.Expr]]) -> sympy.Expr:
        """``e`` with its block means as Bm symbols, their passes planned with ``temps``."""

        def make(body: sympy.Expr, kind: str) -> sympy.Symbol:
            slot = self.slots.slot(body, kind)
            if slot not in self.passes:
                self.axes[slot] = BLOCK_AXES[kind]
                self.passes[slot] = self.plan(slot, body, kind, temps)
            return sympy.Symbol(f"Bm{slot}")

        return hide_block_means(e, make)

    def hide_temps(self, temps: Sequence[tuple[str, sympy.Expr]]) -> list[tuple[str, sympy.Expr]]:
        """Element temporaries with their block means hidden, each with the temporaries before it."""
        out: list[tuple[str, sympy.Expr]] = []
        for nm, te in temps:
            out.append((nm, self.hide(te, list(out))))
        return out

    def needed(self, names: Iterable[str]) -> tuple[BlockPass, ...]:
        """The passes that code reading ``names`` needs, dependencies first."""
        want: set[int] = set()
        todo = block_slots_read(names)
        while todo:
            k = todo.pop()
            if k not in want:
                want.add(k)
                todo.extend(self.passes[k].deps)
        return tuple(self.passes[k] for k in sorted(want))

    def loads(self, names: Iterable[str], by_channel: bool | None = None) -> list[str]:
        """The declarations of the block values among ``names``: all, or (``by_channel``)
        those whose block index reads the channel ``Ch`` (True) or not (False)."""
        return [
            block_load(k, self.axes[k])
            for k in block_slots_read(names)
            if by_channel is None or (2 not in self.axes[k]) == by_channel
        ]


def block_pass(
    slot: int, kind: str, comment: str, chan_loads, elem_loads, body: str, names: Iterable[str], passes: BlockPasses
) -> BlockPass:
    """A BlockPass of a body planned as ``chan_loads``, ``elem_loads`` and ``body`` reading ``names``."""
    axes = BLOCK_AXES[kind]
    index, count, size = block_index(axes)
    deps = tuple(p.slot for p in passes.needed(names) if p.slot != slot)
    return BlockPass(
        slot=slot,
        comment=comment,
        count=count,
        size=size,
        index=index,
        chan_loads=tuple(chan_loads),
        elem_loads=tuple(elem_loads),
        body=body,
        deps=deps,
        axes=axes,
    )
