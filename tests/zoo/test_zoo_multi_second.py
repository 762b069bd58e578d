"""The second order of the zoo's layers with tensor inputs and outputs beside y, generated
(``backward_backward`` and ``jvp``) and run, against double backward and forward-mode
autograd of the independent PyTorch references of multi_reference.py: every gradient of
L₂ = Σ δx·dx + Σ δt·dt + Σ δp·dp (with respect to x, each tensor with a gradient, dy, each
output's cotangent and each parameter) and the tangent of every output, float64 to 1e-9 and
float32 to 1e-3 relative to the largest reference value (the first order's bounds times ten)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import grid
from test_zoo_multi import CASES, _draw, _module, _rel

import derivgen

F64, F32 = 1e-9, 1e-3


def _seeds(name: str, seed: int = 3) -> dict:
    """Random cotangents of every output (first order), cotangents of every gradient (second
    order) and tangents of every input with a gradient, by name."""
    spec, case = derivgen.load_spec(name), CASES[name]
    rng = np.random.default_rng(seed)
    args = _draw(name)
    grads_of = ["x", *(t.name for t in spec.grad_tensors), *case.params]
    return {
        "cots": [rng.standard_normal(case.x) for _ in range(1 + len(spec.outputs))],
        "dd": {k: rng.standard_normal(args[k].shape) for k in grads_of},
        "t": {k: rng.standard_normal(args[k].shape) for k in grads_of},
    }


def _reference_second(name: str) -> tuple[dict, list]:
    """Double backward (torch.autograd with create_graph) and forward mode (torch.func.jvp)
    of the reference: L₂'s gradients by name (x, tensors, params, then 'dy' and 'd<output>'),
    and the tangents of the outputs in order."""
    spec, case = derivgen.load_spec(name), CASES[name]
    args, s = _draw(name), _seeds(name)
    grads_of = ["x", *(t.name for t in spec.grad_tensors), *case.params]
    ts = {k: torch.tensor(v, requires_grad=k in grads_of) for k, v in args.items()}
    cots = [torch.tensor(c, requires_grad=True) for c in s["cots"]]
    outs = case.reference(ts, case.options)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    loss = sum((o * c).sum() for o, c in zip(outs, cots))
    first = torch.autograd.grad(loss, [ts[k] for k in grads_of], create_graph=True)
    l2 = sum((g * torch.tensor(s["dd"][k])).sum() for k, g in zip(grads_of, first))
    wrt = [ts[k] for k in grads_of] + cots
    second = torch.autograd.grad(l2, wrt, allow_unused=True)
    names = grads_of + ["dy", *("d" + o.name for o in spec.outputs)]
    want = {n: (torch.zeros_like(w) if g is None else g).detach().numpy() for n, g, w in zip(names, second, wrt)}

    def fwd(*prim):
        a = {**{k: torch.tensor(v) for k, v in args.items()}, **dict(zip(grads_of, prim))}
        o = case.reference(a, case.options)
        return tuple(o) if isinstance(o, tuple) else (o,)

    prim = tuple(torch.tensor(args[k]) for k in grads_of)
    tang = tuple(torch.tensor(s["t"][k]) for k in grads_of)
    _, touts = torch.func.jvp(fwd, prim, tang)
    return want, [t.numpy() for t in touts]


def _generated_second(name: str, module, dtype) -> tuple[dict, list]:
    """The generated backward_backward and jvp at the same point, by the reference's names."""
    spec, case = derivgen.load_spec(name), CASES[name]
    s = _seeds(name)
    a = {k: v.astype(dtype) for k, v in _draw(name).items()}
    pos = [a["x"], *(a[t.name] for t in spec.tensors), *(a[p.name] for p in spec.params)]
    _, cache = module.forward(*pos, **case.options)
    c = [v.astype(dtype) for v in s["cots"]]
    dd = {k: v.astype(dtype) for k, v in s["dd"].items()}
    g = module.backward_backward(
        c[0],
        cache,
        dd["x"],
        {p: dd[p] for p in case.params},
        ddtensors={t.name: dd[t.name] for t in spec.grad_tensors},
        **{"d" + o.name: v for o, v in zip(spec.outputs, c[1:])},
    )
    got = {"x": g.dx, "dy": g.ddy}
    got.update({t.name: getattr(g, "d" + t.name) for t in spec.grad_tensors})
    got.update({p: getattr(g, "d" + p) for p in case.params})
    got.update({"d" + o.name: getattr(g, "dd" + o.name) for o in spec.outputs})
    t = {k: v.astype(dtype) for k, v in s["t"].items()}
    ty = module.jvp(
        cache, t["x"], {p: t[p] for p in case.params}, ttensors={tn.name: t[tn.name] for tn in spec.grad_tensors}
    )
    return got, list(ty) if spec.outputs else [ty]


# make test: every pair of (layer, backend, dtype) values
@pytest.mark.parametrize("name,backend,dtype", grid(sorted(CASES), ["c", "numpy"], ["float64", "float32"]))
def test_second_order_against_autograd_of_the_library(name, backend, dtype):
    want, want_t = _reference_second(name)
    got, got_t = _generated_second(name, _module(name, backend), np.dtype(dtype))
    tol = F64 if dtype == "float64" else F32
    assert sorted(got) == sorted(want)
    for k in want:
        assert _rel(got[k], want[k]) < tol, (name, k, _rel(got[k], want[k]))
    assert len(got_t) == len(want_t)
    for k, (g, w) in enumerate(zip(got_t, want_t)):
        assert _rel(g, w) < tol, (name, "tangent", k)


def test_add_rmsnorm_double_backward_shares_dl2_dh():
    """∂h/∂x = ∂h/∂residual = 1: the double backward computes ∂L₂/∂h once per element and
    writes dx and dresidual from it, the same values."""
    from derivgen.codegen.emit import emit

    text = emit(derivgen.derive("add_rmsnorm"), ("numpy",)).files["numpy/add_rmsnorm.py"]
    assert "h_Adj2 = " in text
    for backend in ("numpy", "c"):
        got, _ = _generated_second("add_rmsnorm", _module("add_rmsnorm", backend), np.float64)
        assert np.array_equal(got["x"], got["residual"]), backend


def test_second_order_arguments_are_named():
    m = derivgen.load("adaln", backend="numpy")
    a = _draw("adaln")
    _, cache = m.forward(a["x"], a["shift"], a["scale"])
    dy = np.ones_like(a["x"])
    with pytest.raises(ValueError, match=r"ddtensors.scale must have the shape of scale \(3, 8\)"):
        m.backward_backward(dy, cache, ddtensors={"scale": a["x"]})
    with pytest.raises(ValueError, match="ddtensors has nope, which is not a tensor input with a gradient"):
        m.backward_backward(dy, cache, ddtensors={"nope": a["scale"]})
    with pytest.raises(TypeError, match="ttensors.shift has dtype float32"):
        m.jvp(cache, ttensors={"shift": a["shift"].astype(np.float32)})
    # no seed at all: every gradient zero but what dy alone gives (nothing: L₂ = 0)
    g = m.backward_backward(dy, cache)
    assert all(not np.any(v) for v in g)
