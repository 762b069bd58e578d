"""Windows in the C kernels (:mod:`derivgen.symbolic.window`): a static C function per window.

A window at element ``Ch`` of its group sums its body over the neighbours inside the group;
:class:`WindowFunctions` writes one function per window and what it reads, shared by the
kernels of one mode and element type, and the element code calls it
(:meth:`WindowFunction.call`). In a position layout's blocks of positions the sweeps read a
window from a tile instead (:meth:`WindowFunctions.tiles`: the same sum, the same bits, the body
evaluated once per element rather than once per neighbour).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from derivgen.codegen.c.names import Load
from derivgen.codegen.ir import needed_temps
from derivgen.codegen.printers import SpecPrinter, TileRead
from derivgen.symbolic.window import Window


def hide_windows(e: sympy.Expr) -> sympy.Expr:
    """``e`` with each window replaced by a symbol of no name a temporary has: what a sweep
    itself reads (a window's body is read by its function, at the neighbours)."""
    if not e.has(Window):
        return e
    found = sorted(e.atoms(Window), key=sympy.default_sort_key)  # each its own symbol: none cancel
    return e.xreplace({w: sympy.Symbol(f"Window_call{k}") for k, w in enumerate(found)})


@dataclass(frozen=True)
class WindowFunction:
    name: str
    arrays: tuple[str, ...]  # the arrays it reads, as the kernel names them
    groups: tuple[str, ...]  # the group values it reads, by their symbol names
    text: str
    slot: int = 0  # its number among the mode's window functions (its tile's, Wt_<slot>)
    inner: tuple[str, ...] = ()  # the functions its text calls

    def call(self, names: dict[str, str]) -> str:
        """Its call at element (Idx, Ch), the group values by the caller's ``names``."""
        args = [*self.arrays, *(names.get(g, g) for g in self.groups), "Idx - Ch * S", "S", "Cg", "Ch"]
        return f"{self.name}({', '.join(args)})"


class WindowFunctions:
    """The C functions of one mode's kernels for one element type that evaluate windows.

    A window at element ``Ch`` of its group (the channel index: a trailing layout's feature,
    or the channel at a position; element ``Idx = Base + Ch*S``) sums its body over the
    neighbours inside the group, in double, in offset order: the function reads x, ∂L/∂y,
    the parameters and the second order's seeds at each neighbour, recomputes the element
    temporaries the body needs there (a window inside it is a call of another function), and
    takes the group values as arguments. Recomputing costs k evaluations of the body per
    element (k² for a window inside a window) and keeps every kernel one pass per sweep."""

    def __init__(self, printer: SpecPrinter, prefix: str, ctype: str):
        self.printer, self.prefix, self.ctype = printer, prefix, ctype
        self.done: dict[tuple, WindowFunction] = {}
        self.defined: list[WindowFunction] = []
        self.used: set[str] = set()  # those some kernel calls (a tile's window is not called)

    @property
    def texts(self) -> list[str]:
        """The C text of the functions some kernel calls, directly or through another."""
        return [fn.text for fn in self.defined if fn.name in self.used]

    def _use(self, fn: WindowFunction) -> None:
        if fn.name not in self.used:
            self.used.add(fn.name)
            for inner in self.defined:
                if inner.name in fn.inner:
                    self._use(inner)

    def _body(self, w, needed, names: dict, nested, scalar: bool) -> tuple[list[str], str, set[str]]:
        """A window's temporaries as C declarations, its body as C text (double), and every
        name they read; ``scalar``: in the function's loop over the neighbours."""
        lines, reads = [], set()
        for nm, te in needed:
            text, r = self.printer.c_reads(te, "double", names, nested, scalar)
            lines.append(f"const double {nm} = {text};")
            reads |= r
        body, r = self.printer.c_reads(w.body, "double", names, nested, scalar)
        return lines, body, reads | r

    def function(
        self, w: Window, temps: list[tuple[str, sympy.Expr]], loads: dict[str, Load], called: bool = True
    ) -> WindowFunction:
        """The function of ``w`` in a kernel whose element temporaries are ``temps`` and whose
        element ``loads`` are ``loads`` (symbol name -> Load: the naming table), defined on
        first use; ``called``: a kernel calls it (else only its tile is computed: not emitted)."""
        # one function per window and what it reads (its temporaries, nested windows' too, and
        # the loads): the kernels that need the same one share it
        deps, names = needed_temps([w.body], temps)
        key = (w, tuple(deps), tuple(sorted((n, loads[n]) for n in names if n in loads)))
        if key in self.done:
            if called:
                self._use(self.done[key])
            return self.done[key]
        needed, _ = needed_temps([hide_windows(w.body)], temps)  # what this body itself reads
        temp_names = {nm for nm, _ in needed}
        inner: list[WindowFunction] = []

        def nested(v: Window) -> str:
            fn = self.function(v, temps, loads, called=False)
            inner.append(fn)
            return fn.call({})

        rename = {n: ld.local for n, ld in loads.items()}
        rename.update({nm: nm for nm in temp_names})
        lines, body, reads = self._body(w, needed, rename, nested, scalar=True)
        used = {n for n, ld in loads.items() if ld.local in reads}
        # a load's array (or a mask's option and N), and every other name read: a group value
        arrays = sorted({loads[n].source for n in used if loads[n].index})
        groups = {str(v) for e in [w.body, *(te for _, te in needed)] for v in hide_windows(e).free_symbols}
        groups = {g for g in groups - set(loads) - temp_names if not g.startswith("Window_call")}
        for n in used:  # a mask: computed from its option and N
            groups |= set(loads[n].reads)
        size = w.size
        if size.is_Symbol:
            groups.add(str(size))
        for fn in inner:
            arrays = sorted(set(arrays) | set(fn.arrays))
            groups |= set(fn.groups)
        groups_t = tuple(sorted(groups))
        name = f"{self.prefix}_window{len(self.defined) + 1}"
        T = self.ctype
        params = [f"const {T} *restrict {a}" for a in arrays] + [f"double {g}" for g in groups_t]
        params += ["int64_t Base", "int64_t S", "int64_t Cg", "int64_t Ch0"]
        k = f"(int64_t){size}" if size.is_Symbol else str(int(size))
        before, after = ("(K - 1) / 2", "K / 2") if w.transposed else ("K / 2", "(K - 1) / 2")
        load_lines = []
        for n in sorted(used):
            load_lines.append(loads[n].line(T))
        text = "\n".join(
            [
                (
                    f"/* {'the transposed window' if w.transposed else 'window'} of {self.printer.code(w.body)} over "
                    f"{size} neighbours, at element Ch0 of its group */"
                ),
                f"DG_MAYBE_UNUSED static double {name}({', '.join(params)})",
                "{",
                *(f"    (void){a};" for a in [*arrays, *groups_t, "Base", "S", "Cg", "Ch0"]),
                f"    const int64_t K = {k};",
                f"    const int64_t Lo = Ch0 - {before} < 0 ? 0 : Ch0 - {before};",
                f"    const int64_t Hi = Ch0 + {after} > Cg - 1 ? Cg - 1 : Ch0 + {after};",
                "    double Acc = 0.0;",
                "    for (int64_t Ch = Lo; Ch <= Hi; ++Ch) {",
                "        const int64_t Idx = Base + Ch * S;",
                "        (void)Idx;",
                *(f"        {line}" for line in load_lines + lines),
                f"        Acc += {body};",
                "    }",
                "    return Acc;",
                "}",
            ]
        )
        fn = WindowFunction(name, tuple(arrays), groups_t, text, len(self.defined) + 1, tuple(f.name for f in inner))
        self.done[key] = fn
        self.defined.append(fn)
        if called:
            self._use(fn)
        return fn

    def tiles(
        self, w: Window, temps: list[tuple[str, sympy.Expr]], loads: dict[str, Load], rename: dict[str, str]
    ) -> list[tuple[int, str]]:
        """A position layout's block of positions (W of them, innermost and contiguous) with
        ``w`` as a tile: ``Wt_<slot>[Ch * DG_NHWC_GROUPS + Gi]`` is the window at channel Ch of
        the block's group Gi, for every channel. Its body is evaluated once per element into the
        scratch tile ``Wb`` (a loop over the block's positions, vectorizable), then each
        channel's window adds the body's values at its neighbours in offset order from 0.0: the
        function's sum, the same bits, at one evaluation of the body per element instead of k
        (k² for a window inside a window). Returns (slot, C text) of the tiles to compute, the
        windows inside ``w`` first; the group values print by ``rename``."""
        fn = self.function(w, temps, loads, called=False)
        out: list[tuple[int, str]] = []
        needed, _ = needed_temps([hide_windows(w.body)], temps)

        def nested(v: Window) -> str:
            for t in self.tiles(v, temps, loads, rename):
                if t not in out:
                    out.append(t)
            return TileRead(f"Wt_{self.function(v, temps, loads, called=False).slot}[Ch * DG_NHWC_GROUPS + Gi]")

        names = dict(rename)
        names.update({n: ld.local for n, ld in loads.items()})
        names.update({nm: nm for nm, _ in needed})
        lines, body, reads = self._body(w, needed, names, nested, scalar=False)
        load_lines = [loads[n].line(self.ctype) for n in sorted(loads) if loads[n].local in reads]
        size = w.size
        k = f"(int64_t){names.get(str(size), str(size))}" if size.is_Symbol else str(int(size))
        before, after = ("(K - 1) / 2", "K / 2") if w.transposed else ("K / 2", "(K - 1) / 2")
        text = "\n".join(
            [
                f"{{   /* Wt_{fn.slot}: {fn.name} at every channel of the block (its body once per element) */",
                "    for (int64_t Ch = 0; Ch < Cg; ++Ch) {",
                "        DG_INDEPENDENT",
                "        for (int64_t Gi = 0; Gi < W; ++Gi) {",
                "            const int64_t Idx = Base + Ch * S + Gi;",
                "            (void)Idx;",
                *(f"            {line}" for line in load_lines + lines),
                f"            Wb[Ch * DG_NHWC_GROUPS + Gi] = {body};",
                "        }",
                "    }",
                f"    const int64_t K = {k};",
                "    for (int64_t Ch0 = 0; Ch0 < Cg; ++Ch0) {",
                f"        const int64_t Wlo = Ch0 - {before} < 0 ? 0 : Ch0 - {before};",
                f"        const int64_t Whi = Ch0 + {after} > Cg - 1 ? Cg - 1 : Ch0 + {after};",
                f"        double *restrict Out = Wt_{fn.slot} + Ch0 * DG_NHWC_GROUPS;",
                "        for (int64_t Gi = 0; Gi < W; ++Gi) Out[Gi] = 0.0;",
                "        for (int64_t Ch = Wlo; Ch <= Whi; ++Ch) {",
                "            const double *restrict In = Wb + Ch * DG_NHWC_GROUPS;",
                "            DG_INDEPENDENT",
                "            for (int64_t Gi = 0; Gi < W; ++Gi) Out[Gi] += In[Gi];",
                "        }",
                "    }",
                "}",
            ]
        )
        out.append((fn.slot, text))
        return out
