"""Integer powers in the C kernels: b**n for 2 <= |n| <= 16 printed as products (b*b ... for
|n| <= 4, as they always were; by squaring from 5 on), no pow() call, and their rounding within
the documented bound: at most |n| - 1 products, each rounding once, and a division for n < 0,
so a relative error below (|n| - 1 + [n < 0]) units of rounding to first order
(docs/numerics.md). Other powers of a float kernel call Dg_powf."""

import ctypes
import random
import subprocess
from fractions import Fraction

import pytest
import sympy
from conftest import require_tool

from derivgen.codegen import printers

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
    assert _c(ctype, X**17).startswith("Dg_powf(" if ctype == "float" else "pow(")
    assert _c(ctype, X ** sympy.Rational(3, 4)).startswith("Dg_powf(" if ctype == "float" else "pow(")


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
