"""Run values (derivgen.codegen.c.hoist): a block sweep's arithmetic that reads no element
value is named and computed once per run of positions, as the expression holds it; and an
element value that several terms divide by is one reciprocal per element (``reciprocals``)."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import sympy
from sympy import Pow, sqrt, symbols

import derivgen
from derivgen.codegen.c.hoist import RunValues, hoist, reciprocals
from derivgen.codegen.c.types import BlockPass, CLoop
from derivgen.spec import parse_spec

emit_module = importlib.import_module("derivgen.codegen.emit")  # the module (the package exports its emit())

x, dy, gamma, mu, var, eps, beta, m = symbols("x dy gamma mu var eps beta m")


def _back(e: sympy.Expr, runs) -> sympy.Expr:
    """``e`` with its run values (and run temporaries) replaced by what they stand for."""
    for nm, te in reversed(runs):
        e = e.xreplace({sympy.Symbol(nm): te})
    return e


def _divisions(e: sympy.Expr) -> list[sympy.Expr]:
    return [p for p in e.atoms(Pow) if p.exp.is_negative]


def test_a_product_and_a_sum_keep_their_element_parts_and_name_the_rest():
    e = gamma * (x - mu) / sqrt(var + eps) + beta * mu / var
    runs, temps, (out,) = hoist([], [e], {"x"}, RunValues())
    assert temps == []
    assert all(x not in te.free_symbols for _, te in runs)
    assert not _divisions(out)  # the element multiplies by a run value
    assert x - mu in out.atoms(sympy.Add)  # x - mu is computed as written, not expanded
    assert sympy.simplify(_back(out, runs) - e) == 0


def test_a_negated_name_is_not_a_run_value():
    runs, _, (out,) = hoist([], [dy * (x - m)], {"x", "dy"}, RunValues())
    assert runs == [] and out == dy * (x - m)
    runs, _, (out,) = hoist([], [mu - gamma * x], {"x"}, RunValues())  # -gamma*x: -1 and gamma fixed
    assert runs == [] and out == mu - gamma * x


def test_temporaries_reading_no_element_value_are_run_values():
    temps = [("t", mu / var), ("u", x * gamma / var), ("w", x - mu)]
    runs, others, (out,) = hoist(temps, [sympy.Symbol("u") * sympy.Symbol("t") + dy], {"x", "dy"}, RunValues())
    assert runs[0] == ("t", mu / var)  # read by nothing varying: once a run
    assert others[1] == ("w", x - mu)  # nothing to name
    assert others[0][0] == "u"
    u = others[0][1]
    assert not _divisions(u) and x in u.free_symbols
    assert _back(u, runs) == x * gamma / var
    assert out == sympy.Symbol("u") * sympy.Symbol("t") + dy


def test_one_registry_gives_an_expression_one_name_in_every_sweep():
    reg = RunValues()
    a, _, _ = hoist([], [x * gamma / var], {"x"}, reg)
    b, _, _ = hoist([], [dy * gamma / var], {"dy"}, reg)
    assert a == b  # passes walked together declare it once


SPEC = """
name = "runs"
[layout]
kind = "channels"
reduce = "all"
[params]
gamma = { role = "scale" }
w = { shape = "scalar", init = 0.5 }
[statistics]
m_in = 'mean(x, "instance")'
m_bn = 'mean(x, "batch")'
v_in = 'mean((x - m_in)**2, "instance")'
[output]
y = "gamma*(x - exp(w)*m_in - m_bn)/sqrt(v_in + 1)"
"""


def _loops(obj):
    """Every CLoop and BlockPass in a kernel plan."""
    if isinstance(obj, (CLoop, BlockPass)):
        yield obj
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _loops(getattr(obj, f.name))
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _loops(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _loops(v)


def test_block_sweeps_divide_once_a_run_and_agree_with_numpy():
    spec = parse_spec(SPEC, source="runs.toml")
    d = derivgen.derive(spec)
    source = emit_module.emit(d, ("c",)).files["c/runs.c"]
    assert "const double Run" in source
    plans = d.memo(("c plans",), lambda: None)  # planned by emit, once per derivation
    checked = 0
    for lp in _loops(plans):
        if isinstance(lp, BlockPass):
            element = [*lp.elem_loads, lp.body]
        elif any("Bm" in t for t in (*lp.param_loads, *lp.elem_loads)):
            element = [*lp.elem_loads, *(t for _, t in lp.stores), *(t for _, t in lp.group_sums)]
            element += [t for _, t in lp.param_sums]
        else:
            continue
        checked += 1
        assert not any("/" in t or "sqrt" in t or "Dg_exp" in t for t in element), element
    assert checked >= 6  # the passes, the output sweep and the backward's sweeps, per element type
    # the C kernels (float64; 1, 2 and 3 threads) against the NumPy target
    rng = np.random.default_rng(5)
    xv = rng.normal(3.0, 2.0, (6, 4, 5, 7))
    g = rng.normal(1.0, 0.2, 4)
    w = np.array([0.3])
    d = rng.normal(size=xv.shape)
    ref = derivgen.load(spec, backend="numpy")
    yr, cr = ref.forward(xv, g, w)
    gr = ref.backward(d, cr)
    k = derivgen.load(spec, backend="c")
    outs = []
    for threads in (1, 2, 3):
        k.set_num_threads(threads)
        y, cache = k.forward(xv, g, w)
        gc = k.backward(d, cache)
        np.testing.assert_allclose(y, yr, rtol=1e-12, atol=1e-12)
        for a, b in zip(gc, gr):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
        outs.append([y, gc.dx, gc.dw])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert np.array_equal(a, b)  # the same bits on any thread count


def test_an_element_divisor_of_several_terms_is_one_reciprocal():
    """dx and two sums divide by d = max(x, m) (powers 1 and 2): one Rcp0 = 1/d after the
    temporary it reads, no division left; a divisor of one term, or one reading no element
    value, stays a division (a reciprocal would only add a multiplication)."""
    d = sympy.Max(sympy.Symbol("Xn"), m)
    temps = [("Xn", x * gamma)]
    exprs = [dy / d, dy * x / d**2, x / d, beta / (x + 1), dy / var + x / var]
    out_temps, out = reciprocals(temps, exprs, {"x", "dy"})
    assert [nm for nm, _ in out_temps] == ["Xn", "Rcp0"] and out_temps[1][1] == 1 / d
    r = sympy.Symbol("Rcp0")
    assert out[:3] == [dy * r, dy * x * r**2, x * r]
    assert out[3:] == exprs[3:]  # one division by x + 1; var is not an element value
    assert [e.xreplace({r: 1 / d}) for e in out] == exprs


def test_evonorm_b0_divides_once_an_element():
    """EvoNorm-B0's dx sweep (double: it reads block values) divides dx and two parameter sums
    by max(v x + ..., sqrt(...)): one reciprocal per element, and its stores divide by
    nothing."""
    text = next(t for p, t in emit_module.emit(derivgen.derive("evonorm_b0"), ["c"]).files.items() if p.endswith(".c"))
    bwd = text.split("train backward, float ----", 1)[1].split("----", 1)[0]
    assert "const double Rcp0 = 1.0/Dg_fmax(" in bwd
    stores = [ln.split(" = ", 1)[1] for ln in bwd.splitlines() if "dx_R[" in ln and "] = " in ln]
    assert stores and not any("/" in rhs for rhs in stores)
