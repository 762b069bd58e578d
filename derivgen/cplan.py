"""Plans of the C kernels: a mode's IR as C statements, for one element type.

The kernel template (templates/kernel.c.j2) lays out the loops -- groups,
blocks, runs of contiguous values, DG_LANES lanes -- and this module fills
them: what each sweep over a group loads, computes, stores and sums, and the
per-group values between sweeps. Every name it makes is in derivgen's own
namespace (an upper-case letter; see :mod:`derivgen.naming`): element loads
``Xv``, ``Dyv``, ``gamma_V``; group values of buffers and scalar parameters
``b_G``; float copies ``rstd_F``; hi/lo pairs ``H0_hi``; common
subexpressions ``Cse0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy
from sympy import Add

from .naming import derived, ordered_names
from .printers import _CFloatElem, _SPEC_FOR_PRINTING, c_expr
from .spec import Spec

CTYPES = {"f32": "float", "f64": "double", "bf16": "dg_bf16"}
# the arithmetic type of each storage type: bfloat16 is read and written as bfloat16 and
# computed in float (as PyTorch's CPU kernels do), rounding to nearest even on store
ATYPES = {"float": "float", "double": "double", "dg_bf16": "float"}


def c_load(text: str, T: str, to: str = "double") -> str:
    """C text reading one stored element ``text`` of type T as ``to``."""
    if T == "dg_bf16":
        v = f"Dg_from_bf16({text})"
        return v if to == "float" else f"({to}){v}"
    return text if to == T else f"({to}){text}"


def c_store(text: str, T: str) -> str:
    """C text converting the value ``text`` to the stored type T."""
    if T == "dg_bf16":
        return f"Dg_to_bf16((float)({text}))"
    return f"({T})({text})"


@dataclass
class CLoop:
    """One sweep over the elements of a group, as data for the C template.

    The template emits it with DG_LANES independent double lanes for every sum (so
    the compiler vectorizes without reassociating: no -ffast-math, and the
    summation order is fixed), and loads each parameter once per channel in
    NCHW layouts.
    """
    uses_params: bool
    prelude: list[str]                     # per-group declarations before the sweep (float copies, hi/lo)
    param_loads: list[str]                 # const double gamma_V = (double)gamma[Ch];
    elem_loads: list[str]                  # x, dy, then element temporaries, in order
    stores: list[tuple[str, str]]          # (output array, value): dx, (float)(...)
    group_sums: list[tuple[str, str]]      # (accumulator, expression) summed over the group
    param_sums: list[tuple[int, str]]      # (parameter slot, expression) summed per channel
    scalar_param_sums: list[tuple[int, str]] = field(default_factory=list)  # (slot, accumulator): scalar params
    param_pend: list[tuple[int, str]] = field(default_factory=list)  # param_sums in element arithmetic
    outputs: list[str] = field(default_factory=list)       # full-size arrays written (y, dx)
    prefetch: list[str] = field(default_factory=list)      # full-size arrays read ahead (first sweep only)

    # Runs whose iterations carry no lane sums may start their lane blocks anywhere, so a
    # long streaming run peels a scalar head up to a 64-byte boundary of its single output
    # and streams whole blocks straight from registers ("direct"; short ones are written
    # in place); runs with lane sums compute into a cache-resident tile that is streamed
    # out afterwards, keeping the lane of every element.
    def _direct(self, channel_lanes: bool) -> bool:
        return len(self.outputs) == 1 and not self.group_sums and not (channel_lanes and self.param_sums)

    @property
    def direct_run(self) -> bool:             # along the channel axis (S == 1), or with no parameters
        return self._direct(False)

    @property
    def direct_nchw(self) -> bool:            # runs of S values of one channel
        return self._direct(True)

    @property
    def needs_tile(self) -> bool:             # some run of this sweep streams through a tile
        if not self.outputs:
            return False
        return not (self.direct_run and self.direct_nchw) if self.uses_params else not self.direct_run


def _used(name: str, texts: list[str]) -> bool:
    pat = re.compile(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])")
    return any(pat.search(t) for t in texts)


def _live(prelude: list[tuple[str, str]], code: list[str]) -> list[str]:
    """The prelude declarations (name, line) that the code uses, directly or through
    another kept declaration (H0 through H0_hi); the rest would be unused variables."""
    keep: list[tuple[str, str]] = []
    for name, line in reversed(prelude):
        if _used(name, code + [ln for _, ln in keep]):
            keep.insert(0, (name, line))
    return [ln for _, ln in keep]


class CPlanner:
    """Turns a ModeIR into C statement strings for one element type."""

    def __init__(self, spec: Spec, ir, ctype: str):
        self.spec, self.ir, self.ctype = spec, ir, ctype
        self.atype = ATYPES[ctype]
        self.params = [p.name for p in spec.params]
        self.scalar = {p.name for p in spec.params if p.scalar}
        self.group_names: dict[str, str] = {"N": "N"}
        for b in spec.buffers:
            self.group_names[b.name] = derived(b.name, "G")
        for p in self.scalar:                    # one value for the whole tensor: a group value
            self.group_names[p] = derived(p, "G")
        self.elem_names: dict[str, str] = {"x": "Xv", "dy": "Dyv",
                                           **{p: derived(p, "V") for p in self.params if p not in self.scalar}}

    def g(self, e: sympy.Expr) -> str:
        """A group-level expression (double)."""
        return c_expr(e, "double", self.group_names)

    # ---- one sweep -----------------------------------------------------
    @staticmethod
    def _needed(exprs, temps) -> tuple[list[tuple[str, sympy.Expr]], set[str]]:
        """The element temporaries the expressions use, transitively, in definition order;
        and every name used."""
        needed: list[tuple[str, sympy.Expr]] = []
        names = {str(s) for e in exprs for s in e.free_symbols}
        for nm, te in reversed(temps):
            if nm in names:
                needed.insert(0, (nm, te))
                names |= {str(s) for s in te.free_symbols}
        return needed, names

    def _float_prelude(self, every, elem: set[str], enames: dict[str, str]):
        """Float element arithmetic: group-level addends of mixed sums become hi/lo pairs
        (H0_hi + H0_lo), other group values float copies (rstd_F). Returns the prelude as
        (name, declaration) pairs and the hoisted Add nodes; updates ``enames``."""
        prelude: list[tuple[str, str]] = []
        hoisted: dict = {}
        for e in every:
            for node in sympy.preorder_traversal(e):
                if node.is_Add and node not in hoisted:
                    ge = [t for t in node.args if not ({str(v) for v in t.free_symbols} & elem)]
                    ee = [t for t in node.args if {str(v) for v in t.free_symbols} & elem]
                    if ge and ee:
                        h = f"H{len(hoisted)}"
                        hoisted[node] = (Add(*ee), h)
                        prelude.append((h, f"const double {h} = {self.g(Add(*ge))};"))
                        prelude.append((f"{h}_hi", f"const float {h}_hi = (float){h};"))
                        prelude.append((f"{h}_lo", f"const float {h}_lo = (float)({h} - (double){h}_hi);"))
        used: set[str] = set()

        def collect(node):
            if node in hoisted:              # only its element part is printed in float
                collect(hoisted[node][0])
            elif node.is_Symbol:
                if str(node) not in elem:
                    used.add(str(node))
            else:
                for a in node.args:
                    collect(a)
        for e in every:
            collect(e)
        for gname in sorted(used):
            src = self.group_names.get(gname, gname)
            f = src + "_F"                  # rstd_F, Mean_g_F: an upper-case tag, derivgen's namespace
            prelude.append((f, f"const float {f} = (float){src};"))
            enames[gname] = f
        return prelude, hoisted

    def loop(self, exprs: list[sympy.Expr], temps: list[tuple[str, sympy.Expr]], *, stores=(), group_sums=(),
             param_sums=(), arith: str = "double", outputs=(), first: bool = False) -> CLoop:
        """Element sweep computing ``exprs``; ``temps`` are element temporaries available.

        ``outputs`` are the full-size arrays the sweep writes (straight, streamed
        from registers, or through a cache-resident tile streamed out after each
        run: see the template); the ``first`` sweep of a function prefetches the
        arrays it reads.

        Loads and stores use the array type. Sums are always double. With
        ``arith="double"`` all arithmetic is double, so a float32 kernel centres
        and squares without rounding the statistics to float (mean offset 1e4)
        or overflowing (|x| ~ 1e30). ``arith="float"`` (output sweeps of float
        kernels) computes in float, adding group-level terms as hi + lo pairs.
        """
        A, T = arith, self.ctype
        needed, names = self._needed(exprs, temps)
        chan = [p for p in self.params if p not in self.scalar]
        elem = {"x", "dy", *chan} | {nm for nm, _ in needed}
        enames = dict(self.group_names)
        enames.update(self.elem_names)
        prelude, hoisted = ([], {})
        if A == "float":
            prelude, hoisted = self._float_prelude([te for _, te in needed] + list(exprs), elem, enames)

        def P(e):
            """Element arithmetic (temporaries, stored outputs) in the sweep's type."""
            if A == "float":
                return _CFloatElem(enames, ordered_names(_SPEC_FOR_PRINTING[0]), hoisted).doprint(e)
            return c_expr(e, "double", enames)
        elem_loads = []
        if "x" in names:
            elem_loads.append(f"const {A} Xv = {c_load('x[Idx]', T, A)};")
        if "dy" in names:
            elem_loads.append(f"const {A} Dyv = {c_load('dy[Idx]', T, A)};")
        for nm, te in needed:
            elem_loads.append(f"const {A} {nm} = {P(te)};")
            enames[nm] = nm
        # summands are double: float element values are widened before any arithmetic, so the
        # temporaries (x-hat, g) are the same values in every sweep and products do not overflow
        dnames = dict(self.group_names)
        dnames.update(self.elem_names)
        dnames.update({nm: nm for nm, _ in needed})
        if A != "double":
            dnames.update({k: f"((double){v})" for k, v in dnames.items() if k in elem})

        def S(e):
            return c_expr(e, "double", dnames)
        param_loads = [f"const {A} {derived(p, 'V')} = {c_load(p + '[Ch]', T, A)};" for p in chan if p in names]
        chan_sums = [(k, e) for k, e in param_sums if self.params[k] not in self.scalar]
        scal_sums = [(k, e) for k, e in param_sums if self.params[k] in self.scalar]
        all_sums = list(group_sums) + [(f"Psum_{k}", e) for k, e in scal_sums]
        lp = CLoop(uses_params=bool(param_loads) or bool(chan_sums), prelude=[], param_loads=param_loads,
                   elem_loads=elem_loads, stores=[f(P) for f in stores],
                   group_sums=[(a, S(e)) for a, e in all_sums],
                   param_sums=[(k, S(e)) for k, e in chan_sums],
                   scalar_param_sums=[(k, f"Psum_{k}") for k, _ in scal_sums],
                   param_pend=[(k, P(e)) for k, e in chan_sums], outputs=list(outputs),
                   prefetch=[a for a in ("x", "dy") if a in names] if first else [])
        code = (lp.param_loads + lp.elem_loads + [v for _, v in lp.stores] + [v for _, v in lp.group_sums]
                + [v for _, v in lp.param_sums] + [v for _, v in lp.param_pend])
        lp.prelude = _live(prelude, code)
        return lp

    # ---- the two kernels ------------------------------------------------
    def forward(self):
        from .emit import Loop
        steps = []
        for st in self.ir.forward:
            if isinstance(st, Loop):
                first = not any(s[0] == "loop" for s in steps)
                steps.append(("loop", self.loop([e for _, e in st.accs], [], group_sums=st.accs, first=first),
                              [a for a, _ in st.accs]))
            else:
                steps.append(("assign", st.name, self.g(st.expr), st.comment))
        _, out_expr = self.ir.fwd_elem[-1]
        temps = list(self.ir.fwd_elem[:-1])
        T = self.ctype
        first = not any(st[0] == "loop" for st in steps)
        final = self.loop([out_expr], temps, stores=[lambda P: ("y", c_store(P(out_expr), T))], arith=self.atype,
                          outputs=["y"], first=first)
        updates = [(b, self.g(e)) for b, e in self.ir.buffer_updates]
        return steps, final, updates

    def _group_values(self):
        """The per-group values between the reduction sweep and the final one: the means
        (kept as sum/N, exact for constant rows), then the values derived from them with
        their common subexpressions named once (online layer norm's coefficients share
        several). Float kernels compute dx from the factored closed form, so they skip the
        coefficients of the expanded one."""
        A = self.atype
        coeffs = {k for k, _ in self.ir.dx_terms}
        means = {r for r, _ in zip((a.name for a in self.ir.bwd_group), self.ir.bwd_loop)}
        kept = [a for a in self.ir.bwd_group if a.name not in means and (A == "double" or a.name not in coeffs)]
        repl, reduced = sympy.cse([a.expr for a in kept], symbols=sympy.numbered_symbols("Cse"), order="none")
        group = [(a.name, self.g(a.expr), a.comment) for a in self.ir.bwd_group if a.name in means]
        group += [(str(t), self.g(e), "common subexpression") for t, e in repl]
        group += [(a.name, self.g(r), a.comment) for a, r in zip(kept, reduced)]
        return group

    def backward(self):
        temps = list(self.ir.bwd_elem)
        red = None
        if self.ir.bwd_loop:
            red = self.loop([e for _, e in self.ir.bwd_loop], temps, group_sums=self.ir.bwd_loop, arith=self.atype,
                            first=True)
        T = self.ctype
        group = self._group_values()
        # double: dx = sum of per-group coefficients times element monomials (fewest flops);
        # float: the factored closed form, whose cancellations the hi/lo addends keep exact
        if self.atype == "double":
            dx_expr = Add(*[sympy.Symbol(k) * m for k, m in self.ir.dx_terms])
        else:
            dx_expr = self.ir.dx_closed
        pexprs = [e for _, e in self.ir.dparams]
        final = self.loop([dx_expr, *pexprs], temps, stores=[lambda P: ("dx", c_store(P(dx_expr), T))],
                          param_sums=list(enumerate(pexprs)), arith=self.atype, outputs=["dx"], first=red is None)
        return red, [a for a, _ in self.ir.bwd_loop], group, final


# ---- channels last (NHWC) -------------------------------------------------
#
# The NHWC kernels run the same sweeps over a block of groups in lockstep: for every
# position s of a run (and every channel of a group), the innermost loop walks the
# block's groups, which are adjacent in memory. Each group keeps its own DG_LANES
# lanes, filled in the same order as the NCHW kernels fill them (lane J gets the
# run's positions J, J + DG_LANES, ..., the remainder lane 0), so sums, statistics
# and outputs are the NCHW kernels' bits. Group-level values live in arrays
# ``Gv_<name>[Gi]``; the innermost loop declares the ones its code uses.

_DECL = re.compile(r"^const (\w+) (\w+) = (.*);$")


@dataclass
class NhwcSweep:
    loop: CLoop
    prelude: list[tuple[str, str, str]]        # (type, name, expression) computed per group
    prelude_inputs: list[str]                  # group values the prelude reads
    inner_group: list[str]                     # group values the element code reads
    inner_prelude: list[tuple[str, str]]       # (type, name) of prelude values the element code reads


def nhwc_sweep(lp: CLoop, group_names: list[str]) -> NhwcSweep:
    prelude = []
    for line in lp.prelude:
        m = _DECL.match(line)
        assert m, line
        prelude.append((m.group(1), m.group(2), m.group(3)))
    body = (lp.param_loads + lp.elem_loads + [v for _, v in lp.stores] + [v for _, v in lp.group_sums]
            + [v for _, v in lp.param_sums])
    pnames = {n for _, n, _ in prelude}
    return NhwcSweep(
        loop=lp, prelude=prelude,
        prelude_inputs=[n for n in group_names if n not in pnames and _used(n, [e for _, _, e in prelude])],
        inner_group=[n for n in group_names if n not in pnames and _used(n, body)],
        inner_prelude=[(t, n) for t, n, _ in prelude if _used(n, body)])


def used_in(names: list[str], text: str) -> list[str]:
    """The names that C text uses (as whole identifiers)."""
    return [n for n in names if _used(n, [text])]


# ---- second order (derivgen.second): the double backward and the JVP -------------
#
# One reduction sweep and one output sweep per group, all arithmetic in double (float
# and bfloat16 values are widened on load), sums in DG_LANES lanes; the template
# (kernel.c.j2, second_kernel) lays out the loops.

@dataclass
class SecondPlan:
    elem1: list[str]                  # sweep 1: element loads and temporaries
    chan1: list[str]                  # sweep 1: per-channel loads
    sums: list[tuple[str, str]]       # (accumulator, C expression)
    group: list[tuple[str, str, str]]   # (name, C expression, comment) per group between the sweeps
    elem2: list[str]
    chan2: list[str]
    stores: list[tuple[str, str]]     # (output array, C expression in double)
    param_sums: list[tuple[int, str]]   # (parameter slot, C expression)
    inputs: list[tuple[str, str]]     # (input, group variable)
    param_groups: list[tuple[int, str]]   # (parameter slot, group variable)
    seed_group: list[tuple[str, str]]   # (name, declaration): per-group loads of input seeds, scalar seeds


def second_plan(spec: Spec, ir, ctype: str) -> SecondPlan:
    from .printers import c_expr
    params = [p.name for p in spec.params]
    scalar = {p.name for p in spec.params if p.scalar}
    rename = {"N": "N", "x": "Xv", "dy": "Dyv"}
    for p in params:
        rename[p] = derived(p, "G") if p in scalar else derived(p, "V")

    def C(e):
        return c_expr(e, "double", rename)
    seed_chan = {ir.seed_params[p]: p for p in params if p not in scalar}

    def needed(exprs):
        names = {str(s) for e in exprs for s in e.free_symbols}
        temps = []
        for nm, te in reversed(ir.temps):
            if nm in names:
                temps.insert(0, (nm, te))
                names |= {str(s) for s in te.free_symbols}
        loads = []
        if "x" in names:
            loads.append(f"const double Xv = {c_load('x[Idx]', ctype)};")
        if "dy" in names:
            loads.append(f"const double Dyv = {c_load('dy[Idx]', ctype)};")
        if ir.seed_x in names:
            loads.append(f"const double {ir.seed_x} = {c_load('Seed_x[Idx]', ctype)};")
        chan = [f"const double {derived(p, 'V')} = {c_load(p + '[Ch]', ctype)};" for p in params
                if p not in scalar and p in names]
        chan += [f"const double {s} = {c_load(p + '_Seed[Ch]', ctype)};" for s, p in seed_chan.items() if s in names]
        return loads + [f"const double {nm} = {C(te)};" for nm, te in temps], chan
    elem1, chan1 = needed([e for _, e in ir.loop])
    outs2 = []
    for name, terms, closed in ir.outputs:
        outs2.append((name, Add(*[sympy.Symbol(k) * m for k, m in terms])))
    pexprs = [(k, e) for k, (p, e) in enumerate(ir.param_elem) if e != 0]
    elem2, chan2 = needed([e for _, e in outs2] + [e for _, e in pexprs])
    group = [(a.name, C(a.expr), a.comment) for a in ir.means]
    repl, reduced = sympy.cse([a.expr for a in ir.group], symbols=sympy.numbered_symbols("Cse"), order="none")
    group += [(str(t), C(e), "common subexpression") for t, e in repl]
    group += [(a.name, C(r), a.comment) for a, r in zip(ir.group, reduced)]
    seed_group = []
    for i, s in ir.seed_inputs.items():
        seed_group.append((s, f"const double {s} = {c_load(i + '_Seed_In[Grp * ' + i + '_Seed_Stride]', ctype)};"))
    for p in params:
        if p in scalar:
            seed_group.append((ir.seed_params[p], f"const double {ir.seed_params[p]} = {c_load(p + '_Seed[0]', ctype)};"))
    return SecondPlan(elem1=elem1, chan1=chan1, sums=[(a, C(e)) for a, e in ir.loop], group=group,
                      elem2=elem2, chan2=chan2, stores=[(n, C(e)) for n, e in outs2],
                      param_sums=[(k, C(e)) for k, e in pexprs], inputs=list(ir.input_out),
                      param_groups=[(params.index(p), v) for p, v in ir.param_group], seed_group=seed_group)
