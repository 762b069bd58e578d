"""Emit code from derivations: one IR per mode, one Jinja template per target.

The IR is plain data the templates lay out as loops:

* forward group program: ``Loop`` (accumulate sums of element expressions over
  the group) and ``Assign`` (a per-group value from sums and earlier values),
  exactly the statistics as the spec writes them -- two passes for a variance,
  never E[x²] - E[x]²;
* forward elementwise: the normalized coordinate, then y;
* backward: element temporaries (x̂, g), the run-time reductions, per-group
  coefficients, dx as ``Σ coefficient · element monomial``, parameter-gradient
  contributions, per-group input gradients.

Expressions are printed by SymPy's own printers (``NumPyPrinter``,
``C99CodePrinter``); we only map symbols to variable names and ``Mean`` to the
reduction of each target.
"""

from __future__ import annotations

import pprint
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import sympy
from sympy import Add, Mul
from sympy.codegen.ast import float32, float64, real
from sympy.printing.c import C99CodePrinter
from sympy.printing.numpy import NumPyPrinter

from .api import Derivation, derive
from .document import _Ordered, code_text, ordered_names
from .engine import G, ModeDerivation
from .reduce import Mean, means
from .spec import DY, N, X, Spec

TEMPLATE_FILES = {"numpy": "numpy.py.j2", "c": "kernel.c.j2", "h": "kernel.h.j2", "cbind": "cbinding.py.j2"}


def template_dir() -> Path:
    src = Path(__file__).resolve().parent.parent / "templates"
    if (src / "numpy.py.j2").is_file():
        return src
    return Path(__file__).resolve().parent / "templates"


# ------------------------------------------------------------------- IR

@dataclass
class Loop:
    accs: list[tuple[str, sympy.Expr]]      # acc name, element expression summed over the group


@dataclass
class Assign:
    name: str
    expr: sympy.Expr                         # group-level
    comment: str = ""


@dataclass
class ModeIR:
    mode: str
    stats: list[str]
    forward: list                            # Loop | Assign
    buffer_updates: list[tuple[str, sympy.Expr]]
    fwd_elem: list[tuple[str, sympy.Expr]]   # (name, element expr); the last is y
    bwd_elem: list[tuple[str, sympy.Expr]]   # element temporaries for the backward (x̂, g)
    bwd_loop: list[tuple[str, sympy.Expr]]   # reduction accumulators
    bwd_group: list[Assign]                  # per-group: reductions, coefficients, input grads
    dx_terms: list[tuple[str, sympy.Expr]]   # (coefficient name, element monomial)
    dx_closed: sympy.Expr                    # the closed form (for comments and NumPy)
    dparams: list[tuple[str, sympy.Expr]]
    dinputs: list[tuple[str, str]]           # (input, group variable holding its gradient)
    element_symbols: list[str]
    stat_exprs: list[tuple[str, sympy.Expr, str]]   # (name, expression as the spec writes it, source text)


def _acc_name(base: str, k: int, total: int) -> str:
    return f"sum_{base}" if total == 1 else f"sum_{base}_{k}"


def build_mode_ir(md: ModeDerivation) -> ModeIR:
    spec = md.spec
    params = [p.symbol for p in spec.params]
    element = {X, DY, G, *params}
    xhat = spec.normalized.symbol if spec.normalized else None
    if xhat is not None:
        element.add(xhat)

    def is_elem(e):
        return bool(e.free_symbols & element) and not isinstance(e, Mean)

    forward: list = []
    for st in md.statistics:
        atoms = means(st.expr)
        sub = {}
        if atoms:
            accs = []
            for k, a in enumerate(atoms):
                nm = _acc_name(st.name, k, len(atoms))
                accs.append((nm, a.args[0]))
                sub[a] = sympy.Symbol(nm) / N
            forward.append(Loop(accs))
        forward.append(Assign(st.name, st.expr.xreplace(sub), comment=f"{st.name} = {st.expr_text}"))
    buffer_updates = [(b.name, b.update) for b in spec.buffers] if md.mode == "train" else []
    fwd_elem = []
    if xhat is not None:
        fwd_elem.append((spec.normalized.name, md.normalized_expr))
    fwd_elem.append(("y", spec.output))

    bwd_elem = []
    if xhat is not None:
        bwd_elem.append((spec.normalized.name, md.normalized_expr))
    if md.g is not None:
        bwd_elem.append(("g", md.g))
    bwd_loop = [(f"sum_{r.name[len('mean_'):]}" if r.name.startswith("mean_") else f"sum_{r.name}", r.arg)
                for r in md.reductions]
    bwd_group = [Assign(r.name, sympy.Symbol(acc) / N, comment=f"{r.name} = mean({r.arg})")
                 for r, (acc, _) in zip(md.reductions, bwd_loop)]
    # dx = Σ_k coefficient_k(group) · monomial_k(element)
    dx = sympy.expand(md.dx_lowered, power_base=False, log=False)
    by_mono: dict[sympy.Expr, list] = {}
    for term in Add.make_args(dx):
        c, m = [], []
        for f in Mul.make_args(term):
            (m if is_elem(f) else c).append(f)
        by_mono.setdefault(Mul(*m), []).append(Mul(*c))
    dx_terms = []
    for mono in sorted(by_mono, key=sympy.default_sort_key):
        nm = "k_" + ("1" if mono == 1 else "_".join(_mono_name(f) for f in Mul.make_args(mono)))
        bwd_group.append(Assign(nm, sympy.factor_terms(Add(*by_mono[mono])),
                                comment=f"coefficient of {mono} in dx"))
        dx_terms.append((nm, mono))
    dinputs = []
    for i in spec.inputs:
        nm = f"grad_{i.name}"
        bwd_group.append(Assign(nm, md.lowered(md.dinputs[i.name]), comment=f"∂L/∂{i.name} for this group"))
        dinputs.append((i.name, nm))
    dparams = [(p.name, md.dparams[p.name]) for p in spec.params]
    return ModeIR(mode=md.mode, stats=[s.name for s in md.statistics], forward=forward,
                  buffer_updates=buffer_updates, fwd_elem=fwd_elem, bwd_elem=bwd_elem, bwd_loop=bwd_loop,
                  bwd_group=bwd_group, dx_terms=dx_terms, dx_closed=md.dx_lowered, dparams=dparams,
                  dinputs=dinputs, element_symbols=sorted(str(s) for s in element),
                  stat_exprs=[(st.name, st.expr, st.expr_text) for st in md.statistics])


def _mono_name(f: sympy.Expr) -> str:
    b, e = f.as_base_exp()
    return str(b) if e == 1 else f"{b}{e}"


# ------------------------------------------------------------------- printers

class _NumPy(_Ordered, NumPyPrinter):
    def __init__(self, names):
        super().__init__({"fully_qualified_modules": True, "allow_unknown_functions": False})
        self.names = names

    def _print_Mean(self, expr):
        a = expr.args[0]
        if a.is_Pow and a.exp == 2:                       # mean(e**2): one pass over e
            return "_mean_sq(%s)" % self._print(a.base)
        if _plain_pair(a, sympy.Mul):                     # mean(a*b): no temporary product
            return "_mean_prod(%s, %s)" % tuple(self._print(f) for f in a.args)
        return "_mean(%s)" % self._print(a)

    def _print_Symbol(self, expr):
        return expr.name


def np_expr(e: sympy.Expr, spec: Spec | None = None) -> str:
    return _NumPy(ordered_names(spec)).doprint(e).replace("numpy.", "np.")


def _plain_pair(e: sympy.Expr, kind) -> bool:
    """``e`` is a sum or product (``kind``) of exactly two operands that print as
    themselves: no number, and no reciprocal (a/b prints as a division, which
    splitting would turn into a reciprocal and a product, rounding twice)."""
    return (isinstance(e, kind) and len(e.args) == 2
            and not any(f.is_Number or (f.is_Pow and f.exp.is_negative) for f in e.args))


def np_store(target: str, e: sympy.Expr, spec: Spec | None = None) -> str:
    """``target = e``; when ``e`` is a plain sum or product of two operands, the
    ufunc writes straight into ``target`` (converting to its dtype) instead of
    forming a float64 temporary and copying it. Anything else is assigned as
    printed, so the arithmetic is always exactly the printed expression."""
    if _plain_pair(e, sympy.Mul) or _plain_pair(e, sympy.Add):
        ufunc = "np.multiply" if e.is_Mul else "np.add"
        args = e.as_ordered_factors() if e.is_Mul else _NumPy(ordered_names(spec))._as_ordered_terms(e)
        return f"{ufunc}({np_expr(args[0], spec)}, {np_expr(args[1], spec)}, out={target})"
    return f"{target} = {np_expr(e, spec)}"


def np_sum(e: sympy.Expr, axes: str, spec: Spec | None = None) -> str:
    """NumPy text for the sum of ``e`` over ``axes`` (keeping dimensions); a
    product of two factors is summed without forming it."""
    if _plain_pair(e, sympy.Mul):
        a, b = (np_expr(f, spec) for f in e.args)
        return f"_rt.sum_prod({a}, {b}, {axes})"
    return f"np.sum({np_expr(e, spec)}, axis={axes}, keepdims=True)"


class _C(_Ordered, C99CodePrinter):
    def __init__(self, ctype: str, rename: dict[str, str], names):
        alias = float32 if ctype == "float" else float64
        super().__init__({"type_aliases": {real: alias}})
        self.rename = rename
        self.names = names

    def _print_Symbol(self, expr):
        return self.rename.get(expr.name, expr.name)

    def _print_Pow(self, expr):
        # small integer powers as products: exact, fast, no pow() call
        if expr.exp.is_Integer and 2 <= abs(int(expr.exp)) <= 4:
            b = self.parenthesize(expr.base, sympy.printing.precedence.PRECEDENCE["Mul"])
            prod = "*".join([b] * abs(int(expr.exp)))
            return f"({prod})" if expr.exp > 0 else f"({self._print(sympy.S.One)}/({prod}))"
        if expr.exp == -sympy.S.Half:
            return "%s/%s" % (self._print(sympy.S.One), self._print(sympy.sqrt(expr.base)))
        return super()._print_Pow(expr)


class _CFloatElem(_C):
    """Element arithmetic in float: a group-level addend h (double) enters a sum as
    ``(elements + h_hi) + h_lo`` with h_hi = (float)h, h_lo = (float)(h - h_hi), so
    x - mean is exact to float precision even when mean is 1e4 and x - mean is 1."""

    def __init__(self, rename, names, hoisted):
        super().__init__("float", rename, names)
        self.hoisted = hoisted          # Add node -> (element part, hoisted name)

    def _print_Add(self, expr, order=None):
        if expr in self.hoisted:
            elem, h = self.hoisted[expr]
            return f"({self._print(elem)} + {h}_hi + {h}_lo)"
        return super()._print_Add(expr, order)


_SPEC_FOR_PRINTING: list = [None]   # the spec being emitted (term ordering only)


def c_expr(e: sympy.Expr, ctype: str, rename: dict[str, str] | None = None) -> str:
    return _C(ctype, rename or {}, ordered_names(_SPEC_FOR_PRINTING[0])).doprint(e)


# ------------------------------------------------------------------- C plans

CTYPES = {"f32": "float", "f64": "double"}


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
    param_loads: list[str]                 # const double gamma_v = (double)gamma[ch];
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


class CPlanner:
    """Turns a ModeIR into C statement strings for one element type."""

    def __init__(self, spec: Spec, ir: ModeIR, ctype: str):
        self.spec, self.ir, self.ctype = spec, ir, ctype
        self.params = [p.name for p in spec.params]
        self.scalar = {p.name for p in spec.params if p.scalar}
        self.inputs = [i.name for i in spec.inputs]
        self.buffers = [b.name for b in spec.buffers]
        self.group_names: dict[str, str] = {"N": "N"}
        for b in self.buffers:
            self.group_names[b] = f"{b}_g"
        self.elem_names: dict[str, str] = {"x": "xv", "dy": "dyv", **{p: f"{p}_v" for p in self.params}}

    def g(self, e: sympy.Expr) -> str:
        """A group-level expression (double)."""
        return c_expr(e, "double", self.group_names)

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
        A = arith
        needed: list[tuple[str, sympy.Expr]] = []
        names = {str(s) for e in exprs for s in e.free_symbols}
        for nm, te in reversed(temps):          # temporaries used, transitively, in definition order
            if nm in names:
                needed.insert(0, (nm, te))
                names |= {str(s) for s in te.free_symbols}
        elem = {"x", "dy", *self.params} | {nm for nm, _ in needed}
        enames = dict(self.group_names)
        enames.update(self.elem_names)
        prelude: list[str] = []
        hoisted: dict = {}
        if A == "float":
            # group-level addends of mixed sums become hi/lo pairs; other group values float copies
            every = [te for _, te in needed] + list(exprs)
            count = 0
            for e in every:
                for node in sympy.preorder_traversal(e):
                    if node.is_Add and node not in hoisted:
                        ge = [t for t in node.args if not ({str(v) for v in t.free_symbols} & elem)]
                        ee = [t for t in node.args if {str(v) for v in t.free_symbols} & elem]
                        if ge and ee:
                            h = f"h{count}"
                            count += 1
                            hoisted[node] = (Add(*ee), h)
                            prelude.append(f"const double {h} = {self.g(Add(*ge))};")
                            prelude.append(f"const float {h}_hi = (float){h};")
                            prelude.append(f"const float {h}_lo = (float)({h} - (double){h}_hi);")
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
                prelude.append(f"const float {src}_f = (float){src};")
                enames[gname] = f"{src}_f"

        def P(e):
            """Element arithmetic (temporaries, stored outputs) in the sweep's type."""
            if A == "float":
                return _CFloatElem(enames, ordered_names(_SPEC_FOR_PRINTING[0]), hoisted).doprint(e)
            return c_expr(e, "double", enames)
        T = self.ctype
        cvt = "" if A == T else f"({A})"
        elem_loads = []
        if "x" in names:
            elem_loads.append(f"const {A} xv = {cvt}x[idx];")
        if "dy" in names:
            elem_loads.append(f"const {A} dyv = {cvt}dy[idx];")
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
        # scalar parameters are loaded once per group; channel parameters per channel
        scalar_loads = [f"const {A} {p}_v = {cvt}{p}[0];" for p in self.params if p in names and p in self.scalar]
        param_loads = [f"const {A} {p}_v = {cvt}{p}[ch];" for p in self.params
                       if p in names and p not in self.scalar]
        chan_sums = [(k, e) for k, e in param_sums if self.params[k] not in self.scalar]
        scal_sums = [(k, e) for k, e in param_sums if self.params[k] in self.scalar]
        group_sums = list(group_sums) + [(f"psum_{k}", e) for k, e in scal_sums]
        return CLoop(uses_params=bool(param_loads) or bool(chan_sums), prelude=prelude, param_loads=param_loads,
                     elem_loads=scalar_loads + elem_loads,
                     stores=[f(P) for f in stores],
                     group_sums=[(a, S(e)) for a, e in group_sums],
                     param_sums=[(k, S(e)) for k, e in chan_sums],
                     scalar_param_sums=[(k, f"psum_{k}") for k, _ in scal_sums],
                     param_pend=[(k, P(e)) for k, e in chan_sums], outputs=list(outputs),
                     prefetch=[a for a in ("x", "dy") if a in names] if first else [])

    def forward(self):
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
        final = self.loop([out_expr], temps, stores=[lambda P: ("y", f"({T})({P(out_expr)})")], arith=T,
                          outputs=["y"], first=first)
        updates = [(b, self.g(e)) for b, e in self.ir.buffer_updates]
        return steps, final, updates

    def backward(self):
        temps = list(self.ir.bwd_elem)
        red = None
        if self.ir.bwd_loop:
            red = self.loop([e for _, e in self.ir.bwd_loop], temps, group_sums=self.ir.bwd_loop, arith=self.ctype,
                            first=True)
        T = self.ctype
        coeffs = {k for k, _ in self.ir.dx_terms}
        means = {r for r, _ in zip((a.name for a in self.ir.bwd_group), self.ir.bwd_loop)}
        kept = [a for a in self.ir.bwd_group if a.name not in means and (T == "double" or a.name not in coeffs)]
        # the means stay sum/N (exact for constant rows); the values derived from them share
        # subexpressions (online layer norm's coefficients do): name those once
        repl, reduced = sympy.cse([a.expr for a in kept], symbols=sympy.numbered_symbols("cse"), order="none")
        group = [(a.name, self.g(a.expr), a.comment) for a in self.ir.bwd_group if a.name in means]
        group += [(str(t), self.g(e), "common subexpression") for t, e in repl]
        group += [(a.name, self.g(r), a.comment) for a, r in zip(kept, reduced)]
        # double: dx = sum of per-group coefficients times element monomials (fewest flops);
        # float: the factored closed form, whose cancellations the hi/lo addends keep exact
        if T == "double":
            dx_expr = Add(*[sympy.Symbol(k) * m for k, m in self.ir.dx_terms])
        else:
            dx_expr = self.ir.dx_closed
        pexprs = [e for _, e in self.ir.dparams]
        final = self.loop([dx_expr, *pexprs], temps, stores=[lambda P: ("dx", f"({T})({P(dx_expr)})")],
                          param_sums=list(enumerate(pexprs)), arith=T, outputs=["dx"], first=red is None)
        return red, [a for a, _ in self.ir.bwd_loop], group, final


# ------------------------------------------------------------------- rendering

@dataclass
class Emitted:
    name: str
    files: dict[str, str] = field(default_factory=dict)   # relative path -> text


def _grad_fields(spec: Spec) -> list[str]:
    return ["dx", *("d" + p.name for p in spec.params), *("d" + i.name for i in spec.inputs)]


def layer_meta(spec: Spec) -> dict:
    """The calling contract, as plain data (embedded in generated files)."""
    return {
        "name": spec.name,
        "layout": spec.layout,
        "reduce": spec.reduce,
        "params": [p.name for p in spec.params],
        "scalar_params": [p.name for p in spec.params if p.scalar],
        "axes": spec.axes,
        "param_init": {p.name: p.init for p in spec.params},
        "options": {o.name: (o.default, o.min, o.max) for o in spec.options},
        "inputs": [i.name for i in spec.inputs],
        "buffers": [b.name for b in spec.buffers],
        "buffer_init": {b.name: b.init for b in spec.buffers},
        "modes": [m.name for m in spec.modes],
        "min_group_size": {m.name: m.min_group_size for m in spec.modes},
        "stats": {m.name: [s.name for s in m.statistics] for m in spec.modes},
    }


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters["c"] = lambda e, ctype, names=None: c_expr(e, ctype, names)
    env.filters["pyrepr"] = repr
    env.filters["pformat"] = lambda v: pprint.pformat(v, width=96, sort_dicts=False)
    return env


def _formulas(d: Derivation) -> dict[str, list[str]]:
    """Human-readable formulas for headers, per mode."""
    spec = d.spec
    out = {}

    def T(e):
        return code_text(e, spec)
    for mname, md in d.modes.items():
        lines = ["forward:"] + [f"  {st.name} = {T(st.expr)}" for st in md.statistics]
        if spec.normalized is not None:
            lines.append(f"  {spec.normalized.name} = {T(md.normalized_expr)}")
        lines.append(f"  y = {T(spec.output)}")
        for b in (spec.buffers if mname == "train" else ()):
            lines.append(f"  {b.name} <- {T(b.update)}  (in place, not differentiated)")
        lines.append("backward (closed form, derived by derivgen):")
        if md.g is not None:
            lines.append(f"  g = {T(md.g)}")
        for r in md.reductions:
            lines.append(f"  {r.name} = mean({T(r.arg)})")
        lines.append(f"  dx = {T(md.dx_lowered)}")
        for p in spec.params:
            where = "all elements" if p.scalar else f"the axes {p.name} does not span"
            lines.append(f"  d{p.name} = sum of {T(md.dparams[p.name])} over {where}")
        for i, e in md.dinputs.items():
            lines.append(f"  d{i} = {T(md.lowered(e))}  (per group; summed for a scalar input)")
        out[mname] = lines
    return out


def emit(d: Derivation, targets=("numpy", "c")) -> Emitted:
    spec = d.spec
    env = _env()
    env.filters["np"] = lambda e: np_expr(e, spec)
    env.filters["npsum"] = lambda e, axes: np_sum(e, axes, spec)
    env.filters["code"] = lambda e: code_text(e, spec)
    env.globals["mean_of"] = Mean
    env.globals["np_store"] = lambda target, e: np_store(target, e, spec)
    _SPEC_FOR_PRINTING[0] = spec
    irs = {m: build_mode_ir(md) for m, md in d.modes.items()}
    cplans = {(m, sfx): CPlanner(spec, ir, ct) for m, ir in irs.items() for sfx, ct in CTYPES.items()}
    ctx = dict(spec=spec, meta=layer_meta(spec), irs=irs, modes=list(irs), formulas=_formulas(d),
               source=spec.source, cplans=cplans, grad_fields=_grad_fields(spec), ctypes=CTYPES, per_sample=spec.reduce != "batch")
    out = Emitted(spec.name)
    if "numpy" in targets:
        ctx_np = dict(ctx, template=TEMPLATE_FILES["numpy"])
        out.files[f"numpy/{spec.name}.py"] = env.get_template(TEMPLATE_FILES["numpy"]).render(**ctx_np)
    if "c" in targets:
        for key, path in (("h", f"c/{spec.name}.h"), ("c", f"c/{spec.name}.c"), ("cbind", f"c/{spec.name}.py")):
            out.files[path] = env.get_template(TEMPLATE_FILES[key]).render(**dict(ctx, template=TEMPLATE_FILES[key]))
    return out


def emit_layer(name_or_spec, targets=("numpy", "c")) -> Emitted:
    return emit(derive(name_or_spec), targets)

