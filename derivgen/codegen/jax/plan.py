"""The JAX target's planner: how each mode's JVP and VJP are written for XLA.

``jax.jit`` hands the printed expressions to XLA as they are, and JAX's reverse mode of the
default rule is the transpose of the printed JVP: every product of a tangent that is one
value per group (or per block) with an element value becomes, transposed, a sum of the
cotangent times that element value over x -- a pass over x-sized data. XLA's CPU code
(its YNNPACK fusions, JAX 0.10) writes to memory what such a sum reads that is not x, dy or
a product it can fuse: a per-group value broadcast to x's shape, a product two sums share.
The planner writes the closed forms so that there are few such sums and little to write.

Layers without block statistics print the IR as it is (:mod:`derivgen.codegen.ir`: per-group
coefficients times element monomials, the C kernels' form), with three exceptions:

* in trailing layouts and groups of one position's channels (where a parameter's gradient
  sums over other axes than the group's), a JVP's terms that are linear in the same
  per-group tangent (a group mean of the tangent, a scalar parameter's tangent), with
  coefficients that differ by a number and monomials that differ in parameter factors only,
  are gathered under it: ``Mean_tx_xhat*KTY_xhat*(xhat + xhat*w)`` transposes to one sum
  where ``KTY_xhat*xhat + KTY_w_xhat*xhat*w`` made two;
* in the same layouts, a monomial whose coefficient is one value per group prints with the
  parameters last (:class:`Term`);
* a layer without statistics (y a function of each element alone) computes its VJP's
  element factor once, shared by dx and the scalar parameters' sums (:func:`_elementwise`).

Layers with block statistics (:mod:`derivgen.symbolic.block`: switchable normalization's
instance, layer and batch statistics, EvoNorm-B0's instance variance) are rewritten with
what is one value on each instance (one sample's channel: the finest block), exactly:

* the forward's block values are handed from the forward to the JVP and the VJP
  (``residuals``) instead of being computed again from x;
* a block mean over a coarser block, a group mean and a parameter's gradient sum, which
  all sum over whole instances, take the per-instance factors of each term out of an
  instance mean first: ``mean(gamma*r*dy*x, "sample")`` is ``mean(gamma*r*mean(dy*x,
  "instance"), "sample")`` for gamma and r one value per instance, so every sum over x reads
  dy and x once into an instance mean and goes on with arrays of one value per instance;
* the JVP's tangent and the VJP's dx are written as coefficients that are one value per
  instance times element monomials (``KTY_1 + KTY_x*x + KTY_X_T*X_T``): transposed, the
  tangent's per-instance parts cost one sum over x per monomial, not one per term;
* each block mean is computed once, named (``Blk1``, ``Blk2`` ...), innermost first.

Each block mean's body is split only at its own terms and factors (no product of sums is
multiplied out), so a centred factor such as ``x - mu`` stays as the engine wrote it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sympy
from sympy import Add, Mul

from derivgen.codegen.ir import Assign, ModeIR, SecondIR, by_monomial
from derivgen.spec.model import DY, Spec
from derivgen.symbolic.block import BLOCK_AXES, CHANNEL_AXES, BlockMean, block_mean, outermost
from derivgen.symbolic.reduce import SELECTIONS, Mean
from derivgen.symbolic.window import Window

INNER = "instance"  # the finest block kind: inside every other kind and every group that holds blocks

Expr = sympy.Expr
Pairs = list[tuple[str, Expr]]


@dataclass(frozen=True)
class Term:
    """``k*m``: a coefficient's name (None: 1) times an element monomial (1: none); ``late``:
    the monomial prints with the parameters last (:func:`derivgen.codegen.jax.jax_monomial`),
    for a coefficient that is one value per group: JAX transposes the product from its last
    factor, and the cotangent is then multiplied by the parameter first (dy*gamma) before the
    group's sum. A coefficient of scalars keeps the parameter next to it (``K*gamma*...``):
    transposed, the sum over the rows comes first, then the product with gamma, one value
    per feature."""

    k: str | None
    m: Expr
    late: bool = False


@dataclass(frozen=True)
class Part:
    """One summand of a tangent: a term, or the terms linear in one per-group tangent
    ``atom`` gathered under it with their common coefficient ``k`` (``atom*k*(m1 - m2)``)."""

    terms: tuple[Term, ...]
    atom: str | None = None
    k: str | None = None


Steps = list[tuple[str, Expr, bool]]  # (name, value; True: the group mean of the value), in order


@dataclass(frozen=True)
class JaxJvp:
    """A mode's JVP as printed: element temporaries, the group means of the tangent and the
    named block means (in the order they read each other), the coefficients and each
    tangent's parts (or its closed form)."""

    temps: Pairs
    means: Steps
    group: Pairs  # the coefficients the parts name
    outputs: list[tuple[list[Part], Expr]]  # per tangent: its parts, and the closed form where it has none


@dataclass(frozen=True)
class JaxBackward:
    """A mode's VJP as printed: element temporaries, the group means and the named block
    means, dx's coefficients and terms (or its closed form), the parameters' element
    gradients."""

    temps: Pairs
    means: Steps
    group: Pairs
    dx_terms: list[tuple[str, Expr]]
    dx_closed: Expr
    dparams: Pairs


@dataclass(frozen=True)
class JaxMode:
    """What the JAX template prints of one mode beyond the IR."""

    residuals: tuple[str, ...]  # block values the forward returns beside the statistics
    fwd_elem: Pairs  # the forward's element values, y last
    jvp: JaxJvp | None
    bwd: JaxBackward


class Levels:
    """What is one value on which blocks: a layer's symbols by where they vary."""

    def __init__(self, group: Iterable[str], channel: Iterable[str], kinds: Mapping[str, frozenset[str]]) -> None:
        self.group = set(group)  # one value per group (statistics, coefficients, options ...)
        self.channel = set(channel)  # one value per channel (per-channel parameters and their seeds)
        self.kinds = dict(kinds)  # block statistic -> the kinds of block it is one value on

    def constant(self, e: Expr, kind: str) -> bool:
        """Is ``e`` one value on every block of ``kind``? Anything not known to be is not."""
        axes = set(BLOCK_AXES[kind])
        atoms = outermost(e)
        if any(not axes <= set(b.axes) for b in atoms):
            return False
        rest = e.xreplace({b: sympy.Dummy() for b in atoms}) if atoms else e
        if rest.has(Window):
            return False
        groupwise = rest.atoms(Mean, *SELECTIONS)
        if groupwise:
            rest = rest.xreplace({a: sympy.Dummy() for a in groupwise})
        for s in rest.free_symbols:
            n = s.name
            if isinstance(s, sympy.Dummy) or n in self.group:
                continue
            if n in self.kinds:
                if not any(axes <= set(BLOCK_AXES[k]) for k in self.kinds[n]):
                    return False
            elif n not in self.channel or axes & set(CHANNEL_AXES):
                return False
        return True

    def pull(self, body: Expr, kind: str, known: Mapping[BlockMean, Expr]) -> Expr:
        """``mean(body, kind)`` with the factors that are one value per block of ``kind``
        taken out of each term, terms of the same remaining product gathered (their sign
        taken out of a sum), a sum that is a term's only varying factor split by linearity
        (mean(c*(m - x)) = c*(m - mean(x))), and a block mean that defines a block statistic
        replaced by it. A product of varying factors is kept as it is: mean(dy*(x - mu))."""
        by_vary: dict[Expr, Expr] = {}
        total = sympy.S.Zero
        for term in Add.make_args(body):
            const, vary = [], []
            for f in Mul.make_args(term):
                (const if self.constant(f, kind) else vary).append(f)
            if len(vary) == 1 and vary[0].is_Add:
                total += Mul(*const) * self.pull(vary[0], kind, known)
                continue
            for i, f in enumerate(vary):
                if f.is_Add and f.could_extract_minus_sign():
                    const.append(sympy.S.NegativeOne)
                    vary[i] = -f
            v = Mul(*vary)
            by_vary[v] = by_vary.get(v, sympy.S.Zero) + Mul(*const)
        for v, c in by_vary.items():
            if v == 1:
                total += c
            else:
                b = block_mean(v, kind)
                total += c * known.get(b, b)
        return total

    def canon(self, e: Expr, known: Mapping[BlockMean, Expr]) -> Expr:
        """``e`` with every block mean in its one written form, innermost first: a block
        mean over a coarser block than an instance averages instance means."""
        if not e.has(BlockMean):
            return e

        def one(b: BlockMean) -> Expr:
            body = self.canon(b.body, known)
            if b.kind != INNER:
                body = self.pull(body, INNER, known)
            return self.pull(body, b.kind, known)

        return e.replace(lambda a: isinstance(a, BlockMean), one)

    def summed(self, e: Expr, known: Mapping[BlockMean, Expr]) -> Expr:
        """``e`` as an element value whose sum over any whole instances is e's: its terms'
        varying parts averaged over each instance (for a group mean, a block mean over a
        coarser block, a parameter's gradient sum)."""
        return self.pull(self.canon(e, known), INNER, known)


def hoist(exprs: list[Expr], used: set[str]) -> tuple[Pairs, list[Expr]]:
    """Every block mean in ``exprs`` named once (``Blk1``, ...), innermost first: the
    definitions, and ``exprs`` reading the names."""
    named: Pairs = []
    while True:
        inner = {b for e in exprs for b in e.atoms(BlockMean) if not b.body.has(BlockMean)}
        if not inner:
            return named, exprs
        table = {}
        for b in sorted(inner, key=sympy.default_sort_key):
            k = len(named) + 1
            while f"Blk{k}" in used:
                k += 1
            used.add(f"Blk{k}")
            named.append((f"Blk{k}", b))
            table[b] = sympy.Symbol(f"Blk{k}", real=True)
        exprs = [e.xreplace(table) for e in exprs]


def _ordered(means: Pairs, blocks: Pairs) -> Steps:
    """The group means and the named block means, each after those it reads."""
    todo = [(n, e, True) for n, e in means] + [(n, e, False) for n, e in blocks]
    out: Steps = []
    while todo:
        waiting = {n for n, _, _ in todo}
        ready = next(t for t in todo if not (_names([t[1]]) & (waiting - {t[0]})))
        out.append(ready)
        todo.remove(ready)
    return out


def _known(levels: Levels, blocks: Iterable[tuple[str, Expr]]) -> tuple[Pairs, dict[BlockMean, Expr]]:
    """The block values' definitions in their written form, each reading the block values
    before it where a block mean is one (mean(x, "sample") is the mean of mean(x, "instance")
    over the sample), and the block means that define block values, by their written form."""
    known: dict[BlockMean, Expr] = {}
    defs: Pairs = []
    for name, e in blocks:
        c = levels.canon(e, known)
        defs.append((name, c))
        if isinstance(c, BlockMean):
            known[c] = sympy.Symbol(name, real=True)
    return defs, known


def _names(exprs: Iterable[Expr]) -> set[str]:
    return {s.name for e in exprs for s in e.free_symbols}


def _jvp_by_atom(
    j: SecondIR, atoms: set[str], elements: set[str], params: set[str], pergroup: set[str]
) -> tuple[Pairs, list[tuple[list[Part], Expr]]]:
    """A layer without blocks: the JVP's coefficients and each tangent's parts, the terms
    linear in one per-group tangent gathered under it where there are several."""
    coef = {a.name: a.expr for a in j.group}
    symbol = {a: sympy.Symbol(a, real=True) for a in atoms}
    printed: dict[str, Expr] = {}  # coefficient name -> its value, as printed
    outputs = []
    for _, terms, closed in j.outputs:
        if not terms:
            outputs.append(([], closed))
            continue
        gathered = _gathered(terms, coef, symbol, elements, params)
        where = {i: a for a, (_, members) in gathered.items() for i, _ in members}
        parts: list[Part] = []
        for i, (k, m) in enumerate(terms):
            if i not in where:
                if coef[k] != 1:
                    printed[k] = coef[k]
                parts.append(Part((Term(None if coef[k] == 1 else k, m, bool(_names([coef[k]]) & pergroup)),)))
                continue
            a = where[i]
            common, members = gathered[a]
            if i != members[0][0]:
                continue  # printed with the first
            if common != 1:
                printed[k] = common
            late = bool(_names([common]) & pergroup)
            terms_ = tuple(Term(None, q * terms[n][1], late) for n, q in members)
            parts.append(Part(terms_, a, None if common == 1 else k))
        outputs.append((parts, closed))
    order = [a.name for a in j.group if a.name in printed]
    return [(n, printed[n]) for n in order], outputs


def _gathered(terms, coef, symbol, elements, params) -> dict[str, tuple[Expr, list[tuple[int, Expr]]]]:
    """{per-group tangent a: (c, [(term index, q), ...])} for the tangents that two terms or
    more are linear in, the terms' coefficients a·q·c with numbers q, their monomials holding
    no element tangent and differing only in factors of the parameters (and tensors) ``params``:
    the terms are a·c·(q1·m1 + q2·m2 ...), ``Mean_tx_xhat*K*(xhat + xhat*w)``. Gathered, they
    transpose to one sum of the cotangent times the monomials, which hold no per-group
    coefficient for XLA to write out broadcast. Monomials that differ in other element
    values (z and z*stop_gradient(k*z)), or in the parameters alone (1 and a tensor beside x:
    ``1 + scale``), are left as they are: XLA's CPU code wrote such a sum to memory before
    summing it, an x-sized array more than the sums it replaced."""
    single: dict[str, list[tuple[int, Expr]]] = {}
    for i, (k, m) in enumerate(terms):
        c = coef[k]
        found = [n for n, s in symbol.items() if c.has(s)]
        if len(found) != 1 or elements & _names([m]):
            continue
        s = symbol[found[0]]
        part = sympy.diff(c, s)
        if part.has(s) or sympy.expand(c - s * part) != 0:
            continue  # not linear in it (never for a JVP's coefficient): as it is
        single.setdefault(found[0], []).append((i, part))
    out = {}

    def beside_params(m: Expr) -> Expr:
        return Mul(*(f for f in Mul.make_args(m) if not (f.free_symbols and _names([f]) <= params)))

    for a, members in single.items():
        rest = {beside_params(terms[i][1]) for i, _ in members}
        if len(members) < 2 or len(rest) > 1 or rest == {1}:
            continue
        q0, base = members[0][1].as_coeff_Mul()
        ratios = []
        for i, part in members:
            q, rest = part.as_coeff_Mul()
            if rest != base:
                break
            ratios.append((i, q / q0))
        else:
            out[a] = (members[0][1], ratios)
    return out


def _unique_name(name: str, used: set[str]) -> str:
    while name in used:
        name += "_"
    used.add(name)
    return name


def _elementwise(ir: ModeIR, spec: Spec) -> JaxBackward | None:
    """The VJP of a layer without statistics (y a function of each element alone: Dynamic
    Tanh, Derf), whose dx = dy·∂y/∂x and whose parameters' gradients sum dy·∂y/∂p: the factor
    F that ∂y/∂x and the scalar parameters' ∂y/∂p share (γ·(1 - tanh²(αx))) is computed once,
    ``Dxe = dy*F``, and dx and those sums read it, as autodiff's cotangent of αx: XLA's CPU
    code computed dy·F in each of them, and wrote out its factors to share them. None where
    there is no such factor."""
    if ir.stats or ir.bwd_loop or spec.windows or spec.multi:
        return None
    element = {"x", *(p.name for p in spec.params if not p.scalar), *(m.name for m in spec.masks)}

    def per_dy(e: Expr) -> Expr | None:  # e/dy where e is dy times what is free of dy
        if DY not in Mul.make_args(e) or (e / DY).has(DY):
            return None
        return e / DY

    partial = {"x": per_dy(ir.dx_closed), **{p: per_dy(e) for p, e in ir.dparams}}
    if any(v is None for v in partial.values()):
        return None
    shared = ["x", *(p.name for p in spec.params if p.scalar)]
    common = None
    for v in shared:
        powers: dict[Expr, Expr] = {}
        for f in Mul.make_args(partial[v]):
            base, k = (f.base, f.exp) if f.is_Pow and f.exp.is_number else (f, sympy.S.One)
            powers[base] = powers.get(base, 0) + k
        if common is None:
            common = powers
            continue
        # a base both have, to the power nearer zero where both have it with the same sign
        common = {
            f: (min if k > 0 else max)(k, powers[f]) for f, k in common.items() if f in powers and k * powers[f] > 0
        }
    factor = Mul(*(f**k for f, k in (common or {}).items()))
    if len(shared) < 2 or not (factor.free_symbols and _names([factor]) & element):
        return None
    dxe = sympy.Symbol("Dxe", real=True)
    return JaxBackward(
        temps=[*ir.bwd_elem, ("Dxe", DY * factor)],
        means=[],
        group=[],
        dx_terms=[],
        dx_closed=(partial["x"] / factor) * dxe,
        dparams=[(p, dxe * partial[p] / factor if p in shared else e) for p, e in ir.dparams],
    )


def _plain(ir: ModeIR, j: SecondIR | None, spec: Spec) -> JaxMode:
    """A layer without block statistics: the IR as it is, the JVP's terms gathered by tangent."""
    kn = {k for k, _ in ir.dx_terms}
    bwd = _elementwise(ir, spec) or JaxBackward(
        temps=list(ir.bwd_elem),
        means=[(a.name, e, True) for a, (_, e) in zip(ir.bwd_group, ir.bwd_loop)],
        group=[(a.name, a.expr) for a in ir.bwd_group if a.name in kn],
        dx_terms=list(ir.dx_terms),
        dx_closed=ir.dx_closed,
        dparams=list(ir.dparams),
    )
    jvp = None
    if j is not None:
        scalar = {p.name for p in spec.params if p.scalar}
        atoms = {a.name for a in j.means}
        atoms |= {s for p, s in j.seed_params.items() if p in scalar} | set(j.seed_inputs.values())
        if spec.layout != "trailing" and spec.reduce != "position":
            atoms = set()  # a channel's sums share the positions with the group's: nothing gathered
        elements = {j.seed_x, *(s for p, s in j.seed_params.items() if p not in scalar), *j.seed_tensors.values()}
        params = {p.name for p in spec.params if not p.scalar} | {t.name for t in spec.tensors}
        pergroup = {*ir.stats, *(a.name for a in j.means), *j.seed_inputs.values()}
        pergroup |= {i.name for i in spec.inputs} | {b.name for b in spec.buffers}
        group, outputs = _jvp_by_atom(j, atoms, elements, params, pergroup)
        jvp = JaxJvp(
            temps=list(j.temps),
            means=[(a.name, e, True) for a, (_, e) in zip(j.means, j.loop)],
            group=group,
            outputs=outputs,
        )
    return JaxMode(residuals=(), fwd_elem=list(ir.fwd_elem), jvp=jvp, bwd=bwd)


def _with_blocks(ir: ModeIR, j: SecondIR | None, spec: Spec, kinds: Mapping[str, frozenset[str]]) -> JaxMode:
    """A layer with block statistics (see the module's docstring)."""
    channel = {p.name for p in spec.params if not p.scalar}
    group = {*ir.stats, *(a.name for a in ir.bwd_group), "N"}
    group |= {o.name for o in spec.options} | {i.name for i in spec.inputs} | {b.name for b in spec.buffers}
    group |= {p.name for p in spec.params if p.scalar}
    if j is not None:
        channel |= {s for p, s in j.seed_params.items() if p in channel}
        group |= {a.name for a in j.means} | {a.name for a in j.group} | set(j.seed_inputs.values())
        group |= {s for p, s in j.seed_params.items() if p not in channel}
    levels = Levels(group, channel, kinds)
    residuals = [n for n in kinds]
    defs, known = _known(levels, [(n, e) for n, e in ir.fwd_elem if n in kinds])
    by_name = dict(defs)
    fwd_elem = [(n, by_name.get(n, e)) for n, e in ir.fwd_elem]

    def is_elem(f: Expr) -> bool:
        return not levels.constant(f, INNER)

    # the VJP
    used = {a.name for a in ir.bwd_group} | set(kinds) | {n for n, _ in ir.bwd_elem}
    loop = [(a.name, levels.summed(e, known)) for a, (_, e) in zip(ir.bwd_group, ir.bwd_loop)]
    assigns, terms = by_monomial(levels.canon(ir.dx_closed, known), is_elem, "K_", used, spec, of=" in dx")
    dparams = [(p, levels.summed(e, known)) for p, e in ir.dparams]
    exprs = [e for _, e in loop] + [a.expr for a in assigns] + [m for _, m in terms] + [e for _, e in dparams]
    blocks, exprs = hoist(exprs, used)
    n1, n2, n3 = len(loop), len(loop) + len(assigns), len(loop) + len(assigns) + len(terms)
    bwd = JaxBackward(
        temps=[(n, e) for n, e in ir.bwd_elem if n not in kinds],
        means=_ordered([(n, e) for (n, _), e in zip(loop, exprs[:n1])], blocks),
        group=[(a.name, e) for a, e in zip(assigns, exprs[n1:n2])],
        dx_terms=[(k, m) for (k, _), m in zip(terms, exprs[n2:n3])],
        dx_closed=ir.dx_closed,
        dparams=[(p, e) for (p, _), e in zip(dparams, exprs[n3:])],
    )
    jvp = None
    if j is not None:
        used = {a.name for a in j.group} | {a.name for a in j.means} | set(kinds) | {n for n, _ in j.temps}
        loop = [(a.name, levels.summed(e, known)) for a, (_, e) in zip(j.means, j.loop)]
        group_: list[Assign] = []
        outs = []
        for name, _, closed in j.outputs:
            a, t = by_monomial(levels.canon(closed, known), is_elem, f"K{name.upper()}_", used, spec)
            group_ += a
            outs.append((t, closed))
        exprs = [e for _, e in loop] + [a.expr for a in group_] + [m for t, _ in outs for _, m in t]
        blocks, exprs = hoist(exprs, used)
        n1, n2 = len(loop), len(loop) + len(group_)
        coef = {a.name: e for a, e in zip(group_, exprs[n1:n2])}
        monos = iter(exprs[n2:])
        outputs = []
        for t, closed in outs:
            parts = [Part((Term(None if coef[k] == 1 else k, next(monos)),)) for k, _ in t]
            outputs.append((parts, closed))
        jvp = JaxJvp(
            temps=[(n, e) for n, e in j.temps if n not in kinds],
            means=_ordered([(n, e) for (n, _), e in zip(loop, exprs[:n1])], blocks),
            group=[(n, e) for n, e in coef.items() if e != 1],
            outputs=outputs,
        )
    return JaxMode(residuals=tuple(residuals), fwd_elem=fwd_elem, jvp=jvp, bwd=bwd)


def plan_jax(layer) -> dict:
    """The JAX template's context beyond the IR: ``jx``, each mode's :class:`JaxMode`."""
    spec = layer.spec
    out = {}
    for mode, ir in layer.irs.items():
        first = layer.d.modes[mode]
        j = layer.second_irs[mode].get("jvp")
        kinds = {b.name: b.kinds for b in first.blocks}
        if kinds and spec.core is None:
            out[mode] = _with_blocks(ir, j, spec, kinds)
        else:
            out[mode] = _plain(ir, j, spec)
    return {"jx": out}
