"""The table of elementary functions (derivgen.symbolic.functions): every entry is consistent
with SymPy and with itself across the parser, the derivative rule, the sign and
domain rules and the NumPy / C / PyTorch / LaTeX / text spellings; and a function
added to the table only (a test-local entry) flows through parse -> derive -> prove
-> generated NumPy."""

import ctypes
import itertools
import math

import numpy as np
import pytest
import sympy
import torch
from conftest import ROOT

import derivgen
from derivgen.codegen.printers import SpecPrinter, np_expr, torch_expr
from derivgen.explain.document import latex_expr, text_expr
from derivgen.runtime.build import build_shared
from derivgen.runtime.elementwise import numpy_function
from derivgen.spec import N, parse_spec, reserved_reason
from derivgen.spec.expr import ExprError, parse_expr
from derivgen.symbolic import domain, functions
from derivgen.symbolic.functions import NONNEG, POSITIVE, REAL, Elementary
from derivgen.symbolic.naming import code_text
from derivgen.torch import _target

U = sympy.Symbol("u", real=True)
POINTS = {REAL: (-1.3, -0.4, 0.0, 0.3, 1.9), NONNEG: (0.0, 0.3, 0.7, 1.9), POSITIVE: (0.3, 0.7, 1.9)}

# a function the shipped table does not have: arctangent
ATAN = Elementary(
    "atan",
    sympy.atan,
    sympy.atan,
    lambda f, u: 1 / (1 + u**2),
    "arctangent",
    lambda level: level,
    REAL,
    numpy="arctan",
    c_double="atan",
    c_float="atanf",
    torch="atan",
    scalar=math.atan,
    latex=r"\operatorname{atan}",
    text="atan",
)


def c_expr(e: sympy.Expr, ctype: str) -> str:
    """The C printer's text for e (the printer of a catalogue spec; no spec names in e)."""
    return SpecPrinter(derivgen.load_spec("layernorm")).c(e, ctype)


@pytest.fixture
def atan():
    functions.register(ATAN)
    try:
        yield ATAN
    finally:
        functions.unregister(ATAN.name)


def defined_points(fn: Elementary) -> tuple[float, ...]:
    """Points where ``fn`` is defined: those its ``requires`` allows, zero left out
    where the derivative has no value there (sqrt, abs, sign, step)."""
    return tuple(p for p in POINTS[fn.requires] if p != 0.0)


ARGS = [U, sympy.Symbol("v", real=True), sympy.Symbol("w", real=True)]


def argument_points(fn: Elementary) -> list[tuple[float, ...]]:
    """Argument tuples where ``fn`` is defined and differentiable: one argument at its
    points; several at combinations off the ties (maximum(a, b) with a != b, clip with
    lo < hi and e inside, below and above)."""
    if fn.arity == 1:
        return [(u,) for u in defined_points(fn)]
    if fn.arity == 2:
        return [(a, b) for a in (-1.3, 0.3, 1.9) for b in (-0.4, 0.7) if a != b]
    return [(e, -0.5, 0.8) for e in (-1.3, -0.2, 0.3, 1.9)]


def sympy_value(e: sympy.Expr, *u: float) -> float:
    return float(e.xreplace({a: sympy.Float(v, 30) for a, v in zip(ARGS, u)}).evalf(30))


def check_entry(fn: Elementary, c_values: dict | None = None):
    """The checks every entry passes, shipped or registered."""
    args = ARGS[: fn.arity]
    built = fn.build(*args)
    assert fn.node is None or isinstance(built, fn.node)
    assert fn.node is not None or functions.half_power_sign(built) == 1  # sqrt is a power
    # the parser accepts the functions of the language, and they are reserved names
    names = {a.name: a for a in args}
    call_text = f"{fn.name}({', '.join(names)})"
    if fn.in_language:
        assert parse_expr(call_text, names, group_size=N) == built
        assert reserved_reason(fn.name) is not None
    else:
        with pytest.raises(ExprError, match="unknown function"):
            parse_expr(call_text, names, group_size=N)
    for point in argument_points(fn):
        want = sympy_value(built, *point)
        # the derivative rule is SymPy's derivative (one argument; the selections' fdiff
        # against a finite difference of the function itself)
        if fn.derivative is not None:
            exact = sympy.diff(built, U)
            rule = fn.derivative(built, U)
            assert sympy_value(rule, *point) == pytest.approx(sympy_value(exact, *point), rel=1e-12, abs=1e-14)
        for k, a in enumerate(args):
            h = 1e-7
            up = list(point)
            dn = list(point)
            up[k] += h
            dn[k] -= h
            fd = (fn.scalar(*up) - fn.scalar(*dn)) / (2 * h)
            if fn.name == "stop_gradient":
                fd = 0.0  # its value moves, its derivative is zero by definition
            assert sympy_value(sympy.diff(built, a), *point) == pytest.approx(fd, rel=1e-6, abs=1e-7)
        # NumPy, PyTorch (tensor and plain number) and C agree with SymPy
        assert float(numpy_function(fn)(*point)) == pytest.approx(want, rel=1e-14, abs=1e-15)
        t = getattr(_target, fn.name)
        tensors = [torch.tensor(u, dtype=torch.float64) for u in point]
        assert t(*tensors).item() == pytest.approx(want, rel=1e-14, abs=1e-15)
        assert t(tensors[0], *point[1:]).item() == pytest.approx(want, rel=1e-14, abs=1e-15)
        assert float(t(*point)) == pytest.approx(want, rel=1e-14, abs=1e-15)
        if c_values is not None:
            assert c_values[fn.name, "double"](*point) == pytest.approx(want, rel=1e-14, abs=1e-15)
            assert c_values[fn.name, "float"](*point) == pytest.approx(want, rel=1e-6, abs=1e-7)
    # the sign rule holds at points of each sign the arguments may have
    for levels in itertools.product(POINTS, repeat=fn.arity):
        out = fn.sign(*levels)
        for point in itertools.product(*(POINTS[level] for level in levels)):
            if fn.arity == 1 and not (point[0] in defined_points(fn) or (point[0] == 0.0 and fn.requires != POSITIVE)):
                continue
            v = sympy_value(built, *point)
            assert v >= 0 if out >= NONNEG else True
            assert v > 0 if out == POSITIVE else True
    # the domain rule: an argument known never to be what the function requires is rejected
    if fn.requires != REAL:
        p = sympy.Symbol("p", positive=True)
        assert domain.domain_error(fn.build(-p)) is not None
    # derivgen.symbolic.domain applies the rule (where SymPy keeps F(p) as it is: sign(p) is 1)
    pos = [sympy.Symbol(f"p{k}", positive=True) for k in range(fn.arity)]
    at_positive = fn.build(*pos)
    if fn.node is None or isinstance(at_positive, fn.node):
        assert domain.sign_level(at_positive) == fn.sign(*[POSITIVE] * fn.arity)
    check_spellings(fn)


def check_spellings(fn: Elementary):
    """The printers spell the entry as it says."""
    names = ["a", "b", "c"][: fn.arity]
    e = fn.build(*(sympy.Symbol(n, real=True) for n in names))
    listed = ", ".join(names)
    home = "_rt" if fn.numpy_in_runtime else "_np"
    assert np_expr(e) == f"{home}.{fn.numpy}({listed})"
    assert torch_expr(e) == f"_t.{fn.name}({listed})"
    for ctype in ("float", "double"):
        assert c_expr(e, ctype) == functions.call(fn.c(ctype), *names)
    assert code_text(e) == f"{fn.text}({listed})"
    # derivations for people write the absolute value as |a|
    assert text_expr(e) == ("|a|" if fn.name == "abs" else f"{fn.text}({listed})")
    if "{0}" in fn.latex:
        assert latex_expr(e) == fn.latex.format(*names)
    elif fn.arity == 1:
        assert latex_expr(e) == fn.latex + r"{\left(a \right)}"
        assert latex_expr(e**2) == fn.latex + r"^{2}{\left(a \right)}"
    else:
        assert latex_expr(e) == fn.latex + rf"{{\left({listed} \right)}}"


def compiled(entries, tmp_path) -> dict:
    """Each entry's C spellings (as the C printer prints them) compiled and callable."""
    # the C spellings call the shared header's vectorizable functions (Dg_expf ...) as the kernels do
    (tmp_path / "derivgen-kernels.h").write_text((ROOT / "generated" / "c" / "derivgen-kernels.h").read_text())
    lines = ['#pragma GCC diagnostic ignored "-Wunused-function"', '#include "derivgen-kernels.h"']
    for fn in entries:
        names = ["a", "b", "c"][: fn.arity]
        for ctype in ("float", "double"):
            body = c_expr(fn.build(*(sympy.Symbol(n, real=True) for n in names)), ctype)
            params = ", ".join(f"{ctype} {n}" for n in names)
            lines.append(f"{ctype} f_{fn.name}_{ctype}({params}) {{ return ({ctype})({body}); }}")
    src = tmp_path / "table_functions.c"
    src.write_text("\n".join(lines) + "\n")
    lib = ctypes.CDLL(str(build_shared(src, openmp=False)))
    out = {}
    for fn in entries:
        for ctype, ct in (("float", ctypes.c_float), ("double", ctypes.c_double)):
            f = getattr(lib, f"f_{fn.name}_{ctype}")
            f.restype, f.argtypes = ct, [ct] * fn.arity
            out[fn.name, ctype] = f
    return out


def test_every_entry_is_consistent(tmp_path):
    c_values = compiled(functions.TABLE.values(), tmp_path)
    assert {"sqrt", "exp", "log", "abs", "tanh", "sigmoid", "erf", "maximum", "clip"} <= set(functions.language())
    for fn in functions.TABLE.values():
        check_entry(fn, c_values)


def test_registered_entry_is_consistent(atan, tmp_path):
    check_entry(atan, compiled([atan], tmp_path))
    assert reserved_reason("atanf") == "a C library name the generated code uses"


def test_register_refuses_a_second_entry_of_a_name():
    with pytest.raises(ValueError, match="already"):
        functions.register(functions.TABLE["exp"])


ATAN_SPEC = """
name = "atannorm"
title = "arctangent norm"
summary = "test: a layer whose statistic uses a function registered in the table only"

[layout]
kind = "trailing"

[params]
gamma = { role = "scale" }

[options]
eps = { default = 1e-5, min = 0 }

[statistics]
mean = { expr = "mean(x)" }
var = { expr = "mean((x - mean)**2)" }
scale = { expr = "1/(1 + atan(var + eps))" }

[normalized]
name = "xhat"
expr = "(x - mean)*scale"

[output]
y = "gamma*xhat"
"""


def test_registered_function_flows_to_numpy(atan, tmp_path):
    spec = parse_spec(ATAN_SPEC, source="test")
    d = derivgen.derive(spec, prove=(2, 3))
    assert d.proofs and all(r.ok for mp in d.proofs.values() for r in mp.results)
    path = tmp_path / "atannorm.toml"
    path.write_text(ATAN_SPEC)
    k = derivgen.load(str(path), backend="numpy")
    rng = np.random.default_rng(0)
    x, gamma, dy = rng.normal(size=(3, 5)), rng.normal(size=5), rng.normal(size=(3, 5))

    def forward(x):
        c = x - x.mean(-1, keepdims=True)
        return gamma * c / (1 + np.arctan((c**2).mean(-1, keepdims=True) + 1e-5))

    y, cache = k.forward(x, gamma)
    np.testing.assert_allclose(y, forward(x), rtol=1e-12)
    dx = k.backward(dy, cache).dx
    h = 1e-6
    fd = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = h
        fd[i] = ((forward(x + e) - forward(x - e)) * dy).sum() / (2 * h)
    np.testing.assert_allclose(dx, fd, rtol=1e-6, atol=1e-8)


def test_selection_gradients_follow_torch_at_ties_and_crossed_bounds():
    """maximum, minimum and clip differentiated by the table's rules equal PyTorch autograd
    of torch.maximum, torch.minimum and torch.clamp (tensor bounds), at ties, at a bound,
    with lo = hi and with lo > hi (where clamp gives hi everywhere)."""
    cases = [
        ("maximum", torch.maximum, [(0.3, 0.3), (0.3, -0.2), (-1.0, 2.0)]),
        ("minimum", torch.minimum, [(0.3, 0.3), (0.3, -0.2), (-1.0, 2.0)]),
        (
            "clip",
            torch.clamp,
            [(e, lo, hi) for lo, hi in ((-0.5, 0.5), (0.3, 0.3), (0.5, -0.5)) for e in (-1.0, lo, 0.3, hi, 0.4, 1.0)],
        ),
    ]
    for name, ref, points in cases:
        fn = functions.TABLE[name]
        built = fn.build(*ARGS[: fn.arity])
        for point in points:
            ts = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in point]
            ref(*ts).backward()
            for k, t in enumerate(ts):
                got = sympy_value(sympy.diff(built, ARGS[k]), *point)
                assert got == t.grad.item(), (name, point, k, got, t.grad.item())


def test_step_in_c_has_the_scalar_values_at_zeros_infinities_and_nan(tmp_path):
    """step prints as two selects added, not one nested in the other (GCC vectorizes the sum on
    AVX2 too): the scalar step's values at ±0, ±inf and NaN, in both element types."""
    fn = functions.TABLE["step"]
    c_values = compiled([fn], tmp_path)
    for v in (-2.0, -0.0, 0.0, 3.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45):
        for ctype in ("float", "double"):
            assert c_values["step", ctype](v) == fn.scalar(v), (v, ctype)
