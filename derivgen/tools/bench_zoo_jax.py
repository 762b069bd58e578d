"""``derivgen bench --zoo --jax``: every catalogue and zoo layer with a JAX target, derivgen.jax's
function (the default ``custom_jvp`` over the derived JVP, and ``rule="vjp"`` over the derived
VJP) under ``jax.jit`` against ``jax.jit`` of a plain jax.numpy forward of the same layer with
JAX's own autodiff (bench_jax_refs.spec_forward: the spec's statistics, coordinate and output
walked as jnp expressions, nothing derived), forward and forward + backward.

The arguments are bench_zoo's (:func:`derivgen.tools.bench_zoo.problem`), and so is the oracle:
the independent PyTorch forward's float64 autograd. Every variant (float32) must agree with it
before it is timed; the variants are timed round-robin (bench_jax's ``_round_robin_ms``, which
blocks on JAX's asynchronous results).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
import torch

import derivgen
from derivgen.runtime.machine import machine
from derivgen.tools.bench_jax import _round_robin_ms
from derivgen.tools.bench_zoo import (
    CHANNELS,
    TOL,
    TRAILING,
    _run_ref,
    disagreement,
    layers,
    problem,
    table_text,
)
from derivgen.tools.bench_zoo_refs import reference

JAX_IMPLS = ("derivgen", "derivgen_vjp", "autodiff")


def _tensor_view(v, kind: str, shape: tuple, channels: bool):
    """A tensor beside x at its own shape, broadcast to x's (written here: plain jnp, nothing
    of derivgen's): per sample, (B, D) over x's middle axes or (N, C) over the spatial ones;
    per position, (N, 1, *spatial) over the channels."""
    import jax.numpy as jnp

    if kind == "sample":
        v = (
            v.reshape(v.shape + (1,) * (len(shape) - 2))
            if channels
            else v.reshape((v.shape[0],) + (1,) * (len(shape) - 2) + (v.shape[-1],))
        )
    return jnp.broadcast_to(v, shape)


def _steps(prob) -> tuple[dict, tuple, list[str]]:
    """The jitted forward and forward + backward of each implementation, their arguments and
    the names of the differentiated ones (x, the parameters, the per-group inputs, the tensors
    beside x that have a gradient)."""
    import jax
    import jax.numpy as jnp

    import derivgen.jax as dj
    from derivgen.tools.bench_jax_refs import spec_outputs

    spec = derivgen.load_spec(prob.name)
    pnames = [p.name for p in spec.params]
    inames = [i.name for i in spec.inputs]
    tnames = [t.name for t in spec.tensors]
    gnames = [t.name for t in spec.grad_tensors]
    f32 = jnp.float32
    x = jnp.asarray(prob.args["x"], f32)
    params = tuple(jnp.asarray(prob.args[p], f32) for p in pnames)
    inputs = tuple(jnp.asarray(prob.args[i], f32) for i in inames)
    masks = {t: jnp.asarray(prob.args[t], f32) for t in tnames if t not in gnames}  # constants
    tens = tuple(jnp.asarray(prob.args[t], f32) for t in gnames)
    bufs = {b: jnp.asarray(v, f32) for b, v in prob.buffers.items()}
    dys = tuple(jnp.asarray(c, f32) for c in prob.cots)
    opts = {k: v for k, v in prob.options.items() if k != "num_groups"}
    meta = dj.function(prob.name).meta
    L = dj.make_layout(meta, x.shape, {p: v.shape for p, v in zip(pnames, params)}, prob.groups, f32)
    kinds = {t.name: t.shape for t in spec.tensors}
    channels = spec.layout == "channels"

    def ours(rule: str) -> Callable:
        f = dj.function(prob.name, rule=rule)

        def forward(x, params, inputs, tens):
            given = {**masks, **dict(zip(gnames, tens))}
            out = f(
                x,
                *(given[t] for t in tnames),
                *params,
                **dict(zip(inames, inputs)),
                **opts,
                **bufs,
                num_groups=prob.groups,
            )
            if bufs:  # (y, [outputs...], new buffers): the buffers are not differentiated
                out = out[:-1] if len(out) > 2 else out[0]
            return out

        return forward

    def plain(x, params, inputs, tens):
        p4 = {p.name: v.reshape(L.scalar_view if p.scalar else L.param_view) for p, v in zip(spec.params, params)}
        per_group = {
            k: (v.reshape(L.scalar_view) if v.size == 1 else v.reshape(L.stat_view))
            for k, v in {**dict(zip(inames, inputs)), **bufs}.items()
        }
        given = {**masks, **dict(zip(gnames, tens))}
        t4 = {t: _tensor_view(v, kinds[t], x.shape, channels).reshape(L.view) for t, v in given.items()}
        outs = spec_outputs(
            spec, "train", x.reshape(L.view), p4, {**opts, **per_group}, L.reduce_axes, L.axes4, tensors4=t4
        )
        outs = tuple(o.reshape(x.shape) for o in outs)
        return outs if spec.outputs else outs[0]

    def step(forward: Callable) -> Callable:
        def run(x, params, inputs, tens, dys):
            y, back = jax.vjp(forward, x, params, inputs, tens)
            return y, back(dys if spec.outputs else dys[0])

        return jax.jit(run)

    fwds = {"derivgen": ours("jvp"), "derivgen_vjp": ours("vjp"), "autodiff": plain}
    out = {}
    for impl, fwd in fwds.items():
        out[impl] = (jax.jit(fwd), step(fwd))
    return out, (x, params, inputs, tens, dys), ["x", *pnames, *inames, *gnames]


def _result(fwd, stp, args, names) -> tuple[list, dict]:
    """The outputs of the forward, those of the step and every gradient, as float64 NumPy."""
    y0 = fwd(*args[:-1])
    y, (dx, dp, di, dt) = stp(*args)
    grads = [dx, *dp, *di, *dt]
    outs = [*(y0 if isinstance(y0, tuple) else (y0,)), *(y if isinstance(y, tuple) else (y,))]
    return [np.asarray(o, np.float64) for o in outs], {k: np.asarray(g, np.float64) for k, g in zip(names, grads)}


def bench_jax_layer(name: str, trailing: tuple, channels: tuple, repeat: int) -> dict:
    """One layer's row: each implementation's forward and step in ms, the ratios to the
    plain forward's autodiff, the agreement; or ``error``."""
    row: dict = {"layer": name}
    ref = reference(name)
    if ref is None:
        row["error"] = "no independent PyTorch reference (the float64 oracle)"
        return row
    prob = problem(name, trailing, channels)
    row["shape"] = list(prob.shape)
    try:
        steps, args, names = _steps(prob)
    except (TypeError, ValueError, NotImplementedError) as e:
        row["error"] = f"derivgen.jax refused it: {str(e).splitlines()[0]}"
        return row
    want = _run_ref(prob, ref, torch.float64)
    row["agreement"] = {}
    for impl, (fwd, stp) in steps.items():
        try:
            err, what = disagreement(_result(fwd, stp, args, names), want)
        except Exception as e:  # noqa: BLE001 -- a variant that fails to run is reported, not raised
            row["error"] = f"{impl} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return row
        row["agreement"][impl] = err
        if err > TOL:
            row["error"] = f"{impl} disagrees with the float64 reference: {what} off by {err:.2g} (> {TOL:g})"
            return row
    fns = {}
    for impl, (fwd, stp) in steps.items():
        fns[f"{impl}_fwd"] = lambda fwd=fwd: fwd(*args[:-1])
        fns[f"{impl}_step"] = lambda stp=stp: stp(*args)
    ms = _round_robin_ms(fns, repeat)
    row.update(ms)
    for impl in ("derivgen", "derivgen_vjp"):
        row[f"{impl}_step_vs_autodiff"] = ms[f"{impl}_step"] / ms["autodiff_step"]
        row[f"{impl}_fwd_vs_autodiff"] = ms[f"{impl}_fwd"] / ms["autodiff_fwd"]
    return row


def run_zoo_jax_bench(
    names: Collection[str] | None = None,
    trailing: tuple = TRAILING,
    channels: tuple = CHANNELS,
    repeat: int = 15,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Every layer's row (``names``: those only), the machine and JAX's version, as data."""
    import jax

    rows = []
    for name in names or layers():
        rows.append(bench_jax_layer(name, trailing, channels, repeat))
        if progress:
            progress(name)
    return {
        "machine": machine().as_dict(),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "dtype": "float32",
        "repeat": repeat,
        "trailing": list(trailing),
        "channels": list(channels),
        "tolerance": TOL,
        "rows": rows,
    }


def format_zoo_jax_report(rep: dict) -> str:
    """The report as text: the machine, one row per layer, the layers not timed with their reasons."""
    m = rep["machine"]
    lines = [
        (
            f"machine: {m['cpu']}; {m['cores']} core(s); ISA {' '.join(m['flags']) or '-'}; JAX {rep['jax']} on "
            f"{', '.join(rep['devices'])}"
        ),
        (
            f"derivgen.jax.function under jit against jit of a plain jnp forward with JAX's autodiff: {rep['dtype']}, "
            f"median of {rep['repeat']} (round-robin); trailing layers {'x'.join(map(str, rep['trailing']))}, "
            f"channel layers {'x'.join(map(str, rep['channels']))}; every variant within {rep['tolerance']:g} "
            "of the float64 reference"
        ),
        "",
    ]
    cols = ("layer", "shape", "autodiff", "jvp", "vjp", "jvp/ad", "vjp/ad", "fwd/ad")
    table = [cols]
    for r in rep["rows"]:
        if "error" in r:
            continue
        table.append(
            (
                r["layer"],
                "x".join(map(str, r["shape"])),
                f"{r['autodiff_step']:.2f}",
                f"{r['derivgen_step']:.2f}",
                f"{r['derivgen_vjp_step']:.2f}",
                f"{r['derivgen_step_vs_autodiff']:.2f}",
                f"{r['derivgen_vjp_step_vs_autodiff']:.2f}",
                f"{r['derivgen_fwd_vs_autodiff']:.2f}",
            )
        )
    legend = (
        "autodiff, jvp, vjp: fwd+bwd ms (jitted y and every gradient) of the plain forward, derivgen.jax's "
        "default rule (custom_jvp, reverse mode by transposition) and rule='vjp'; jvp/ad, vjp/ad: derivgen's "
        "over the plain forward's; fwd/ad: the same of the jitted forward"
    )
    return table_text(lines, table, legend, rep["rows"])
