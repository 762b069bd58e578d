"""Integer powers in the C kernels: b**n for 2 <= |n| <= 16 printed as products (b*b ... for
|n| <= 4, as they always were; by squaring from 5 on), no pow() call, and their rounding within
the documented bound: at most |n| - 1 products, each rounding once, and a division for n < 0,
so a relative error below (|n| - 1 + [n < 0]) units of rounding to first order
(docs/numerics.md). Other powers call Dg_powf (float) and Dg_pow (double)."""

import ctypes
import random
import re
import subprocess
from fractions import Fraction

import pytest
import sympy
from conftest import require_tool

import derivgen
from derivgen.codegen import printers
from derivgen.codegen.emit import emit
from derivgen.symbolic.naming import ordered_names
from derivgen.symbolic.window import Window

X = sympy.Symbol("x", real=True)
EXPONENTS = [n for n in range(-16, 17) if abs(n) >= 2]


def _c(ctype: str, e: sympy.Expr) -> str:
    return printers._C(ctype, {"x": "Xv"}, ()).doprint(e)


def test_small_powers_are_printed_as_before():
    """|n| <= 4: the left-to-right products the committed generated code has."""
    assert _c("float", X**2) == "(Xv*Xv)"
    assert _c("double", X**3) == "(Xv*Xv*Xv)"
    assert _c("float", X**4) == "(Xv*Xv*Xv*Xv)"
    assert _c("double", X**-2) == "(1/(Xv*Xv))"


@pytest.mark.parametrize("ctype", ["float", "double"])
def test_integer_powers_call_nothing(ctype):
    for n in EXPONENTS:
        text = _c(ctype, X**n)
        assert "pow" not in text, (n, text)
    assert _c(ctype, X**17).startswith("Dg_powf(" if ctype == "float" else "Dg_pow(")
    assert _c(ctype, X ** sympy.Rational(3, 4)).startswith("Dg_powf(" if ctype == "float" else "Dg_pow(")


def test_other_double_powers_call_the_header():
    """A double power other than an integer or a half is Dg_pow (inlined: its loop vectorizes),
    or Dg_pow_call, its out-of-line copy, in code that runs element by element: a window
    function's loop over the neighbours, an expression that calls a window function (not one
    that reads a window's tile). LRN's generated C calls neither pow nor powf from libm."""
    e = (1 + X**2) ** sympy.Rational(-7, 4)
    names = ordered_names(None)
    assert printers._C("double", {"x": "Xv"}, names).doprint(e) == "Dg_pow((Xv*Xv) + 1, -7.0/4.0)"
    assert printers._C("double", {"x": "Xv"}, names, scalar=True).doprint(e) == "Dg_pow_call((Xv*Xv) + 1, -7.0/4.0)"
    w = Window(X**2, 5, 1)
    called = printers._C("double", {"x": "Xv"}, names, windows=lambda v: "f_window1(x)")
    assert called.doprint(e * w).count("Dg_pow_call(") == 1
    tiled = printers._C("double", {"x": "Xv"}, names, windows=lambda v: printers.TileRead("Wt_1[Gi]"))
    assert tiled.doprint(e * w).count("Dg_pow(") == 1
    text = emit(derivgen.derive("lrn"), ("c",)).files["c/lrn.c"]
    assert not re.search(r"[^_A-Za-z](pow|powf)\(", text)
    # the float backward's tile of the window dy*x*(k + alpha*s/size)**(-1 - beta): inlined
    assert "Wb[Ch * DG_NHWC_GROUPS + Gi] = Dyv*Xv*Dg_pow(k + Win1*alpha/size, -1 - beta);" in text
    functions = re.findall(r"static double lrn_\w+_window\d+\(.*?\n}", text, re.DOTALL)
    assert functions and all("Dg_pow(" not in f for f in functions)
    assert any("Dg_pow_call(" in f for f in functions)


@pytest.mark.parametrize("ctype,bits", [("float", 24), ("double", 53)])
def test_integer_powers_within_the_bound(ctype, bits, tmp_path):
    """x**n for every 2 <= |n| <= 16 against the exact power (Fraction) at 2000 random x with
    magnitudes where no product overflows or underflows: relative error at most
    (|n| - 1 + [n < 0]) 2^-bits (to first order; 1% slack for the second)."""
    cc = require_tool("gcc")
    src = ["#include <stdint.h>"]
    for n in EXPONENTS:
        name = f"p{'m' if n < 0 else ''}{abs(n)}"
        src.append(f"{ctype} {name}({ctype} Xv) {{ return {_c(ctype, X**n)}; }}")
    (tmp_path / "p.c").write_text("\n".join(src) + "\n")
    lib = tmp_path / "p.so"
    flags = ["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-O2", "-ffp-contract=off"]
    r = subprocess.run(
        [cc, *flags, "-shared", "-fPIC", str(tmp_path / "p.c"), "-o", str(lib)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    so = ctypes.CDLL(str(lib))
    ct = ctypes.c_float if ctype == "float" else ctypes.c_double
    rng = random.Random(41)
    u = Fraction(1, 2**bits)
    for n in EXPONENTS:
        fn = getattr(so, f"p{'m' if n < 0 else ''}{abs(n)}")
        fn.restype, fn.argtypes = ct, [ct]
        bound = (abs(n) - 1 + (n < 0)) * u * Fraction(101, 100)
        worst = Fraction(0)
        for _ in range(2000):
            x = ct(rng.choice([-1, 1]) * 2.0 ** rng.uniform(-7, 7)).value  # |x|^16 within range
            exact = Fraction(x) ** n
            err = abs(Fraction(fn(x)) - exact) / abs(exact)
            worst = max(worst, err)
        assert worst <= bound, (ctype, n, float(worst / u))
        assert abs(n) < 3 or worst > 0  # products that round are really measured


HALVES = [n for n in range(-33, 34, 2) if abs(n) >= 3]


@pytest.mark.parametrize("ctype,bits", [("float", 24), ("double", 53)])
def test_half_integer_powers_within_the_bound(ctype, bits, tmp_path):
    """x**(n/2) for every odd 3 <= |n| <= 33, printed as sqrt(x) times x**((|n| - 1)/2) (no pow
    call), against mpmath at 2000 random x > 0 where nothing overflows: relative error at most
    ((|n| + 1)/2 + [n < 0]) 2^-bits (the root and (|n| - 1)/2 products each round once; 1% slack)."""
    mpmath = pytest.importorskip("mpmath")
    cc = require_tool("gcc")
    src = ["#include <math.h>"]
    for n in HALVES:
        text = _c(ctype, X ** sympy.Rational(n, 2))
        assert "pow" not in text and "sqrt" in text, (n, text)
        src.append(f"{ctype} h{'m' if n < 0 else ''}{abs(n)}({ctype} Xv) {{ return {text}; }}")
    (tmp_path / "h.c").write_text("\n".join(src) + "\n")
    lib = tmp_path / "h.so"
    flags = ["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-O2", "-ffp-contract=off"]
    r = subprocess.run(
        [cc, *flags, "-shared", "-fPIC", str(tmp_path / "h.c"), "-o", str(lib), "-lm"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    so = ctypes.CDLL(str(lib))
    ct = ctypes.c_float if ctype == "float" else ctypes.c_double
    rng = random.Random(43)
    u = mpmath.mpf(2) ** -bits
    with mpmath.workprec(120):
        for n in HALVES:
            fn = getattr(so, f"h{'m' if n < 0 else ''}{abs(n)}")
            fn.restype, fn.argtypes = ct, [ct]
            worst = mpmath.mpf(0)
            for _ in range(2000):
                x = ct(2.0 ** rng.uniform(-7, 7)).value  # |x|^17 within range
                exact = mpmath.mpf(x) ** (mpmath.mpf(n) / 2)
                worst = max(worst, abs(mpmath.mpf(fn(x)) - exact) / exact)
            assert worst <= (mpmath.mpf(abs(n) + 1) / 2 + (n < 0)) * u * 1.01, (ctype, n, float(worst / u))
            assert worst > 0  # results that round are really measured
