"""The vectorizable elementary functions of generated/c/derivgen-kernels.h (Dg_expf, Dg_logf,
Dg_log1pf, Dg_tanhf, Dg_erff, Dg_sigmoidf, Dg_softplusf, the double ones (Dg_erf among them), and the powers
Dg_powf and Dg_pow): their error in ulp over the whole range against libm one type wider
(double for float, long double for double), the special values (±0, ±inf, NaN, subnormals,
the overflow and underflow edges) as libm gives them, the same bits from an SSE2 and the best build this CPU runs, the error table
of docs/numerics.md, and that GCC vectorizes a loop calling each one (SSE2, AVX2, AVX-512:
compiled, never run where the CPU lacks it)."""

import math
import platform
import random
import re
import subprocess

import pytest
from conftest import ROOT, require_tool

from derivgen.runtime.machine import machine
from derivgen.symbolic import functions

FLOAT = ["expf", "logf", "log1pf", "tanhf", "erff", "sigmoidf", "softplusf"]
DOUBLE = ["exp", "log", "log1p", "tanh", "erf", "sigmoid", "softplus"]
# a^b (float, double): the C printer's spelling of a power other than an integer or a half
BINARY = ["powf", "pow"]
# the sweep: every STRIDE-th float bit pattern of the whole range, every STRIDE_NEAR-th of
# |x| <= 16 (offset 3), every STRIDE_ONE-th float in [0.5, 2]; COUNT random doubles in each of
# four regions. The quick sweep is a subset of the full one (strides multiples of its, the
# same random streams cut shorter), so its maximum is at most the full sweep's, which the
# table in docs/numerics.md records.
FULL = {"stride": 61, "near": 7, "one": 1, "count": 400000}
QUICK = {"stride": 61 * 41, "near": 7 * 41, "one": 41, "count": 40000}

DRIVER = r"""
#include "derivgen-kernels.h"
#include <stdio.h>

#define BLOCK 4096
#define EV(name, T, f) \
    static void ev_##name(T *restrict y, const T *restrict x, int n) { for (int i = 0; i < n; ++i) y[i] = f(x[i]); }
EV(expf, float, Dg_expf)
EV(logf, float, Dg_logf)
EV(log1pf, float, Dg_log1pf)
EV(tanhf, float, Dg_tanhf)
EV(erff, float, Dg_erff)
EV(sigmoidf, float, Dg_sigmoidf)
EV(softplusf, float, Dg_softplusf)
EV(exp, double, Dg_exp)
EV(log, double, Dg_log)
EV(log1p, double, Dg_log1p)
EV(tanh, double, Dg_tanh)
EV(erf, double, Dg_erf)
EV(sigmoid, double, Dg_sigmoid)
EV(softplus, double, Dg_softplus)

static double rf_sigmoid(double x) { return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x)); }
static double rf_softplus(double x) { return (x > 0 ? x : 0.0) + log1p(exp(-fabs(x))); }
static long double rl_sigmoid(long double x) { return x >= 0 ? 1.0L / (1.0L + expl(-x)) : expl(x) / (1.0L + expl(x)); }
static long double rl_softplus(long double x) { return (x > 0 ? x : 0.0L) + log1pl(expl(-fabsl(x))); }

typedef struct { const char *name; void (*f)(float *restrict, const float *restrict, int); double (*ref)(double); } FF;
typedef struct { const char *name; void (*f)(double *restrict, const double *restrict, int); long double (*ref)(long double); } DF;
static const FF FFS[] = {{"expf", ev_expf, exp}, {"logf", ev_logf, log}, {"log1pf", ev_log1pf, log1p},
                         {"tanhf", ev_tanhf, tanh}, {"erff", ev_erff, erf}, {"sigmoidf", ev_sigmoidf, rf_sigmoid},
                         {"softplusf", ev_softplusf, rf_softplus}};
static const DF DFS[] = {{"exp", ev_exp, expl}, {"log", ev_log, logl}, {"log1p", ev_log1p, log1pl},
                         {"tanh", ev_tanh, tanhl}, {"erf", ev_erf, erfl}, {"sigmoid", ev_sigmoid, rl_sigmoid}, {"softplus", ev_softplus, rl_softplus}};

static double worst = 0, worst_at = 0;
static long mismatches = 0, evaluated = 0;
static uint64_t sum = 1469598103934665603u;   /* FNV-1a of every result's bits, in order (NaNs as one) */

static void mix(uint64_t v) { sum = (sum ^ v) * 1099511628211u; }

/* a result y of x against the reference r: its error in ulp of r's type (the ulp of a
 * subnormal below the smallest normal); results or references that are not finite must be
 * the same (any NaN for a NaN) */
static void judge_f(float x, float y, double r)
{
    const float rf = (float)r;
    mix(isnan(y) ? 0x7fc00000u : Dg_bits_f(y)); ++evaluated;   /* a NaN's sign and payload may differ */
    if (!isfinite(rf) || !isfinite(y)) {
        if (!(isnan(y) && isnan(rf)) && y != rf && ++mismatches <= 5) fprintf(stderr, "x=%a got %a want %a\n", x, y, rf);
        return;
    }
    int e;
    frexp(r, &e);
    const double err = fabs((double)y - r) / ldexp(1.0, e - 24 < -149 ? -149 : e - 24);
    if (err > worst) { worst = err; worst_at = x; }
}

static void judge_d(double x, double y, long double r)
{
    const double rd = (double)r;
    mix(isnan(y) ? 0x7ff8000000000000u : Dg_bits_d(y)); ++evaluated;
    if (!isfinite(rd) || !isfinite(y)) {
        if (!(isnan(y) && isnan(rd)) && y != rd && ++mismatches <= 5) fprintf(stderr, "x=%a got %a want %a\n", x, y, rd);
        return;
    }
    int e;
    frexpl(r, &e);
    const double err = (double)(fabsl((long double)y - r) / ldexpl(1.0L, e - 53 < -1074 ? -1074 : e - 53));
    if (err > worst) { worst = err; worst_at = x; }
}

static float xf[BLOCK], yf[BLOCK];
static double xd[BLOCK], yd[BLOCK];
static int nf = 0, nd = 0;
static const FF *Fcur;
static const DF *Dcur;

static void flush_f(void)
{
    Fcur->f(yf, xf, nf);    /* the vectorized loop */
    for (int i = 0; i < nf; ++i) judge_f(xf[i], yf[i], Fcur->ref((double)xf[i]));
    nf = 0;
}
static void put_f(float x) { xf[nf++] = x; if (nf == BLOCK) flush_f(); }
static void flush_d(void)
{
    Dcur->f(yd, xd, nd);
    for (int i = 0; i < nd; ++i) judge_d(xd[i], yd[i], Dcur->ref((long double)xd[i]));
    nd = 0;
}
static void put_d(double x) { xd[nd++] = x; if (nd == BLOCK) flush_d(); }

/* a^b, in blocks through the vectorized loop, against libm's pow in double */
static float xa[BLOCK], xb[BLOCK], ya[BLOCK];
static int np = 0;
static void ev_powf(float *restrict y, const float *restrict a, const float *restrict b, int n)
{
    for (int i = 0; i < n; ++i) y[i] = Dg_powf(a[i], b[i]);
}
static void flush_p(void)
{
    ev_powf(ya, xa, xb, np);
    for (int i = 0; i < np; ++i) judge_f(xa[i], ya[i], pow((double)xa[i], (double)xb[i]));
    np = 0;
}
static void judge_p(float a, float b) { xa[np] = a; xb[np++] = b; if (np == BLOCK) flush_p(); }

/* a^b in double, against powl (x87 long double: 64 bits, its own error under 2^-11 ulp of a
 * double); Dg_pow_call (the copy generated code calls where it runs element by element) gives
 * the same bits */
static double da[BLOCK], db[BLOCK], dq[BLOCK];
static int nq = 0;
static void ev_pow(double *restrict y, const double *restrict a, const double *restrict b, int n)
{
    for (int i = 0; i < n; ++i) y[i] = Dg_pow(a[i], b[i]);
}
static void flush_q(void)
{
    ev_pow(dq, da, db, nq);
    for (int i = 0; i < nq; ++i) {
        judge_d(da[i], dq[i], powl((long double)da[i], (long double)db[i]));
        const double c = Dg_pow_call(da[i], db[i]);
        if (Dg_bits_d(c) != Dg_bits_d(dq[i]) && !(isnan(c) && isnan(dq[i])) && ++mismatches <= 5)
            fprintf(stderr, "Dg_pow_call(%a, %a) = %a, Dg_pow %a\n", da[i], db[i], c, dq[i]);
    }
    nq = 0;
}
static void judge_q(double a, double b) { da[nq] = a; db[nq++] = b; if (nq == BLOCK) flush_q(); }

static uint64_t Rng;
static uint64_t next(void) { Rng ^= Rng << 13; Rng ^= Rng >> 7; Rng ^= Rng << 17; return Rng; }
static double unit(void) { return (double)(next() >> 11) * 0x1p-53; }

int main(int argc, char **argv)
{
    if (argc != 6) return 2;
    const uint64_t stride = (uint64_t)atol(argv[2]), near = (uint64_t)atol(argv[3]), one = (uint64_t)atol(argv[4]);
    const long count = atol(argv[5]);
    static const float SPF[] = {0.0f, -0.0f, 1.0f, -1.0f, 1.40129846e-45f, -1.40129846e-45f, 1.17549435e-38f,
                                -1.17549435e-38f, 3.40282347e+38f, -3.40282347e+38f, 88.7228394f, -87.3365479f,
                                -103.972084f, -103.278931f, 9.01f, -9.01f, 3.92f, -3.92f, 0.625f, -0.625f, 0.875f, -0.875f};
    static const double SPD[] = {0.0, -0.0, 1.0, -1.0, 4.9406564584124654e-324, -4.9406564584124654e-324,
                                 2.2250738585072014e-308, -2.2250738585072014e-308, 1.7976931348623157e+308,
                                 -1.7976931348623157e+308, 709.782712893384, -708.39641853226408, -745.13321910194110,
                                 -744.44007192138122, 19.06, -19.06, 0.625, -0.625};
    for (size_t k = 0; k < sizeof FFS / sizeof FFS[0]; ++k) {
        if (strcmp(argv[1], FFS[k].name) != 0) continue;
        Fcur = &FFS[k];
        for (uint64_t b = 0; b <= 0xffffffffu; b += stride) put_f(Dg_f_bits((uint32_t)b));
        for (uint64_t b = 3; b <= 0x41800000u; b += near) { put_f(Dg_f_bits((uint32_t)b)); put_f(-Dg_f_bits((uint32_t)b)); }
        for (uint64_t b = 0x3f000000u; b <= 0x40000000u; b += one) put_f(Dg_f_bits((uint32_t)b));
        for (size_t s = 0; s < sizeof SPF / sizeof SPF[0]; ++s) {
            put_f(SPF[s]); put_f(nextafterf(SPF[s], 0.0f)); put_f(nextafterf(SPF[s], 1e30f)); put_f(nextafterf(SPF[s], -1e30f));
        }
        put_f(Dg_f_bits(0x7f800000u)); put_f(-Dg_f_bits(0x7f800000u)); put_f(Dg_f_bits(0x7fc00000u)); put_f(-Dg_f_bits(0x7fc00000u));
        flush_f();
    }
    for (size_t k = 0; k < sizeof DFS / sizeof DFS[0]; ++k) {
        if (strcmp(argv[1], DFS[k].name) != 0) continue;
        Dcur = &DFS[k];
        Rng = 88172645463325252u;                                  /* any bit pattern */
        for (long i = 0; i < count; ++i) put_d(Dg_d_bits(next()));
        Rng = 3141592653589793238u;                                /* |x| in [2^-30, 2^10), exponents uniform */
        for (long i = 0; i < count; ++i) {
            const uint64_t u = next();
            const double x = ldexp(1.0 + (double)(u >> 12) * 0x1p-52, (int)((u & 63u) % 40u) - 30);
            put_d((u & 64u) ? -x : x);
        }
        Rng = 2718281828459045235u;                                /* [0.5, 1.5) */
        for (long i = 0; i < count; ++i) put_d(1.0 + ((double)(next() >> 11) * 0x1p-53 - 0.5));
        Rng = 1414213562373095048u;                                /* [-800, 800) */
        for (long i = 0; i < count; ++i) put_d(((double)(next() >> 11) * 0x1p-53 - 0.5) * 1600.0);
        for (size_t s = 0; s < sizeof SPD / sizeof SPD[0]; ++s) {
            put_d(SPD[s]); put_d(nextafter(SPD[s], 0.0)); put_d(nextafter(SPD[s], 1e300)); put_d(nextafter(SPD[s], -1e300));
        }
        put_d(Dg_d_bits(0x7ff0000000000000u)); put_d(-Dg_d_bits(0x7ff0000000000000u));
        put_d(Dg_d_bits(0x7ff8000000000000u)); put_d(-Dg_d_bits(0x7ff8000000000000u));
        flush_d();
    }
    if (strcmp(argv[1], "powf") == 0) {
        /* a^b: every (16 stride)-th float bit pattern a of either sign against exponents b
         * (the special ones, integers near the 2^23 and 2^24 edges, 48 random ones in [-16, 16]
         * and 16 in [-200, 200]); count random pairs with a in [2^-20, 2^20) and b in [-8, 8);
         * every (one)-th float a in [0.5, 2] against b = 0.75, -0.75, -1.75 (LRN's) */
        static float SB[128] = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 3.0f, -3.0f, 0.5f, -0.5f, 0.75f, -0.75f,
                                -1.75f, 0.333333343f, 7.0f, -7.0f, 8388607.0f, 8388608.0f, 8388609.0f, 16777215.0f,
                                16777216.0f, 16777218.0f, -16777215.0f, 2.5f, -2.5f, 1e-10f, 100.5f, -100.5f,
                                1e30f, -1e30f, 1.40129846e-45f, 3.40282347e+38f};
        int nb = 32;
        SB[nb++] = Dg_f_bits(0x7f800000u); SB[nb++] = -Dg_f_bits(0x7f800000u); SB[nb++] = Dg_f_bits(0x7fc00000u);
        Rng = 6180339887498948482u;
        for (int i = 0; i < 48; ++i) SB[nb++] = (float)(((double)(next() >> 11) * 0x1p-53 - 0.5) * 32.0);
        for (int i = 0; i < 16; ++i) SB[nb++] = (float)(((double)(next() >> 11) * 0x1p-53 - 0.5) * 400.0);
        for (int j = 0; j < nb; ++j) {
            const float b = SB[j];
            for (uint64_t u = 0; u <= 0x7fc00000u; u += 16 * stride) {
                const float a = Dg_f_bits((uint32_t)u);
                judge_p(a, b); judge_p(-a, b);
            }
            static const float SA[] = {0.0f, -0.0f, 1.0f, -1.0f, 1.40129846e-45f, 3.40282347e+38f, 0.999999940f,
                                       1.00000012f, 2.0f, -2.0f, 0.5f, -0.5f};
            for (size_t i = 0; i < sizeof SA / sizeof SA[0]; ++i) judge_p(SA[i], b);
            judge_p(Dg_f_bits(0x7f800000u), b); judge_p(-Dg_f_bits(0x7f800000u), b); judge_p(Dg_f_bits(0x7fc00000u), b);
        }
        Rng = 5772156649015328606u;
        for (long i = 0; i < count; ++i) {
            const uint64_t u = next();
            const float a = (float)ldexp(1.0 + (double)(u >> 12) * 0x1p-52, (int)((u & 63u) % 40u) - 20);
            judge_p(a, (float)(((double)(next() >> 11) * 0x1p-53 - 0.5) * 16.0));
        }
        static const float SL[] = {0.75f, -0.75f, -1.75f};
        for (size_t i = 0; i < 3; ++i)
            for (uint64_t u = 0x3f000000u; u <= 0x40000000u; u += one) judge_p(Dg_f_bits((uint32_t)u), SL[i]);
        flush_p();
    }
    if (strcmp(argv[1], "pow") == 0) {
        /* a^b: count pairs in each of: any positive a with b = y/log a, y in [-745, 709.7] (the
         * whole range of results, subnormal ones too, |b log a| large); a = 1 + u 2^-k (k < 50)
         * with y as before (large |b|); a at the ends of the reduction, m near sqrt(1/2) and
         * sqrt(2) (the largest |s|), |y| from 690; a in [2^-30, 2^10) and b in [-8, 8); a
         * negative, b an integer up to 100; a and b any bit patterns (overflow, underflow,
         * NaN); a in [1, 2] with LRN's b = -1.75 and -0.75. Then every pair of the special
         * values and their neighbours. */
        Rng = 4242424242424242424u;
        for (long i = 0; i < count; ++i) {
            const double a = Dg_d_bits(next() & 0x7fefffffffffffffu), y = unit() * 1454.7 - 745.0, l = log(a);
            judge_q(a, l == 0.0 ? y : y / l);
        }
        for (long i = 0; i < count; ++i) {
            const double a = 1.0 + (unit() - 0.5) * ldexp(1.0, -(int)(next() % 50u)), y = unit() * 1454.7 - 745.0;
            const double l = log(a);
            judge_q(a, l == 0.0 ? y : y / l);
        }
        for (long i = 0; i < count; ++i) {
            const double m = (next() & 1u) ? 1.4142135623730951 - unit() * 0.02 : 0.70710678118654757 + unit() * 0.02;
            const double a = ldexp(m, (int)(next() % 2046u) - 1022);
            const double y = (next() & 1u) ? 690.0 + unit() * 19.7 : -690.0 - unit() * 55.0;
            judge_q(a, y / log(a));
        }
        for (long i = 0; i < count; ++i) judge_q(ldexp(1.0 + unit(), (int)(next() % 40u) - 30), (unit() - 0.5) * 16.0);
        for (long i = 0; i < count; ++i)
            judge_q(-ldexp(1.0 + unit(), (int)(next() % 40u) - 20), (double)((int)(next() % 201u) - 100));
        for (long i = 0; i < count; ++i) judge_q(Dg_d_bits(next()), Dg_d_bits(next()));
        for (long i = 0; i < count; ++i) { judge_q(1.0 + unit(), -1.75); judge_q(1.0 + unit(), -0.75); }
        static const double SQ[] = {0.0, 1.0, 2.0, 3.0, 0.5, 0.75, 1.75, 4.9406564584124654e-324, 2.2250738585072014e-308,
                                    1.7976931348623157e+308, 4503599627370495.0, 4503599627370496.0, 4503599627370497.0,
                                    9007199254740991.0, 9007199254740992.0, 9007199254740994.0, 1e300, 1e-300,
                                    0.99999999999999989, 1.0000000000000002, 18446744073709551616.0, 709.78, 745.2,
                                    1023.0, 1024.0, 1074.0, 1075.0, INFINITY, NAN};
        const int ns = (int)(sizeof SQ / sizeof SQ[0]);
        for (int i = 0; i < 2 * ns; ++i)
            for (int j = 0; j < 2 * ns; ++j) {
                const double a = i < ns ? SQ[i] : -SQ[i - ns], b = j < ns ? SQ[j] : -SQ[j - ns];
                judge_q(a, b); judge_q(nextafter(a, 0.0), b); judge_q(nextafter(a, INFINITY), b);
                judge_q(a, nextafter(b, 0.0)); judge_q(a, nextafter(b, INFINITY));
            }
        flush_q();
    }
    printf("%s %.6f %a %ld %ld %016llx\n", argv[1], worst, worst_at, mismatches, evaluated, (unsigned long long)sum);
    return 0;
}
"""

STRICT = ["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-Wno-unused-function"]
# the kernels' own build flags (derivgen.runtime.build.DEFAULT_CFLAGS) but the -march
KERNEL = ["-O3", "-fno-math-errno", "-ffp-contract=off"]
NEEDS = {"x86-64": (), "x86-64-v3": ("avx2", "fma"), "x86-64-v4": ("avx512f", "avx512bw", "avx512vl")}


def _runs(march: str) -> bool:
    return set(NEEDS[march]) <= set(machine().flags)


def _best() -> str:
    return next((m for m in ("x86-64-v4", "x86-64-v3") if _runs(m)), "x86-64")


def _x86() -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the -march levels are x86-64's")


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    """The sweep driver built for plain x86-64 (SSE2) and for the best level this CPU runs."""
    _x86()
    cc = require_tool("gcc")
    d = tmp_path_factory.mktemp("vector_math")
    (d / "driver.c").write_text(DRIVER)
    out = {}
    for march in dict.fromkeys(("x86-64", _best())):
        exe = d / f"driver-{march}"
        r = subprocess.run(
            [
                cc,
                *STRICT,
                *KERNEL,
                f"-march={march}",
                f"-I{ROOT / 'generated' / 'c'}",
                str(d / "driver.c"),
                "-o",
                str(exe),
                "-lm",
            ],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        out[march] = exe
    return out


def _sweep(exe, name: str, sweep: dict) -> dict:
    r = subprocess.run(
        [str(exe), name, *(str(sweep[k]) for k in ("stride", "near", "one", "count"))],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr
    fn, worst, at, mismatches, evaluated, checksum = r.stdout.split()
    assert fn == name
    return {
        "ulp": float(worst),
        "at": float.fromhex(at),
        "mismatches": int(mismatches),
        "evaluated": int(evaluated),
        "checksum": checksum,
        "stderr": r.stderr,
    }


def doc_table() -> dict[str, tuple[float, float]]:
    """docs/numerics.md's table of the vectorized functions: C function -> (measured max
    error, bound), both in ulp."""
    text = (ROOT / "docs" / "numerics.md").read_text()
    section = text.split("<!-- vector-math-table -->")[1]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`Dg_(\w+)`\s*\|\s*(float|double)\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|", line)
        if m:
            rows[m.group(1)] = (float(m.group(3)), float(m.group(4)))
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_doc_table_has_every_function():
    table = doc_table()
    assert set(table) == set(FLOAT + DOUBLE + BINARY)
    for name, (measured, bound) in table.items():
        assert measured <= bound, name


CASES = [pytest.param(n, QUICK, id=f"{n}-quick") for n in FLOAT + DOUBLE + BINARY] + [
    pytest.param(n, FULL, id=f"{n}-full", marks=pytest.mark.full) for n in FLOAT + DOUBLE + BINARY
]


@pytest.mark.parametrize("name,sweep", CASES)
def test_error_within_the_documented_bound(name, sweep, drivers):
    """Over the sweep: no special value differs from libm's, the largest error is within the
    documented bound (and, for the full sweep, is the table's measured value), and the plain
    SSE2 build and the best vector build give the same bits."""
    measured, bound = doc_table()[name]
    results = {march: _sweep(exe, name, sweep) for march, exe in drivers.items()}
    for march, r in results.items():
        assert r["mismatches"] == 0, (march, r["stderr"])
        assert r["ulp"] <= bound, (march, r)
        if sweep is FULL:
            assert abs(r["ulp"] - measured) < 0.01, (march, r["ulp"], measured)
        else:
            assert r["ulp"] <= measured + 0.005, (march, r["ulp"], measured)
    assert len({r["checksum"] for r in results.values()}) == 1, results


POW_VALUES = r"""
#include "derivgen-kernels.h"
#include <stdio.h>

int main(void)
{
    char a[64], b[64];
    while (scanf("%63s %63s", a, b) == 2) printf("%a\n", Dg_pow(strtod(a, NULL), strtod(b, NULL)));
    return 0;
}
"""


def _pow_pairs(n: int, rng) -> list[tuple[float, float]]:
    """Pairs (a, b) whose power is finite and nonzero: a = m 2^e with any exponent, a near 1,
    and LRN's bases and exponents; b = y/log a for y over the whole range of results."""
    out = []
    for k in range(n):
        if k % 3 == 2:
            out.append((1.0 + rng.uniform(0.0, 1.0), rng.choice([-1.75, -0.75])))
            continue
        if k % 3 == 0:
            a = math.ldexp(rng.uniform(0.5, 1.0), rng.randrange(-1073, 1025))
        else:
            a = 1.0 + rng.uniform(-0.5, 0.5) * 2.0 ** -rng.randrange(0, 50)
        y = rng.uniform(-745.0, 709.7)
        out.append((a, y / math.log(a) if a != 1.0 else y))
    return out


def test_pow_against_mpmath(tmp_path):
    """Dg_pow at 2,000 pairs with |b log a| up to 745 (results from the largest double down to
    subnormal ones) within its documented bound of the exact power, computed by mpmath in
    200-bit arithmetic: the sweeps' reference, libm's long double powl, checked by another."""
    _x86()
    mpmath = pytest.importorskip("mpmath")
    cc = require_tool("gcc")
    (tmp_path / "pow.c").write_text(POW_VALUES)
    exe = tmp_path / "pow"
    cmd = [cc, *STRICT, *KERNEL, f"-march={_best()}", f"-I{ROOT / 'generated' / 'c'}", str(tmp_path / "pow.c")]
    subprocess.run([*cmd, "-o", str(exe), "-lm"], check=True)
    pairs = _pow_pairs(2000, random.Random(20250101))
    text = "".join(f"{a.hex()} {b.hex()}\n" for a, b in pairs)
    got = [
        float.fromhex(v)
        for v in subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.split()
    ]
    assert len(got) == len(pairs)
    bound = doc_table()["pow"][1]
    worst = 0.0
    with mpmath.workprec(200):
        for (a, b), r in zip(pairs, got):
            exact = mpmath.power(mpmath.mpf(a), mpmath.mpf(b))
            ulp = mpmath.ldexp(1, max(int(mpmath.floor(mpmath.log(exact, 2))) - 52, -1074))
            err = float(abs(mpmath.mpf(r) - exact) / ulp)
            assert err <= bound, (a.hex(), b.hex(), r, err)
            worst = max(worst, err)
    assert worst > 0.3  # the sample reaches results that round: the check can fail


LOOPS = (
    r"""
#include "derivgen-kernels.h"
"""
    + "".join(
        f"void loop_{n}({t} *restrict y, const {t} *restrict x, int n) {{ for (int i = 0; i < n; ++i) y[i] = Dg_{n}(x[i]); }}\n"
        for t, names in (("float", FLOAT), ("double", DOUBLE))
        for n in names
    )
    + "".join(
        f"void loop_{n}({t} *restrict y, const {t} *restrict a, const {t} *restrict b, int n) "
        f"{{ for (int i = 0; i < n; ++i) y[i] = Dg_{n}(a[i], b[i]); }}\n"
        for n, t in zip(BINARY, ("float", "double"))
    )
)


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4"])
def test_gcc_vectorizes_a_loop_calling_each_function(march, tmp_path):
    """Compiled only (any CPU): GCC reports every loop vectorized, with vectors of the ISA's
    width, and the object calls nothing (no libm). Plain x86-64 (SSE2) lacks what the double
    ones need (64-bit integer compares of the selects): there the float ones only."""
    _x86()
    cc = require_tool("gcc")
    (tmp_path / "loops.c").write_text(LOOPS)
    obj = tmp_path / "loops.o"
    r = subprocess.run(
        [cc, *STRICT, *KERNEL, f"-march={march}", "-fopt-info-vec-optimized", f"-I{ROOT / 'generated' / 'c'}"]
        + ["-c", str(tmp_path / "loops.c"), "-o", str(obj)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    width = {"x86-64": 16, "x86-64-v2": 16, "x86-64-v3": 32, "x86-64-v4": 64}[march]
    lines = LOOPS.splitlines()
    want = FLOAT + (DOUBLE + BINARY if march != "x86-64" else [])  # powf works in double
    for n in want:
        line = next(i + 1 for i, text in enumerate(lines) if text.startswith(f"void loop_{n}("))
        assert re.search(rf"loops\.c:{line}:\d+: optimized: loop vectorized using {width} byte vectors", r.stderr), (
            n,
            r.stderr,
        )
    nm = require_tool("nm")
    undefined = subprocess.run([nm, "-u", str(obj)], capture_output=True, text=True, check=True).stdout.split()
    assert not [s for s in undefined if s not in ("U",)], undefined


def test_the_table_spells_the_transcendentals_with_the_header():
    """exp, log, tanh, erf, sigmoid and softplus (float and double) call the header's
    functions, which the header defines."""
    header = (ROOT / "generated" / "c" / "derivgen-kernels.h").read_text()
    for name in ("exp", "log", "tanh", "sigmoid", "softplus", "erf"):
        for ctype in ("float", "double"):
            spelling = functions.TABLE[name].c(ctype)
            assert spelling.startswith("Dg_"), (name, ctype, spelling)
            assert re.search(rf"static inline {ctype} {spelling}\(", header), spelling


SELECT = r"""
#include "derivgen-kernels.h"
#include <stdio.h>

#define LOOP(name, T, f) \
    void loop_##name(T *restrict y, const T *restrict a, const T *restrict b, int n) { for (int i = 0; i < n; ++i) y[i] = f(a[i], b[i]); }
LOOP(fmax, double, Dg_fmax)
LOOP(fmin, double, Dg_fmin)
LOOP(fmaxf, float, Dg_fmaxf)
LOOP(fminf, float, Dg_fminf)

int main(void)
{
    static const double V[] = {0.0, -0.0, 1.0, -1.0, 2.5, -3e300, 4.9406564584124654e-324, 1e-310, INFINITY, -INFINITY, NAN, -NAN};
    enum { K = sizeof V / sizeof V[0], N = K * K };
    double a[N], b[N], y[N];
    float af[N], bf[N], yf[N];
    long bad = 0;
    for (int i = 0; i < K; ++i)
        for (int j = 0; j < K; ++j) { a[i * K + j] = V[i]; b[i * K + j] = V[j]; af[i * K + j] = (float)V[i]; bf[i * K + j] = (float)V[j]; }
    /* against libm's, bit for bit but for a NaN's sign and payload and the sign of equal zeros */
#define CHECK(name, ref) \
    loop_##name(y, a, b, N); \
    for (int i = 0; i < N; ++i) { const double r = ref(a[i], b[i]); \
        if (isnan(r) ? !isnan(y[i]) : (y[i] != r || (r != 0.0 && signbit(y[i]) != signbit(r)))) { ++bad; fprintf(stderr, #name " %a %a: %a\n", a[i], b[i], y[i]); } }
    CHECK(fmax, fmax)
    CHECK(fmin, fmin)
    loop_fmaxf(yf, af, bf, N);
    for (int i = 0; i < N; ++i) { const float r = fmaxf(af[i], bf[i]); if (isnan(r) ? !isnan(yf[i]) : yf[i] != r) { ++bad; fprintf(stderr, "fmaxf %a %a: %a\n", af[i], bf[i], yf[i]); } }
    loop_fminf(yf, af, bf, N);
    for (int i = 0; i < N; ++i) { const float r = fminf(af[i], bf[i]); if (isnan(r) ? !isnan(yf[i]) : yf[i] != r) { ++bad; fprintf(stderr, "fminf %a %a: %a\n", af[i], bf[i], yf[i]); } }
    printf("%ld\n", bad);
    return bad != 0;
}
"""


def test_selections_are_libm_fmax_and_fmin_and_vectorize(tmp_path):
    """Dg_fmax, Dg_fmin, Dg_fmaxf, Dg_fminf (the table's maximum, minimum and clip): libm's
    fmax and fmin on every pair of special values (±0, ±1, subnormals, ±inf, NaN: NaN only where
    both are), and their loops vectorize where fmax's libm call does not."""
    _x86()
    cc = require_tool("gcc")
    (tmp_path / "sel.c").write_text(SELECT)
    exe = tmp_path / "sel"
    r = subprocess.run(
        [cc, *STRICT, *KERNEL, f"-march={_best()}", "-fopt-info-vec-optimized", f"-I{ROOT / 'generated' / 'c'}"]
        + [str(tmp_path / "sel.c"), "-o", str(exe), "-lm"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    lines = SELECT.splitlines()
    for n in ("fmax", "fmin", "fmaxf", "fminf"):
        line = next(i + 1 for i, text in enumerate(lines) if text.startswith(f"LOOP({n},"))
        assert re.search(rf"sel\.c:{line}:\d+: optimized: loop vectorized", r.stderr), (n, r.stderr)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "0", run.stderr
