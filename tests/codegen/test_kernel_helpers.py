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
