"""The shared C helpers in generated/c/derivgen-kernels.h, compiled for every instruction
set this CPU runs: the vector lane sum adds in the reference pairwise order (same bits)."""

import ctypes
import math
import random
import subprocess

import pytest
from conftest import ROOT, require_tool

from derivgen.runtime.machine import machine

PROBE = r"""
#include "derivgen-kernels.h"
double probe_lanes(const double *lane) { return Dg_lanes(lane); }
double probe_reference(const double *lane)
{
    double Th[DG_LANES / 2];
    for (int J = 0; J < DG_LANES / 2; ++J) Th[J] = lane[J] + lane[J + DG_LANES / 2];
    for (int H = DG_LANES / 4; H >= 1; H /= 2)
        for (int J = 0; J < H; ++J) Th[J] += Th[J + H];
    return Th[0];
}
"""
NEEDS = {
    "x86-64": (),
    "x86-64-v2": ("sse4_2",),
    "x86-64-v3": ("avx2", "fma"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512vl"),
}


@pytest.mark.parametrize("march", list(NEEDS))
def test_vector_lane_sum_is_the_reference_order(march, tmp_path):
    cc = require_tool("gcc")
    if not set(NEEDS[march]) <= set(machine().flags):
        pytest.skip(f"this CPU cannot run -march={march}")
    (tmp_path / "probe.c").write_text(PROBE)
    lib = tmp_path / "probe.so"
    r = subprocess.run(
        [
            cc,
            "-std=c99",
            "-Wall",
            "-Wextra",
            "-pedantic",
            "-Werror",
            "-Wno-unused-function",
            "-O2",
            f"-march={march}",
            "-ffp-contract=fast",
            "-shared",
            "-fPIC",
            f"-I{ROOT / 'generated' / 'c'}",
            str(tmp_path / "probe.c"),
            "-o",
            str(lib),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    so = ctypes.CDLL(str(lib))
    for f in (so.probe_lanes, so.probe_reference):
        f.restype, f.argtypes = ctypes.c_double, [ctypes.POINTER(ctypes.c_double)]
    rng = random.Random(7)
    for trial in range(2000):
        # magnitudes spread over many decades, so a different order would show in the bits
        vals = [rng.choice((-1, 1)) * rng.random() * 10.0 ** rng.randint(-8, 8) for _ in range(32)]
        arr = (ctypes.c_double * 32)(*vals)
        got, ref = so.probe_lanes(arr), so.probe_reference(arr)
        assert got == ref or (math.isnan(got) and math.isnan(ref)), (march, trial, got, ref)


def _probe(tmp_path, name: str, source: str) -> ctypes.CDLL:
    """``source`` (including derivgen-kernels.h) compiled strictly at -O2 and loaded."""
    cc = require_tool("gcc")
    (tmp_path / f"{name}.c").write_text(source)
    lib = tmp_path / f"{name}.so"
    flags = ["-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-Wno-unused-function", "-O2"]
    r = subprocess.run(
        [cc, *flags, "-shared", "-fPIC", f"-I{ROOT / 'generated' / 'c'}", str(tmp_path / f"{name}.c"), "-o", str(lib)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(lib))


NEXT = r"""
#include "derivgen-kernels.h"
int probe_next(int64_t n, int64_t a, int64_t bytes, int64_t tile)
{
    Dg_configure(0, tile);
    return Dg_ahead_next(n, a, bytes);
}
"""


def test_the_next_group_is_read_ahead_where_it_pays(tmp_path):
    """The second sweep reads the next group ahead only where the group is longer than the first
    sweep's read-ahead and this group and the next fit in half of L2 (two tiles) together."""
    so = _probe(tmp_path, "next", NEXT)
    so.probe_next.restype = ctypes.c_int
    so.probe_next.argtypes = [ctypes.c_int64] * 4
    tile, ahead = 256 << 10, 1024  # a 1 MiB L2; 4 KiB of floats read ahead
    cases = {
        (1024, 4): 0,  # a layer norm row of 1024 floats: the first sweep's read-ahead reaches the next
        (8 * 3136, 4): 1,  # group norm's group (8 channels of 56x56): 100 KB
        (32 * 3136, 4): 1,  # batch norm's forward: x of one channel, 400 KB
        (32 * 3136, 8): 0,  # its backward, x and dy: 800 KB, with the next over L2
    }
    for (n, nbytes), want in cases.items():
        assert so.probe_next(n, ahead, nbytes, tile) == want, (n, nbytes)
    assert so.probe_next(32 * 3136, ahead, 8, 2 * tile) == 1  # a 2 MiB L2 holds both


PER = r"""
#include "derivgen-kernels.h"
double probe_per(double s, double n) { return Dg_per(s, n, Dg_inv_pow2(n)); }
double probe_inv(double n) { return Dg_inv_pow2(n); }
double probe_div(double s, double n) { return s / n; }
"""


def test_a_mean_by_product_has_the_quotients_bits(tmp_path):
    """Dg_per (the forward statistics' s/N) multiplies by 1/N only where N is a power of two,
    and gives the quotient's bits for every sum: tiny, huge, negative, infinite, NaN."""
    so = _probe(tmp_path, "per", PER)
    for f in (so.probe_per, so.probe_div):
        f.restype, f.argtypes = ctypes.c_double, [ctypes.c_double, ctypes.c_double]
    so.probe_inv.restype, so.probe_inv.argtypes = ctypes.c_double, [ctypes.c_double]
    assert so.probe_inv(1024.0) == 1 / 1024 and so.probe_inv(1.0) == 1.0 and so.probe_inv(2.0**-3) == 8.0
    assert so.probe_inv(1000.0) == 0.0 and so.probe_inv(3.0) == 0.0 and so.probe_inv(0.0) == 0.0
    rng = random.Random(11)
    sums = [0.0, -0.0, 5e-324, -2.2e-308, 1.7e308, math.inf, -math.inf, math.nan]
    sums += [rng.choice((-1, 1)) * rng.random() * 10.0 ** rng.randint(-320, 308) for _ in range(3000)]
    for n in (1.0, 2.0, 128.0, 1024.0, 3136.0 * 32, 2.0**40, 3.0, 1000.0, 100352.0):
        for s in sums:
            got, want = so.probe_per(s, n), so.probe_div(s, n)
            assert (
                got == want
                and math.copysign(1, got) == math.copysign(1, want)
                or (math.isnan(got) and math.isnan(want))
            ), (s, n, got, want)
