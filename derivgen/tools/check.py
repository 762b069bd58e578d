"""Cross-check generated code: every layer x backend x dtype against

1. the spec itself, evaluated group by group (derivgen.tools.evaluate: forward), and
   float64 central finite differences of the backend's forward (backward);
2. the other backend;
3. PyTorch autograd, through PyTorch's own layer where it has one (online_layernorm's
   formula written in torch operations), and for any other spec through the spec's
   forward written in torch operations (independent of the derived closed forms);
   without torch: "skipped: torch not installed", which under CI=true is a failure;
4. the engine's brute-force proof at small N.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import sympy

from derivgen.api import derive, load
from derivgen.codegen.emit import BLOCKLESS
from derivgen.derive.first import ModeDerivation
from derivgen.runtime import Layout, resolve_layout
from derivgen.spec.model import Spec
from derivgen.symbolic import functions
from derivgen.tools import torch_ref  # as a module: tests stand in for its torch_available
from derivgen.tools.evaluate import GroupEvaluator

TOL = {
    # check: (float64, float32), relative to max(1, max |reference|)
    "spec": (1e-12, 2e-6),
    "finite differences": (1e-6, 1e-5),
    "other backend": (1e-12, 2e-6),
    "torch": (1e-10, 2e-5),
    # second order: finite differences of the (float64) backward and forward
    "second order finite differences": (1e-6, 1e-4),
}
DTYPES = {"float32": np.float32, "float64": np.float64}


@dataclass
class Row:
    """One line of the table: a check of one layer, mode, backend and dtype, with the largest
    relative error per output, the tolerance and ``ok``, ``FAIL...`` or ``skipped...``."""

    layer: str
    mode: str
    backend: str
    dtype: str
    check: str
    errors: dict[str, float] = field(default_factory=dict)
    tol: float | None = None
    status: str = "ok"

    @property
    def failed(self) -> bool:
        """Whether the check failed (a skip is no failure)."""
        return self.status.startswith("FAIL")


@dataclass
class Case:
    """A mode's test case: the shapes of x and the parameters, and the keyword arguments."""

    mode: str
    x_shape: tuple
    param_shape: tuple
    kwargs: dict


def cases_for(spec: Spec) -> list[Case]:
    """Small shapes that exercise each layout (odd sizes), one per mode."""
    out = []
    for mode in spec.modes:
        kw: dict = {}
        if spec.layout == "trailing":
            spanning = [p for p in spec.params if not p.scalar]
            xs, ps = ((3, 2, 5), (2, 5)) if spanning or spec.axes == 2 else ((3, 2, 5), (5,))
        elif spec.reduce == "batch":
            xs, ps = (4, 3, 5), (3,)
        elif spec.reduce == "instance":
            xs, ps = (2, 3, 7), (3,)
        elif spec.reduce == "position":
            xs, ps = (2, 5, 3, 7), (5,)
        elif spec.reduce == "all":
            xs, ps = (3, 2, 5), (2,)
        else:
            xs, ps = (2, 6, 5), (6,)
            kw["num_groups"] = 3
        kw.update(case_options(spec, mode.name))
        out.append(Case(mode.name, xs, ps, kw))
    return out


def case_options(spec: Spec, mode: str) -> dict:
    """The keyword arguments a check passes for ``mode`` besides the shapes: a required
    option inside its range, eps = 1e-3 (finite differences stay well conditioned), p = 0.5
    for an option p of ``leading(p)`` (half of a small group selected, whatever the
    default), and ``training`` where the layer has an eval mode."""
    kw: dict = {}
    masked = {m.option for m in spec.masks}
    for o in spec.options:
        if o.name in masked:
            kw[o.name] = 0.5
        elif o.default is None:
            lo = o.min if o.min is not None else 0.0
            hi = o.max if o.max is not None else lo + 1.0
            kw[o.name] = lo + 0.37 * (hi - lo)
        elif o.name == "eps":
            kw[o.name] = 1e-3
    if "eval" in [m.name for m in spec.modes]:
        kw["training"] = mode == "train"
    return kw


def _inputs(spec: Spec, case: Case, dtype: type, seed: int) -> tuple:
    """(x, dy, parameters, keyword arguments, layout) of a case in ``dtype``, random with ``seed``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.3, 1.3, case.x_shape)
    dy = rng.normal(size=case.x_shape)
    params = [np.asarray(rng.normal(1.0, 0.4, () if p.scalar else case.param_shape)) for p in spec.params]
    kw = dict(case.kwargs)
    meta_like = {"name": spec.name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"], "axes": spec.axes}
    layout = resolve_layout(meta_like, x, {"p": np.empty(case.param_shape)}, kw.get("num_groups"))
    for i in spec.inputs:
        kw[i.name] = rng.uniform(0.6, 1.4, layout.group_shape)
    for b in spec.buffers:
        kw[b.name] = rng.uniform(0.6, 1.4, layout.group_shape)
    cast = {k: (v.astype(dtype) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    return x.astype(dtype), dy.astype(dtype), [p.astype(dtype) for p in params], cast, layout


def _copy_kw(kw: dict) -> dict:
    """``kw`` with its arrays copied (a backend may update buffers in place)."""
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw.items()}


def _relerr(got: object, ref: object) -> float:
    """max |got - ref| / max(1, max |ref|) (NaN where both are NaN counts as equal; shapes that
    differ: infinite)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return math.inf
    both_nan = np.isnan(got) & np.isnan(ref)
    diff = np.where(both_nan, 0.0, np.abs(got - ref))
    return float(diff.max() / max(1.0, float(np.nanmax(np.abs(ref))) if ref.size else 1.0)) if ref.size else 0.0


def _seeds(
    spec: Spec, x: np.ndarray, params: list[np.ndarray], kw: dict, layout: Layout, seed: int = 23
) -> tuple[dict, dict]:
    """Cotangents for the double backward (by the backward's field names) and tangents
    for the JVP (by the forward's argument names), float64."""
    rng = np.random.default_rng(seed)
    bb = {"dx": rng.normal(size=x.shape)}
    jv = {"x": rng.normal(size=x.shape)}
    for p, v in zip(spec.params, params):
        bb["d" + p.name] = rng.normal(size=np.shape(v))
        jv[p.name] = rng.normal(size=np.shape(v))
    for i in spec.inputs:
        bb["d" + i.name] = rng.normal(size=np.shape(kw[i.name]))
        jv[i.name] = rng.normal(size=np.shape(kw[i.name]))
    return bb, jv


def _second(
    mod: ModuleType, spec: Spec, cache: object, dy: np.ndarray, seeds: tuple[dict, dict], dtype: np.dtype
) -> dict:
    """The module's double backward (keys ``bb.<field>``) and JVP (``jvp.ty``) at the seeds."""
    bb, jv = ({k: np.asarray(v, dtype=dtype) for k, v in d.items()} for d in seeds)
    g2 = mod.backward_backward(
        dy,
        cache,
        bb["dx"],
        {p.name: bb["d" + p.name] for p in spec.params},
        ddinputs={i.name: bb["d" + i.name] for i in spec.inputs},
    )
    out = {"bb." + f: np.asarray(getattr(g2, f)) for f in g2._fields}
    out["jvp.ty"] = mod.jvp(
        cache, jv["x"], {p.name: jv[p.name] for p in spec.params}, tinputs={i.name: jv[i.name] for i in spec.inputs}
    )
    return out


def _run(
    mod: ModuleType,
    spec: Spec,
    x: np.ndarray,
    dy: np.ndarray,
    params: list[np.ndarray],
    kw: dict,
    seeds: tuple[dict, dict] | None = None,
) -> dict:
    """Every output of one backend by name: y, the gradients, the second order (given seeds)
    and the buffers the forward updated (in training)."""
    kw = _copy_kw(kw)
    y, cache = mod.forward(x, *params, **kw)
    g = mod.backward(dy, cache)
    out = {"y": y}
    out.update({f: np.asarray(getattr(g, f)) for f in g._fields})
    if seeds is not None:
        out.update(_second(mod, spec, cache, dy, seeds, x.dtype))
    for b in spec.buffers:
        if kw.get(b.name) is not None and kw.get("training", True):
            out[b.name] = kw[b.name]
    return out


def _spec_forward(
    spec: Spec, mode: ModeDerivation, x: np.ndarray, params: list[np.ndarray], kw: dict, layout: Layout
) -> np.ndarray:
    """y from the spec's own expressions, one group at a time (float64)."""
    ev = GroupEvaluator(mode)
    x4 = x.astype(np.float64).reshape(layout.view4)
    p4 = {
        p.name: np.broadcast_to(
            np.asarray(v, np.float64).reshape((1, 1, 1, 1) if p.scalar else layout.param4), layout.view4
        )
        for p, v in zip(spec.params, params)
    }
    y4 = np.empty_like(x4)
    for grp in range(layout.n_groups):
        if layout.per_position:
            o, s = divmod(grp, layout.S)  # (sample, position): the channels at it
            sel = (o, 0, slice(None), s)
        elif layout.per_sample:
            sel = divmod(grp, layout.G)  # (sample, group)
        else:
            sel = (slice(None), grp)
        scalars = {o.name: kw[o.name] for o in spec.options if o.name in kw}
        scalars.update({o.name: o.default for o in spec.options if o.name not in kw})
        for item in (*spec.inputs, *spec.buffers):
            v = np.asarray(kw[item.name], np.float64).reshape(-1)
            scalars[item.name] = v[0] if v.size == 1 else v[grp]
        xs = x4[sel]
        held = [a for a, k in enumerate(sel if isinstance(sel, tuple) else (sel,)) if isinstance(k, slice)]
        held += list(range(len(sel), 4))  # the axes of the view the group's array keeps, in order

        def block(v, axes, shape=xs.shape, held=held):
            """A block mean over the group's elements (flat, in the view's order)."""
            a = np.broadcast_to(np.asarray(v, np.float64).reshape(-1) if np.ndim(v) else v, (math.prod(shape),))
            a = a.reshape(shape)
            on = tuple(held.index(k) for k in axes if k in held)
            return np.broadcast_to(a.mean(axis=on, keepdims=True), shape).reshape(-1)

        y, _ = ev.forward(xs.reshape(-1), {k: v[sel].reshape(-1) for k, v in p4.items()}, scalars, block)
        y4[sel] = y.reshape(xs.shape)
    return y4.reshape(x.shape)


def _fd(
    mod: ModuleType, spec: Spec, x: np.ndarray, dy: np.ndarray, params: list[np.ndarray], kw: dict, h: float = 1e-6
) -> dict[str, np.ndarray]:
    """Central differences of L = sum(dy * y) with respect to x, parameters and inputs (float64)."""

    def loss(xx: np.ndarray, pp: list[np.ndarray], kk: dict) -> float:
        """L = sum(dy * y) at these arguments."""
        y, _ = mod.forward(xx, *pp, **_copy_kw(kk))
        return float(np.sum(dy * y))

    out = {}
    fx = np.empty_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        fx[idx] = (loss(xp, params, kw) - loss(xm, params, kw)) / (2 * h)
    out["dx"] = fx
    for k, p in enumerate(spec.params):
        fp = np.empty_like(params[k])
        for idx in np.ndindex(params[k].shape):
            pp, pm = [q.copy() for q in params], [q.copy() for q in params]
            pp[k][idx] += h
            pm[k][idx] -= h
            fp[idx] = (loss(x, pp, kw) - loss(x, pm, kw)) / (2 * h)
        out["d" + p.name] = fp
    for i in spec.inputs:
        v = np.asarray(kw[i.name], np.float64)
        fi = np.empty_like(v)
        for idx in np.ndindex(v.shape):
            kp, km = _copy_kw(kw), _copy_kw(kw)
            kp[i.name] = v.copy()
            km[i.name] = v.copy()
            kp[i.name][idx] += h
            km[i.name][idx] -= h
            fi[idx] = (loss(x, params, kp) - loss(x, params, km)) / (2 * h)
        out["d" + i.name] = fi
    return out


def _fd_second(
    mod: ModuleType,
    spec: Spec,
    x: np.ndarray,
    dy: np.ndarray,
    params: list[np.ndarray],
    kw: dict,
    seeds: tuple[dict, dict],
    h: float = 1e-6,
) -> dict:
    """Central differences (float64) of L2 = sum(seeds * backward) with respect to x, dy, the
    parameters and the inputs -- along one random direction per argument (the gradient's
    projection: two backward calls per argument, not two per element; the other backend
    and PyTorch compare every element) -- and of y along the JVP's tangents. Keyed like
    the outputs: (direction, directional derivative) for the double backward's ("bb.dx"
    ...), the expected array for the JVP's ("jvp.ty")."""
    bb, jv = seeds
    names = [p.name for p in spec.params]
    rng = np.random.default_rng(101)

    def l2(xx: np.ndarray, dd: np.ndarray, pp: list[np.ndarray], kk: dict) -> float:
        """L2 = sum over the backward's outputs of seed * output, at these arguments."""
        _, c = mod.forward(xx, *pp, **_copy_kw(kk))
        g = mod.backward(dd, c)
        return float(sum(np.sum(bb[f] * np.asarray(getattr(g, f))) for f in g._fields))

    def vary(what: str, arr: object, f: Callable[[np.ndarray], float]) -> tuple[np.ndarray, float]:
        """(a random direction u, the central difference of f along u at ``arr``); ``what`` names the argument."""
        arr = np.asarray(arr, dtype=np.float64)
        u = rng.normal(size=arr.shape)
        return u, (f(np.asarray(arr + h * u)) - f(np.asarray(arr - h * u))) / (2 * h)

    out = {
        "bb.dx": vary("x", x, lambda a: l2(a, dy, params, kw)),
        "bb.ddy": vary("dy", dy, lambda a: l2(x, a, params, kw)),
    }
    for k, p in enumerate(names):
        out["bb.d" + p] = vary(
            p, params[k], lambda a, k=k: l2(x, dy, [a if j == k else q for j, q in enumerate(params)], kw)
        )
    for i in spec.inputs:
        out["bb.d" + i.name] = vary(i.name, kw[i.name], lambda a, i=i: l2(x, dy, params, {**kw, i.name: a}))

    def y_at(t: float) -> np.ndarray:
        """y at the arguments moved by t along the JVP's tangents."""
        pp = [np.asarray(q + t * jv[p]) for q, p in zip(params, names)]
        kk = _copy_kw(kw)
        for i in spec.inputs:
            kk[i.name] = np.asarray(kw[i.name], np.float64) + t * jv[i.name]
        return mod.forward(x + t * jv["x"], *pp, **kk)[0]

    out["jvp.ty"] = (y_at(h) - y_at(-h)) / (2 * h)
    return out


def check_layer(
    spec: Spec,
    backends: Sequence[str] = ("numpy", "c"),
    dtypes: Sequence[str] = ("float32", "float64"),
    *,
    prove_sizes: Sequence[int] = (2, 3, 4, 5, 6),
    progress: Callable[[str], None] | None = None,
    in_ci: bool | None = None,
) -> list[Row]:
    """Every check of one layer, as rows: the proof of each mode, then per mode and dtype each
    backend against the spec and finite differences (first and second order) and PyTorch, and
    the two backends against each other. ``in_ci`` (default: ``$CI``) makes a missing PyTorch a
    failure rather than a skip; ``progress`` is called once per mode, backend and dtype."""
    in_ci = (os.environ.get("CI", "").lower() in ("1", "true", "yes")) if in_ci is None else in_ci
    derivation = derive(spec, prove=tuple(prove_sizes))
    rows: list[Row] = []
    for mode_name, proof in derivation.proofs.items():
        rows.append(
            Row(
                spec.name,
                mode_name,
                "-",
                "-",
                f"proof N={prove_sizes[0]}..{prove_sizes[-1]}",
                status="ok"
                if proof.status == "proven"
                else ("ok (checked numerically)" if proof.ok else "FAIL: " + proof.status),
            )
        )
    if any(m.blocks for m in spec.modes):  # block statistics: the targets with per-block sums
        for b in (b for b in backends if b in BLOCKLESS):
            rows.append(
                Row(spec.name, "-", b, "-", "generated", status="skipped: the target takes no block statistics")
            )
        backends = tuple(b for b in backends if b not in BLOCKLESS)
    mods = {b: load(spec, backend=b) for b in backends}
    have_torch = torch_ref.torch_available()
    for case in cases_for(spec):
        for dt in dtypes:
            rows += _check_case(
                spec, derivation.modes[case.mode], case, dt, backends, mods, have_torch, in_ci, progress
            )
    return rows


NO_FD = "n/a: finite differences see through stop_gradient"


def _stops_gradient(spec: Spec) -> bool:
    """Whether the spec calls stop_gradient: finite differences of its forward then differ
    from its gradient by design, and PyTorch autograd and the proof are the gradient's checks."""
    exprs = [
        spec.output,
        *(st.expr for m in spec.modes for st in (*m.statistics, *m.blocks)),
        *(b.update for b in spec.buffers),
    ]
    if spec.normalized_expr is not None:
        exprs.append(spec.normalized_expr)
    for e in exprs:
        for node in sympy.sympify(e).atoms(sympy.Function):
            fn = functions.of_node(node)
            if fn is not None and fn.name == "stop_gradient":
                return True
    return False


def _check_case(
    spec: Spec,
    mode: ModeDerivation,
    case: Case,
    dt: str,
    backends: Sequence[str],
    mods: dict[str, ModuleType],
    have_torch: bool,
    in_ci: bool,
    progress: Callable[[str], None] | None,
) -> list[Row]:
    """The rows of one case in one dtype: each backend's checks, then the backends against each other."""
    col = 0 if dt == "float64" else 1  # the tolerances' column
    x, dy, params, kw, layout = _inputs(spec, case, DTYPES[dt], seed=11)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    p64 = [p.astype(np.float64) for p in params]
    kw64 = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    ref_y = _spec_forward(spec, mode, x64, p64, kw64, layout)
    torch_first = None
    # PyTorch's own layer where it has one; otherwise autograd through the spec's forward
    # written in torch operations (derivgen.tools.torch_ref.SpecForward)
    own = spec.name in torch_ref.HAS_REFERENCE and spec.source.startswith("catalogue/")
    forward = None if own or not have_torch else torch_ref.SpecForward(spec, case.mode, layout)
    pnames = [p.name for p in spec.params]
    if have_torch:
        y_t, g_t, b_t = torch_ref.torch_reference(
            spec.name, x64, dict(zip(pnames, p64)), _copy_kw(kw64), dy64, forward=forward
        )
        buffers = {k: v for k, v in b_t.items() if v is not None and kw.get("training", True)}
        torch_first = {"y": y_t, **g_t, **buffers}
    seeds = _seeds(spec, x64, p64, kw64, layout)
    torch_second = None
    if torch_first is not None:
        torch_second = torch_ref.torch_second_reference(
            spec.name, x64, dict(zip(pnames, p64)), _copy_kw(kw64), dy64, *seeds, forward=forward
        )
    rows: list[Row] = []
    results: dict[str, dict] = {}
    for b in backends:
        if progress:
            progress(f"{spec.name} {case.mode} {b} {dt}")
        mod = mods[b]
        got = _run(mod, spec, x, dy, params, kw, seeds)
        results[b] = got
        label = (spec.name, case.mode, b, dt)
        # 1. the spec, and finite differences (which see through stop_gradient: then y only)
        stops = _stops_gradient(spec)
        fd = {} if stops else _fd(mod, spec, x64, dy64, p64, kw64)
        errs = {"y": _relerr(got["y"], ref_y)}
        errs.update({k: _relerr(got[k], v) for k, v in fd.items()})
        ok = errs["y"] <= TOL["spec"][col] and all(errs[k] <= TOL["finite differences"][col] for k in fd)
        status = ("ok" if ok else "FAIL") + (" (y only: stop_gradient)" if stops else "")
        rows.append(Row(*label, "spec + finite differences", errs, TOL["finite differences"][col], status))
        if stops:
            rows.append(Row(*label, "second order: finite differences", status=NO_FD))
            rows += _torch_rows(label, got, torch_first, torch_second, have_torch, in_ci, col)
            continue
        fd2 = _fd_second(mod, spec, x64, dy64, p64, kw64, seeds)
        errs = {
            k: (
                _relerr(np.sum(np.asarray(got[k], np.float64) * v[0]), v[1])
                if isinstance(v, tuple)
                else _relerr(got[k], v)
            )
            for k, v in fd2.items()
        }
        tol2 = TOL["second order finite differences"][col]
        rows.append(
            Row(
                *label,
                "second order: finite differences",
                errs,
                tol2,
                "ok" if all(e <= tol2 for e in errs.values()) else "FAIL",
            )
        )
        # 3. torch
        rows += _torch_rows(label, got, torch_first, torch_second, have_torch, in_ci, col)
    # 2. backends agree
    if len(backends) == 2:
        first, other = (results[b] for b in backends)
        errs = {k: _relerr(other[k], first[k]) for k in first}
        ok = all(e <= TOL["other backend"][col] for e in errs.values())
        rows.append(
            Row(
                spec.name,
                case.mode,
                f"{backends[1]}~{backends[0]}",
                dt,
                "other backend",
                errs,
                TOL["other backend"][col],
                "ok" if ok else "FAIL",
            )
        )
    return rows


def _torch_rows(
    label: tuple[str, str, str, str],
    got: dict,
    torch_first: dict | None,
    torch_second: dict | None,
    have_torch: bool,
    in_ci: bool,
    col: int,
) -> list[Row]:
    """One backend's rows against PyTorch (first and second order), or why there are none."""
    if torch_first is not None:
        tol = TOL["torch"][col]
        errs = {k: _relerr(got[k], v) for k, v in torch_first.items() if k in got}
        rows = [Row(*label, "torch", errs, tol, "ok" if all(e <= tol for e in errs.values()) else "FAIL")]
        errs = {k: _relerr(got[k], v) for k, v in torch_second.items()}
        rows.append(
            Row(*label, "torch second order", errs, tol, "ok" if all(e <= tol for e in errs.values()) else "FAIL")
        )
        return rows
    if not have_torch:
        return [
            Row(
                *label,
                "torch",
                status="FAIL: torch not installed (CI=true)" if in_ci else "skipped: torch not installed",
            )
        ]
    return [Row(*label, "torch", status="skipped: no PyTorch counterpart")]
