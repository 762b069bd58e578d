"""Inputs for the Triton tests: shapes off every block multiple (rows of 37 values, 5 x 7
spatial, 3 samples), per layout, and the comparison against the NumPy backend in float64."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import derivgen
from derivgen.runtime import resolve_layout
from derivgen.spec.model import Spec
from derivgen.tools.check import case_options


@dataclass
class Case:
    """One call: x's shape, the parameters' shape, keyword arguments, channels last or not."""

    mode: str
    x_shape: tuple
    param_shape: tuple
    kw: dict
    channels_last: bool = False


def cases(spec: Spec, channels_last: bool = False) -> list[Case]:
    """One case per mode; channel layouts in 4-D (channels last where asked)."""
    out = []
    for mode in spec.modes:
        kw: dict = {}
        if spec.layout == "trailing":
            spanning = [p for p in spec.params if not p.scalar]
            xs, ps = ((5, 37), (37,)) if spanning or spec.axes == 1 else ((3, 5, 13), ())
        elif spec.reduce == "group":
            xs, ps = (3, 6, 5, 7), (6,)
            kw["num_groups"] = 3
        else:
            xs, ps = (3, 4, 5, 7), (4,)
        kw.update(case_options(spec, mode.name))
        out.append(Case(mode.name, xs, ps, kw, channels_last and spec.layout == "channels"))
    return out


def inputs(spec: Spec, case: Case, seed: int = 7) -> tuple:
    """(x, dy, parameters, keyword arguments) as float64 NumPy arrays."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.3, 1.3, case.x_shape)
    dy = rng.normal(size=case.x_shape)
    params = [rng.normal(1.0, 0.4, () if p.scalar else case.param_shape) for p in spec.params]
    kw = dict(case.kw)
    ps = {"p": np.empty(case.param_shape)} if case.param_shape else {}
    meta_like = {"name": spec.name, "layout": spec.layout, "reduce": spec.reduce, "params": list(ps), "axes": spec.axes}
    groups = resolve_layout(meta_like, x, ps, kw.get("num_groups")).group_shape
    for i in spec.inputs:
        kw[i.name] = rng.uniform(0.6, 1.4, groups)
    for b in spec.buffers:
        kw[b.name] = rng.uniform(0.6, 1.4, groups)
    return x, dy, params, kw


def _t(v: np.ndarray, dtype: torch.dtype, channels_last: bool = False) -> torch.Tensor:
    t = torch.tensor(np.asarray(v), dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t


def relerr(got: object, ref: object) -> float:
    """max |got - ref| / max(1, max |ref|)."""
    g = np.asarray(got.float() if isinstance(got, torch.Tensor) else got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert g.shape == r.shape, (g.shape, r.shape)
    return float(np.abs(g - r).max() / max(1.0, float(np.abs(r).max()))) if r.size else 0.0


def run_triton(spec: Spec, case: Case, dtype: torch.dtype, x, dy, params, kw) -> tuple:
    """(y, grads, buffers after the call) by the Triton module, as float64 arrays."""
    mod = derivgen.load(spec, "triton")
    tk = {k: (_t(v, dtype) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    tx = _t(x, dtype, case.channels_last)
    y, cache = mod.forward(tx, *(_t(p, dtype) for p in params), **tk)
    assert y.dtype == dtype and y.stride() == tx.stride()
    grads = mod.backward(_t(dy, dtype, case.channels_last), cache)
    bufs = {b.name: tk[b.name] for b in spec.buffers}
    return y, grads, bufs


def reference(spec: Spec, x, dy, params, kw, backend: str = "numpy", dtype=np.float64) -> tuple:
    """(y, grads, buffers after the call) by the NumPy (or C) backend."""
    mod = derivgen.load(spec, backend)
    nk = {k: (np.array(v, dtype=dtype) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    y, cache = mod.forward(x.astype(dtype), *(np.asarray(p, dtype=dtype) for p in params), **nk)
    grads = mod.backward(dy.astype(dtype), cache)
    return y, grads, {b.name: nk[b.name] for b in spec.buffers}


def rounded(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """v rounded to ``dtype`` and back to float64 (what a low-precision caller passes)."""
    return torch.tensor(np.asarray(v), dtype=dtype).double().numpy()


def compare(spec: Spec, case: Case, dtype: torch.dtype, tol: float, seed: int = 7) -> None:
    """The Triton module against the NumPy backend in float64 on the same (rounded) inputs."""
    x, dy, params, kw = inputs(spec, case, seed)
    if dtype != torch.float32:
        x, dy = rounded(x, dtype), rounded(dy, dtype)
        params = [rounded(p, dtype) for p in params]
        kw = {k: (rounded(v, dtype) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    y, grads, bufs = run_triton(spec, case, dtype, x, dy, params, kw)
    ry, rgrads, rbufs = reference(spec, x, dy, params, kw)
    where = f"{spec.name} {case.mode} {dtype} {case.x_shape}{' channels last' if case.channels_last else ''}"
    assert relerr(y, ry) < tol, f"{where}: y off by {relerr(y, ry)}"
    for f, g, r in zip(grads._fields, grads, rgrads):
        assert relerr(g, r) < tol * 4, f"{where}: {f} off by {relerr(g, r)}"
    for b in bufs:
        assert relerr(bufs[b], rbufs[b]) < tol, f"{where}: buffer {b} off"
