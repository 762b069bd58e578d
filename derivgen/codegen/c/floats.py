"""Where a float kernel's sweeps may compute in float, and what they keep for the next sweep:
the statistic summands added in float (widened to double: the sums stay double), the
selections taken in float, and the calls of elementary functions a sweep computes and the
next reads back (``Kv0``, ...) instead of calling them again. Used by the sweep planner
(:mod:`derivgen.codegen.c.sweep`); docs/numerics.md says what each choice guarantees."""

from __future__ import annotations

from collections.abc import Callable

import sympy
from sympy import Add, Mul

from derivgen.codegen.c.types import CDecl
from derivgen.spec.model import X as DATA_X
from derivgen.symbolic.block import BlockMean
from derivgen.symbolic.functions import of_node
from derivgen.symbolic.window import Window


def float_prelude(
    every: list[sympy.Expr],
    elem: set[str],
    enames: dict[str, str],
    group: Callable[[sympy.Expr], tuple[str, frozenset[str]]],
    group_names: dict[str, str],
    exact: frozenset[str] = frozenset(),
) -> tuple[list[CDecl], dict]:
    """Float element arithmetic: group-level addends of mixed sums become hi/lo pairs
    (H0_hi + H0_lo), other group values float copies (rstd_F). A product that divides by a group value has its group factors as one
    float constant, computed in double and rounded once (Qf0 = (float)(Mean_g*N/s)): no
    element divides, where a float division costs several multiplications, and the constant is
    as accurate as the float copies it replaces. A group addend that is ±one of the ``exact``
    values (a maximum or minimum of float data: softmax's x - m) is a float value and has no
    low half. Returns the prelude and the hoisted Add nodes (node -> (its element part, the
    hoisted name, whether it has a low half)) and Mul nodes (node -> (its element part, the
    constant's name)); updates ``enames``. ``group`` prints a group-level expression (double)
    with the names it reads."""
    prelude: list[CDecl] = []
    hoisted: dict = {}
    factors: dict[sympy.Expr, str] = {}

    def elemental(t: sympy.Expr) -> bool:
        return bool({str(v) for v in t.free_symbols} & elem) or t.has(Window)

    for e in every:
        for node in sympy.preorder_traversal(e):
            if not (node.is_Add or node.is_Mul) or node in hoisted:
                continue
            ee = [t for t in node.args if elemental(t)]
            ge = [t for t in node.args if t not in ee]
            if node.is_Mul:
                if ee and any(t.is_Pow and t.exp.is_negative for t in ge):
                    g = Mul(*ge)
                    if g not in factors:  # one constant per group factor
                        factors[g] = q = f"Qf{len(factors)}"
                        text, reads = group(g)
                        prelude.append(CDecl("float", q, f"(float)({text})", reads))
                    hoisted[node] = (Mul(*ee), factors[g])
            elif ge and ee:
                h = f"H{sum(isinstance(k, Add) for k in hoisted)}"
                lo = not (len(ge) == 1 and str(-ge[0] if ge[0].could_extract_minus_sign() else ge[0]) in exact)
                hoisted[node] = (Add(*ee), h, lo)
                prelude.append(CDecl("double", h, *group(Add(*ge))))
                prelude.append(CDecl("float", f"{h}_hi", f"(float){h}", frozenset({h})))
                if lo:
                    prelude.append(
                        CDecl("float", f"{h}_lo", f"(float)({h} - (double){h}_hi)", frozenset({h, f"{h}_hi"}))
                    )
    used: set[str] = set()

    def collect(node):
        if node in hoisted:  # only its element part is printed in float
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
        src = group_names.get(gname, gname)
        f = src + "_F"  # rstd_F, Mean_g_F: an upper-case tag, derivgen's namespace
        prelude.append(CDecl("float", f, f"(float){src}", frozenset({src})))
        enames[gname] = f
    return prelude, hoisted


def shared_calls(first: list[sympy.Expr], later: list[sympy.Expr]) -> list[tuple[sympy.Expr, str]]:
    """The calls of elementary functions with a float vector version (``Dg_expf``, ...) in
    ``first`` that ``later`` computes again, outermost first, named Kv0, Kv1, ...; none where
    ``later`` holds block means or windows (double arithmetic, a row's neighbours)."""
    if any(e.has(BlockMean, Window) for e in (*first, *later)):
        return []
    calls: list[sympy.Expr] = []
    for e in first:
        for node in sympy.preorder_traversal(e):
            fn = of_node(node) if isinstance(node, sympy.Function) else None
            if fn is None or not fn.c_float.startswith("Dg_") or node in calls:
                continue
            if any(o.has(node) for o in later) and not any(c.has(node) for c in calls):
                calls.append(node)
    return [(f, f"~Kv{k}") for k, f in enumerate(calls)]


def kv(name: str) -> str:
    """The C name of a kept value: its symbol ``~Kv0`` (no spec's name; it sorts after every
    name in a product, where the call it stands for was printed, so the arithmetic is the
    same) is ``Kv0`` in C; other names are themselves."""
    return name.removeprefix("~")


def sums_in_float(e: sympy.Expr, elem: set[str], gradient: bool = False) -> bool:
    """Whether a float kernel's sweep adds ``e`` in float arithmetic (widened to double as it
    is added: the sums stay double): where ``e`` calls an elementary function the kernels
    compute with a polynomial (``Dg_expf``, ``Dg_logf``, ... of ``derivgen-kernels.h``), whose
    double version costs about twice the float one, and its element arithmetic rounds without
    cancelling: every sum in it has at most one term that varies with the element (group
    terms are added as hi + lo pairs), and no element value is raised to a power (a square may
    overflow float, and a centred moment keeps double's exactness). exp(x - m) of softmax is
    the case this is for in a statistic (docs/numerics.md: the error bound).

    A ``gradient`` summand (the backward's: its reduction sweep's group sums, a scalar
    parameter's sum in its dx sweep, which computes dx from the same element values in float)
    may also hold powers of a function's value or inside a function's argument: Dynamic Tanh's
    x (1 - tanh^2(alpha x)), Derf's x exp(-(alpha x + s)^2). Its terms are then dx's own
    values, their calls computed once."""

    def varies(t: sympy.Expr) -> bool:
        return any(str(v) in elem for v in t.free_symbols)

    def poly_call(node: sympy.Basic) -> bool:
        fn = of_node(node) if isinstance(node, sympy.Function) else None
        return fn is not None and fn.c_float.startswith("Dg_")

    def ok(node: sympy.Basic, in_call: bool) -> bool:
        if isinstance(node, (Window, BlockMean)):
            return False
        if node.is_Add and sum(varies(t) for t in node.args) > 1:
            return False
        power = node.is_Pow and varies(node.base) and node.exp != -1
        if power and not (gradient and (in_call or any(map(poly_call, sympy.preorder_traversal(node.base))))):
            return False
        return all(ok(a, in_call or poly_call(node)) for a in node.args)

    return ok(e, False) and any(poly_call(n) for n in sympy.preorder_traversal(e))


def exact_selection(e: sympy.Expr) -> bool:
    """Whether a selection's element value is exact in x's own arithmetic: x, -x, |x| (the
    maximum of float values is one of them, so it may be taken in float)."""
    while isinstance(e, sympy.Abs) or (e.is_Mul and len(e.args) == 2 and e.args[0] == -1):
        e = e.args[0] if isinstance(e, sympy.Abs) else e.args[1]
    return e == DATA_X
