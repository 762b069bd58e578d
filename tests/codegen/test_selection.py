"""The C kernels' group selections (max, min) and the float sums of elementary functions.

A selection sweeps its group in DG_LANES lanes (templates/_c_sweep.j2, select): each lane keeps
its best value or its last NaN, and a result that is zero or NaN is redone in the group's order.
The statistic must be the same bits as one sweep in order that keeps the first of equal values
and the last NaN (what the kernels computed before the lanes), for any NaN position, signed
zeros, infinities, ties, rows that do not fill a lane block, and any thread count. Float
kernels add exp(x - m) in float, widened to double (floats.sums_in_float): the sum must stay
within float rounding of a float64 reference and y as accurate as before."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT

import derivgen
from derivgen.codegen.emit import emit

REG = ROOT / "tests" / "regressions"

# layer, the selection's statistic, its element value (in double, as the kernels' double
# expression), max or min
TRAILING = [
    ("softmax", "m", lambda v: v, "max"),
    ("absmax_scale", "m", np.abs, "max"),
    (str(REG / "group_min_mask_in_float32.toml"), "Aux3", lambda v: v * v, "min"),
]


def _scan(v: np.ndarray, op: str) -> float:
    """One sweep in order: the first of equal values, the last NaN."""
    best = -np.inf if op == "max" else np.inf
    for a in v:
        if (a > best if op == "max" else a < best) or np.isnan(a):
            best = a
    return best


def _nan(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


def _rows(n: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of length n holding the cases a lane-wise selection could get wrong."""
    rows = []
    for p in range(n):  # a NaN at every position (the lane blocks and the remainder)
        r = rng.standard_normal(n).astype(np.float32)
        r[p] = np.float32(np.nan)
        rows.append(r)
    for _ in range(6):  # two NaNs of different sign and payload: the later one is kept
        r = rng.standard_normal(n).astype(np.float32)
        p, q = sorted(rng.choice(n, 2, replace=False)) if n > 1 else (0, 0)
        r[p], r[q] = _nan(0x7FC00011), _nan(0xFFC00022)
        rows.append(r)
    for _ in range(6):  # signed zeros tied as the maximum (and, squared or |.|, the minimum)
        r = -np.abs(rng.standard_normal(n)).astype(np.float32) - 1
        k = rng.integers(1, min(n, 5) + 1)
        z = rng.choice(n, k, replace=False)
        r[z] = np.where(rng.random(k) < 0.5, np.float32(-0.0), np.float32(0.0))
        rows.append(r)
        rows.append(np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32))
    rows.append(np.full(n, -np.inf, np.float32))
    rows.append(np.full(n, np.inf, np.float32))
    r = rng.standard_normal(n).astype(np.float32)
    r[rng.integers(n)] = np.inf
    r[rng.integers(n)] = -np.inf
    rows.append(r)
    rows.append(np.full(n, 1.5, np.float32))  # ties everywhere
    for _ in range(4):
        rows.append((rng.standard_normal(n) * 10).astype(np.float32))
    return np.stack(rows)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float64).view(np.uint64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [7, 32, 70, 1027])
@pytest.mark.parametrize("layer, stat, value, op", TRAILING, ids=[t[1] + "-" + t[3] for t in TRAILING])
def test_lane_selection_is_the_sweep_in_order(layer, stat, value, op, n, dtype):
    rng = np.random.default_rng(n)
    x = _rows(n, rng).astype(dtype)
    mod = derivgen.load(layer, "c")
    spec = derivgen.load_spec(layer)
    args = [np.full(n, 0.5, dtype) if not p.scalar else np.asarray(0.5, dtype) for p in spec.params]
    want = np.array([_scan(value(r.astype(np.float64)), op) for r in x])
    got = []
    for threads in (1, 2):
        mod.set_num_threads(threads)
        _, cache = mod.forward(x, *args)
        got.append(np.asarray(cache.stats[stat], np.float64))
    mod.set_num_threads(0)
    assert np.array_equal(_bits(got[0]), _bits(got[1]))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got[0]), nan)
    assert np.array_equal(_bits(got[0][~nan]), _bits(want[~nan]))
    if layer != TRAILING[2][0]:  # x and |x|: the NaN kept is the last one, its sign and payload
        assert np.array_equal(_bits(got[0][nan]), _bits(want[nan]))


def test_selection_over_batch_blocks_is_the_sweep_in_order():
    """A batch layout: a channel's group is one block per sample, swept sample by sample."""
    rng = np.random.default_rng(3)
    O, C, S = 5, 6, 37
    x = rng.standard_normal((O, C, S)).astype(np.float32)
    x[1, 0, 3], x[4, 0, 30] = _nan(0x7FC00011), _nan(0xFFC00022)  # channel 0: the later NaN
    x[:, 1] = -np.abs(x[:, 1]) - 1
    x[2, 1, 5], x[0, 1, 36] = np.float32(-0.0), np.float32(0.0)  # channel 1: -0 comes first
    x[:, 2] = np.abs(x[:, 2]) + 1
    x[3, 2, 0], x[1, 2, 9] = np.float32(0.0), np.float32(-0.0)  # channel 2's minimum: -0 first
    x[:, 3] = -np.inf
    mod = derivgen.load(str(REG / "group_max_over_batch_blocks.toml"), "c")
    g, b = np.ones(C, np.float32), np.zeros(C, np.float32)
    for threads in (1, 2):
        mod.set_num_threads(threads)
        _, cache = mod.forward(x, g, b)
        for stat, op in (("hi", "max"), ("lo", "min")):
            want = np.array([_scan(x[:, c].astype(np.float64).reshape(-1), op) for c in range(C)])
            assert np.array_equal(_bits(cache.stats[stat]), _bits(want)), (stat, threads)
    mod.set_num_threads(0)


def test_selections_sweep_in_lanes_of_the_exact_type():
    """max(x) and max(|x|) of float data in float lanes (exact); min(x²) in double lanes (x² of
    a float is exact only in double); the double kernels in double."""
    for layer, stat, lane in [("softmax", "m", "float"), ("absmax_scale", "m", "float")] + [
        (str(REG / "group_min_mask_in_float32.toml"), "Aux3", "double")
    ]:
        text = next(t for p, t in emit(derivgen.derive(layer), ["c"]).files.items() if p.endswith(".c"))
        f32 = text.split("forward, float ----", 1)[1].split("backward, float ----", 1)[0]
        f64 = text.split("forward, double ----", 1)[1].split("backward, double ----", 1)[0]
        assert f"{lane} Lane_{stat}[DG_LANES];" in f32
        assert f"double Lane_{stat}[DG_LANES];" in f64
        assert "DG_INDEPENDENT" in f32.split(f"Lane_{stat}[DG_LANES];", 1)[1].split(f"{stat} = (double)Best;")[0]


@pytest.mark.parametrize("layer", ["softmax", "log_softmax", "softmax_temperature"])
def test_float_sums_of_exp_stay_within_float_rounding(layer):
    """s = sum(exp(x - m)) from float exp widened to double: within 2^-24 of a float64
    reference (measured: 3e-8 at scales 1 to 30, where the double exp gave 1e-15), and y within
    the ulps the float output sweep had before (its error is x - m rounded in float, which
    exp turns into |x - m| ulps: 66 at scale 10; 107 with the temperature 0.7)."""
    rng = np.random.default_rng(7)
    c, ref = derivgen.load(layer, "c"), derivgen.load(layer, "numpy")
    args = [np.asarray(0.7, np.float32)] if layer == "softmax_temperature" else []
    for scale in (1.0, 10.0, 30.0):
        x = (rng.standard_normal((256, 1024)) * scale).astype(np.float32)
        y, cache = c.forward(x, *args)
        yr, cr = ref.forward(x.astype(np.float64), *[a.astype(np.float64) for a in args])
        s, sr = cache.stats["s"], cr.stats["s"]
        assert np.abs(s - sr).max() <= 2.0**-24 * np.abs(sr).max()
        assert np.all(np.abs(s - sr) <= 2.0**-24 * np.abs(sr))
        if layer != "log_softmax":  # y = exp(x - m)/s: relative error in ulps of y
            ulp = np.spacing(np.abs(yr).astype(np.float32)).astype(np.float64)
            err = np.abs(y - yr) / ulp
            assert err.max() <= (80 if layer == "softmax" else 130)
            assert err.mean() <= 20
        else:  # y = x - m - log(s): absolute, against the largest |y| of the row
            assert np.all(np.abs(y - yr) <= 2.0**-22 * np.abs(yr).max(axis=1, keepdims=True))


def test_the_output_sweep_reads_back_the_exp_the_sum_sweep_kept():
    """softmax's forward (float) computes exp(x - m) once per element: the sum sweep keeps it
    in the thread's row, the output sweep divides what it reads back (sweep.py, _kept), and
    the backward's dx sweep reads back the reduction sweep's exp(x̂); the double kernels keep
    nothing (their sums are double arithmetic, the output sweep too). The bits are those of
    computing them again (checked side by side when this was written: y, the statistics, dx
    and dt of softmax, softmax_temperature, log_softmax, absmax_scale, 1 and 2 threads)."""
    text = next(t for p, t in emit(derivgen.derive("softmax"), ["c"]).files.items() if p.endswith(".c"))
    f32 = text.split("forward, float ----", 1)[1].split("backward, float ----", 1)[0]
    f64 = text.split("forward, double ----", 1)[1].split("backward, double ----", 1)[0]
    stats, out = f32.split("s_Out[Grp] = s;", 1)
    assert stats.count("Kv0_Row[Idx - Off] = Kv0;") == 2  # the lane blocks and the remainder
    assert "Dg_expf" not in out and out.count("const float Kv0 = Kv0_Row[Idx - Off];") == 3
    assert "Kv0" not in f64
    # the backward: its reduction sweep (g = dy·exp(x̂)) keeps exp(x̂) for the dx sweep
    bwd = text.split("backward, float ----", 1)[1].split("double backward, float", 1)[0]
    red, dx = bwd.split("const double Mean_g = ", 1)
    assert red.count("Kv0_Row[Idx - Off] = Kv0;") == 2 and red.count("Dg_expf") == 2
    assert "Dg_expf" not in dx and dx.count("const float Kv0 = Kv0_Row[Idx - Off];") == 3


def test_x_minus_a_float_maximum_has_no_low_half():
    """softmax's m is a maximum of float data taken in float lanes: a float value, so the float
    sweeps add x - m as x + (float)(-m) alone (floats.float_prelude, ``exact``), where a mean
    needs hi + lo; log-softmax's output adds -m - log(s), which is not one, with both halves."""
    for layer, lo_out in (("softmax", False), ("softmax_temperature", False), ("log_softmax", True)):
        text = next(t for p, t in emit(derivgen.derive(layer), ["c"]).files.items() if p.endswith(".c"))
        f32 = text.split("train forward, float ----", 1)[1].split("train backward, float ----", 1)[0]
        stats, out = f32.split("s_Out[Grp] = s;", 1)
        assert "H0_hi" in stats and "H0_lo" not in stats, layer
        assert ("_lo" in out) == lo_out, layer
        bwd = text.split("train backward, float ----", 1)[1].split("----", 1)[0]
        assert "H0_lo" in bwd, layer  # the backward's m is an input: not assumed a float value
