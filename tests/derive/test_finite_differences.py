"""Closed forms against float64 central finite differences at N = 64."""

import numpy as np
import pytest

import derivgen
from derivgen.tools.evaluate import GroupEvaluator

CASES = [(n, m) for n in derivgen.names() for m in derivgen.derive(n).modes]


def _scalars(spec, rng):
    out = {}
    for o in spec.options:
        lo = o.min if o.min is not None else 0.0
        hi = o.max if o.max is not None else lo + 1.0
        out[o.name] = rng.uniform(max(lo, 1e-3), min(hi, 0.9) if hi > 0.9 else hi) if o.name != "eps" else 1e-2
    for i in spec.inputs:
        out[i.name] = rng.uniform(0.5, 1.5)
    for b in spec.buffers:
        out[b.name] = rng.uniform(0.5, 1.5)
    return out


@pytest.mark.parametrize("name,mode", CASES)
def test_closed_form_matches_central_differences(name, mode):
    md = derivgen.derive(name).modes[mode]
    spec = md.spec
    ev = GroupEvaluator(md)
    rng = np.random.default_rng(7)
    n = 64
    x = rng.normal(1.5, 2.0, n)
    dy = rng.normal(size=n)
    params = {p.name: rng.normal(1.0, 0.5, n) for p in spec.params}
    sc = _scalars(spec, rng)

    def loss(x_, params_=params, sc_=sc):
        return float(np.dot(dy, ev.forward(x_, params_, sc_)[0]))

    _, env = ev.forward(x, params, sc)
    dx, dparams, dinputs = ev.backward(dy, env)
    h = 1e-6
    eye = np.eye(n)
    fd = np.array([(loss(x + h * e) - loss(x - h * e)) / (2 * h) for e in eye])
    scale = np.abs(fd).max() + 1e-12
    assert np.abs(fd - dx).max() / scale < 1e-6
    for p in spec.params:
        fdp = np.array(
            [
                (
                    loss(x, {**params, p.name: params[p.name] + h * e})
                    - loss(x, {**params, p.name: params[p.name] - h * e})
                )
                / (2 * h)
                for e in eye
            ]
        )
        assert np.abs(fdp - dparams[p.name]).max() / (np.abs(fdp).max() + 1e-12) < 1e-6
    for i in spec.inputs:
        fdi = (loss(x, params, {**sc, i.name: sc[i.name] + h}) - loss(x, params, {**sc, i.name: sc[i.name] - h})) / (
            2 * h
        )
        assert abs(fdi - dinputs[i.name]) <= 1e-6 * max(1.0, abs(fdi))
