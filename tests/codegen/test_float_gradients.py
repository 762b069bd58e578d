"""A float kernel's scalar parameter gradients computed as its dx is (floats.sums_in_float,
``gradient``): Dynamic Tanh's dalpha = sum dy gamma x (1 - tanh^2(alpha x)) and Derf's dalpha,
ds = sum dy gamma (x, 1) (2/sqrt(pi)) exp(-(alpha x + s)^2) add float terms, each widened to
double, that call the same float tanh or exp as dx (one call per element, where the terms were
double before and called the double function again). Each term is then within a few float
roundings of its exact value, so the sum is within float rounding of sum |term|; its own
relative error grows with the sum's cancellation (docs/numerics.md). Constant factors with an
irrational number are one literal: no element divides by sqrt(pi). And the dx sweep divides by
no group value: a product's group factors with a divisor are one float constant per group
(floats.float_prelude, ``Qf0``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import derivgen
from derivgen.codegen.emit import emit

_E = 2.0**-24  # float's unit roundoff


def _terms(layer: str, x, dy, p) -> dict[str, np.ndarray]:
    """Each scalar parameter's gradient terms in float64, from the forward written here:
    Dynamic Tanh y = gamma tanh(alpha x) + beta, Derf y = gamma erf(alpha x + s) + beta."""
    if layer == "dynamic_tanh":
        g = dy * p["gamma"] * (1 - np.tanh(p["alpha"] * x) ** 2)  # dL/d(alpha x)
        return {"dx": g * p["alpha"], "dalpha": g * x}
    g = dy * p["gamma"] * 2 / math.sqrt(math.pi) * np.exp(-((p["alpha"] * x + p["s"]) ** 2))
    return {"dx": g * p["alpha"], "dalpha": g * x, "ds": g}


@pytest.mark.parametrize("layer", ["dynamic_tanh", "derf"])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_scalar_gradients_within_float_rounding_of_their_terms(layer, scale):
    """Every scalar gradient within 2 float roundings of sum |term| of the float64 value
    (measured: under 0.04 at 512x1024, the float output's own rounding included), and dx
    within 8 roundings of |dy gamma alpha|, its largest factor (measured: under 5.1; where
    tanh is near 1, 1 - tanh^2 is small and its relative error large, in either arithmetic)."""
    rng = np.random.default_rng(11)
    c = derivgen.load(layer, "c")
    x = (rng.standard_normal((512, 1024)) * scale).astype(np.float32)
    dy = rng.standard_normal((512, 1024)).astype(np.float32)
    p = {"alpha": np.float32([0.9]), "gamma": (rng.standard_normal(1024) * 0.5 + 0.8).astype(np.float32)}
    if layer == "derf":
        p["s"] = np.float32([0.3])
    p["beta"] = rng.standard_normal(1024).astype(np.float32)
    _, cache = c.forward(x, *(p[k] for k in ("alpha", "s", "gamma", "beta") if k in p))
    grads = c.backward(dy, cache)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    p64 = {k: v.astype(np.float64) for k, v in p.items()}
    terms = _terms(layer, x64, dy64, p64)
    dx_ref = terms.pop("dx")
    assert np.all(np.abs(grads.dx - dx_ref) <= 8 * _E * np.abs(dy64 * p64["gamma"] * p64["alpha"]))
    for name, t in terms.items():
        got = float(np.asarray(getattr(grads, name), np.float64).reshape(-1)[0])
        assert abs(got - t.sum()) <= 2 * _E * np.abs(t).sum(), name


@pytest.mark.parametrize("layer", ["dynamic_tanh", "derf", "evonorm_s0"])
def test_the_gradient_sums_call_the_float_function_of_dx(layer):
    """The float backward calls no double tanh, exp or sigmoid: the scalar gradients' terms
    (Dynamic Tanh, Derf) and the reduction sweep's group sums (EvoNorm-S0's
    sum dy gamma x sigmoid(v x)) are float, the same calls as dx's; and no element divides by
    a constant."""
    text = next(t for p, t in emit(derivgen.derive(layer), ["c"]).files.items() if p.endswith(".c"))
    bwd = text.split("train backward, float ----", 1)[1].split("----", 1)[0]
    assert "Lane_Psum_0[J] +=" in bwd or "Lane_Sum_0[J] += ((double)(" in bwd
    assert not any(f"Dg_{f}(" in bwd for f in ("tanh", "exp", "sigmoid"))
    assert "/sqrt" not in bwd and "/sqrt" not in text.split("train backward, double ----", 1)[1].split("----", 1)[0]


@pytest.mark.parametrize("layer", ["softmax", "scalenorm", "online_layernorm", "layernorm_annotated", "absmax_scale"])
def test_the_float_dx_sweep_multiplies_by_its_group_divisors(layer):
    """No dx store of the float backward divides (they did: softmax's (g - Mean_g*N*e/s)/s,
    online layer norm's g/std + ...); each divisor is in a Qf constant computed in double, and
    the double backward is as it was (its coefficients are per-group already)."""
    text = next(t for p, t in emit(derivgen.derive(layer), ["c"]).files.items() if p.endswith(".c"))
    bwd = text.split("train backward, float ----", 1)[1].split("----", 1)[0]
    stores = [ln.split("=", 1)[1] for ln in bwd.splitlines() if "dx_R[" in ln and "] = " in ln or "T_dx[J] = " in ln]
    assert stores and not any("/" in rhs for rhs in stores)
    assert "const float Qf0 = (float)(" in bwd
    assert "Qf0" not in text.split("train backward, double ----", 1)[1].split("----", 1)[0]
