"""`derivgen bench`: generated C, generated NumPy, a plain NumPy baseline,
PyTorch CPU and a STREAM-like bandwidth probe, side by side in one process.

Timings are medians of repeated runs after warm-up. By default glibc malloc is
tuned (no mmap for large blocks, no trimming) so that allocating libraries --
torch, and our own calls without preallocated outputs -- are not charged for
page-faulting fresh memory on every call; ``--default-malloc`` shows that cost.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType

import numpy as np

from derivgen.api import derive, load, load_spec
from derivgen.runtime import aligned_empty, resolve_layout
from derivgen.runtime.build import march_cflags, user_cflags
from derivgen.runtime.machine import machine
from derivgen.spec import Spec
from derivgen.tools.baseline import PlainNumPy
from derivgen.tools.bench_refs import fused_torch_step, plain_numpy, torch_step
from derivgen.tools.bench_targets import DEFAULT_SHAPES, evaluate_targets
from derivgen.tools.timing import Bandwidth, round_robin, tune_malloc
from derivgen.tools.torch_ref import torch_available

# the CPU flags a -march build needs to run here
ISA_NEEDS = {
    "x86-64-v4": ("avx512f", "avx512bw", "avx512vl"),
    "x86-64-v3": ("avx2", "fma"),
    "x86-64-v2": ("sse4_2",),
    "x86-64": (),
}


# ------------------------------------------------------------------ the bench


@dataclass
class Result:
    """One implementation's timings (ms, medians) on one case, and its ratios to the bounds,
    to PyTorch and to plain NumPy."""

    layer: str
    shape: tuple
    impl: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    step_ms: float | None = None  # forward + backward, preallocated outputs
    step_alloc_ms: float | None = None  # forward + backward, allocating outputs
    ratios: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)  # the probe taken beside this case (C and NumPy rows)


@dataclass
class Build:
    """One build of the C kernels: its label in the table, flags, and what the compiler targeted."""

    label: str  # "generated c" or "generated c [x86-64-v3]"
    march: str  # "native" (the user's CFLAGS or the defaults) or a -march value
    cflags: list
    isa: str = ""  # from the library itself (<layer>_isa)
    skipped: str = ""  # why it was not run on this machine


def builds_for(isas: Sequence[str]) -> list[Build]:
    """The C builds to time: ``native`` and any -march names; one this CPU cannot run is
    listed as skipped (an AVX-512 build on an AVX2-only CPU)."""
    flags = set(machine().flags)
    out = []
    for march in isas:
        label = "generated c" if list(isas) == ["native"] else f"generated c [{march}]"
        b = Build(label, march, march_cflags(march) if march != "native" else user_cflags())
        missing = [f for f in ISA_NEEDS.get(march, ()) if f not in flags]
        if missing:
            b.skipped = f"this CPU lacks {', '.join(missing)}"
        out.append(b)
    return out


def _case_spec(layer: str | Spec) -> tuple[Spec, str, bool]:
    """(spec, label, is_catalogue) for a catalogue name or a Spec (from --spec FILE)."""
    spec = load_spec(layer) if isinstance(layer, str) else layer
    return spec, spec.name, spec.source.startswith("catalogue/")


# the zoo's fused layers (tensor inputs beside x, outputs beside y) that the bench times against
# what a user would write instead, PyTorch eager and torch.compile of the same function
FUSED_SHAPES = {
    "add_rmsnorm": [(8192, 4096), (32, 4096)],
    "rmsnorm_gated": [(8192, 4096)],
    "rmsnorm_gated_before": [(8192, 4096)],
}


def default_shapes(spec: Spec) -> list[tuple]:
    """The shapes a layer is benched at by default: a catalogue layer's own, else one by layout."""
    if spec.name in DEFAULT_SHAPES and spec.source.startswith("catalogue/"):
        return DEFAULT_SHAPES[spec.name]
    if spec.name in FUSED_SHAPES and spec.source.startswith("zoo/"):
        return FUSED_SHAPES[spec.name]
    if spec.layout == "trailing":
        return [(8192, 32, 32)] if spec.axes == 2 else [(8192, 1024)]
    return [(32, 64, 56, 56)]


def tensor_inputs(spec: Spec, x: np.ndarray, rng: np.random.Generator) -> tuple[list[np.ndarray], dict]:
    """A case's tensor inputs beside x (in spec order, each of its declared shape, 64-byte aligned;
    masks 0/1 with a valid value in every group) and the cotangents of its outputs beside y."""
    from derivgen.runtime.tensors import tensor_shape

    meta = {"name": spec.name, "layout": spec.layout, "reduce": spec.reduce, "params": [], "axes": spec.axes}
    layout = resolve_layout(meta, x, {}, None)
    out = []
    for t in spec.tensors:
        a = aligned_empty(tensor_shape(meta, t.shape, layout), x.dtype)
        a[...] = rng.standard_normal(a.shape, dtype=np.float32)
        if t.mask:
            a[...] = a > -1.0
            a.reshape(a.shape[0], -1)[:, 0] = 1.0
        out.append(a)
    cots = {}
    for o in spec.outputs:
        c = aligned_empty(x.shape, x.dtype)
        c[...] = rng.standard_normal(x.shape, dtype=np.float32)
        cots["d" + o.name] = c
    return out, cots


def _inputs(spec: Spec, shape: tuple, dt: np.dtype, catalogue: bool) -> tuple:
    """x, dy, parameters and keyword arguments of one case (fixed seed)."""
    rng = np.random.default_rng(0)
    x, dy = aligned_empty(shape, dt), aligned_empty(shape, dt)  # 64-byte aligned, as torch allocates
    x[...] = rng.standard_normal(shape, dtype=np.float32)
    dy[...] = rng.standard_normal(shape, dtype=np.float32)
    pshape = tuple(shape[len(shape) - spec.axes :]) if spec.layout == "trailing" else (shape[1],)
    params = [np.asarray(1.0 + 0.1 * rng.standard_normal(() if p.scalar else pshape), dtype=dt) for p in spec.params]
    kw: dict = {}
    if spec.reduce == "group":
        kw["num_groups"] = 8
    if catalogue and spec.name == "online_layernorm":
        kw.update(alpha=0.1, prev_mean=0.0, prev_std=1.0)
        return x, dy, params, kw
    for o in spec.options:
        if o.default is None:  # a required option: inside its range
            lo = o.min if o.min is not None else 0.0
            hi = o.max if o.max is not None else lo + 1.0
            kw[o.name] = lo + 0.37 * (hi - lo)
    meta = {"name": spec.name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"], "axes": spec.axes}
    layout = resolve_layout(meta, x, {"p": np.empty(pshape)}, kw.get("num_groups"))
    for item in (*spec.inputs, *spec.buffers):
        kw[item.name] = rng.uniform(0.6, 1.4, layout.group_shape).astype(dt)
    if any(m.name == "eval" for m in spec.modes):
        kw["training"] = True
    return x, dy, params, kw


def _baseline(
    spec: Spec, catalogue: bool, x: np.ndarray, params: list[np.ndarray], dy: np.ndarray, kw: dict
) -> Callable[[], object]:
    """The plain NumPy fwd+bwd: the textbook one for catalogue layers, else from the spec."""
    if catalogue:
        return lambda: plain_numpy(spec.name, x, params, dy, kw)
    meta = {"name": spec.name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"], "axes": spec.axes}
    pshape = params[0].shape if params and params[0].ndim else tuple(x.shape[x.ndim - spec.axes :])
    layout = resolve_layout(
        meta, x, {"p": np.empty(pshape) if spec.layout == "trailing" else np.empty(x.shape[1])}, kw.get("num_groups")
    )
    baseline = PlainNumPy(derive(spec).modes["train"], layout)
    opts = {k: v for k, v in kw.items() if k not in ("num_groups", "training")}
    return lambda: baseline.step(x, params, dy, opts)


def run_bench(
    layers: Iterable[str | Spec],
    shapes: Sequence[tuple] | None = None,
    threads: int | None = None,
    dtype: str = "float32",
    repeat: int = 15,
    progress: Callable[[str], None] | None = None,
    tuned_malloc: bool = True,
    isas: Sequence[str] = ("native",),
) -> dict:
    """Time every layer (catalogue names or Specs) at its shapes: each C build, the generated
    NumPy, plain NumPy and (catalogue layers) torch, side by side; see the README's Speed."""
    threads = threads or os.cpu_count() or 1
    tuned = tune_malloc() if tuned_malloc else False
    have_torch = torch_available()
    dt = np.dtype(dtype)
    builds = builds_for(isas)
    live = [b for b in builds if not b.skipped]
    probe = Bandwidth(threads)
    results: list[Result] = []
    for layer in layers:
        spec, name, catalogue = _case_spec(layer)
        for shape in shapes or default_shapes(spec):
            results += _bench_case(
                spec, name, catalogue, tuple(shape), dt, threads, repeat, live, probe, have_torch, progress
            )
    probes = [r.bandwidth for r in results if r.impl == "generated numpy"]  # one probe per case
    bw = {k: statistics.median(p[k] for p in probes) for k in ("copy_GBps", "stream_copy_GBps")} if probes else {}
    bw.update(
        MiB=probe.mib,
        cases=len(probes),
        copy_GBps_range=[min(p["copy_GBps"] for p in probes), max(p["copy_GBps"] for p in probes)] if probes else [],
    )
    report = {
        "machine": machine().as_dict(),
        "builds": [asdict(b) for b in builds],
        "bandwidth": bw,
        "threads": threads,
        "dtype": dtype,
        "tuned_malloc": tuned,
        "torch": have_torch,
        "results": [asdict(r) for r in results],
    }
    report["targets"] = evaluate_targets(report)
    return report


def _timed_calls(
    label: str, setup: tuple, x: np.ndarray, params: list[np.ndarray], dy: np.ndarray, kw: dict
) -> dict[tuple[str, str], Callable[[], object]]:
    """One generated module's timed calls: forward, backward, both with preallocated outputs, and
    both allocating. ``setup`` is (module, y, cache, gradients) from a first call."""
    mod, y, cache, grads = setup[:4]
    outs, cots = (setup[4], setup[5]) if len(setup) > 4 else ({}, {})
    fkw = dict(kw, outs=outs) if outs else kw
    return {
        (label, "fwd"): lambda: mod.forward(x, *params, out=y, **fkw),
        (label, "bwd"): lambda: mod.backward(dy, cache, out=grads, **cots),
        (label, "step"): lambda: mod.backward(dy, mod.forward(x, *params, out=y, **fkw)[1], out=grads, **cots),
        (label, "alloc"): lambda: mod.backward(dy, mod.forward(x, *params, **kw)[1], **cots),
    }


def _bench_case(
    spec: Spec,
    name: str,
    catalogue: bool,
    shape: tuple,
    dt: np.dtype,
    threads: int,
    repeat: int,
    live: list[Build],
    probe: Bandwidth,
    have_torch: bool,
    progress: Callable[[str], None] | None,
) -> list[Result]:
    """The rows of one layer at one shape: 1. each kernel beside the bandwidth probe, 2. forward +
    backward of every implementation side by side; their ratios to the bounds, torch and plain NumPy."""
    x, dy, params, kw = _inputs(spec, shape, dt, catalogue)
    tensors, cots = tensor_inputs(spec, x, np.random.default_rng(1))
    nbytes = x.nbytes
    impls: list[tuple[str, ModuleType]] = [
        (b.label, load(spec, backend="c", cflags=b.cflags if b.march != "native" else None)) for b in live
    ] + [("generated numpy", load(spec, backend="numpy"))]
    fns = {}
    args = [*tensors, *params]  # the forward's positional arguments after x
    for label, mod in impls:
        mod.set_num_threads(threads)
        y = aligned_empty(x.shape, x.dtype)
        outs = tuple(aligned_empty(x.shape, x.dtype) for _ in spec.outputs)
        _, cache = mod.forward(x, *args, out=y, **(dict(kw, outs=outs) if outs else kw))
        grads = mod.backward(dy, cache, **cots)
        fns.update(_timed_calls(label, (mod, y, cache, grads, outs, cots), x, args, dy, kw))
    for b, (_, mod) in zip(live, impls):
        b.isa = b.isa or mod._kernel.isa
    # 1. each kernel beside the bandwidth probe, in turn within every round
    if progress:
        progress(f"{name} {shape} kernels beside the bandwidth probe")
    t1 = round_robin(
        {
            ("probe", "copy"): probe.copy,
            ("probe", "stream_copy"): probe.stream_copy,
            **{k: f for k, f in fns.items() if k[1] in ("fwd", "bwd")},
        },
        repeat,
    )
    cbw = probe.rates({"copy": t1[("probe", "copy")], "stream_copy": t1[("probe", "stream_copy")]})
    moved = {"fwd": 2 * nbytes, "bwd": 3 * nbytes}  # fwd: x, y; bwd: x, dy, dx
    if spec.multi:  # and each tensor input read (its gradient written), each output written (its cotangent read)
        extra = sum(t.nbytes for t in tensors)
        dextra = sum(t.nbytes for t, d in zip(tensors, spec.tensors) if d.grad)
        moved = {
            "fwd": moved["fwd"] + extra + len(spec.outputs) * nbytes,
            "bwd": moved["bwd"] + extra + dextra + len(spec.outputs) * nbytes,
        }
    bound = {ph: b / (cbw["copy_GBps"] * 1e6) for ph, b in moved.items()}  # ms
    nt_bound = {ph: b / (cbw["stream_copy_GBps"] * 1e6) for ph, b in moved.items()}
    # 2. forward + backward of every implementation, side by side
    if progress:
        progress(f"{name} {shape} forward + backward side by side")
    step_fns = {k: f for k, f in fns.items() if k[1] in ("step", "alloc")}
    if not spec.multi:  # the spec-driven plain NumPy takes x alone
        step_fns[("plain numpy", "alloc")] = _baseline(spec, catalogue, x, params, dy, kw)
    if have_torch and catalogue:
        fwd_only, step = torch_step(name, x, params, dy, kw, threads)
        step_fns.update({("torch", "fwd"): fwd_only, ("torch", "alloc"): step})
    fused = have_torch and spec.name in FUSED_SHAPES and spec.source.startswith("zoo/")
    if fused:  # forward and fwd+bwd of every implementation in the same rounds: bwd = fwd+bwd - fwd
        for impl, compiled in (("torch", False), ("torch.compile", True)):
            fwd_only, step = fused_torch_step(spec.name, x, tensors, params, dy, cots, kw, threads, compiled)
            step_fns.update({(impl, "fwd"): fwd_only, (impl, "alloc"): step})
        step_fns.update({k: f for k, f in fns.items() if k[1] == "fwd"})
    t2 = round_robin(step_fns, repeat)
    rows = []
    for label, _ in impls:
        r = Result(
            name,
            shape,
            label,
            fwd_ms=t1[(label, "fwd")],
            bwd_ms=t1[(label, "bwd")],
            step_ms=t2[(label, "step")],
            step_alloc_ms=t2[(label, "alloc")],
            bandwidth=cbw,
        )
        for ph, ms in (("fwd", r.fwd_ms), ("bwd", r.bwd_ms)):
            r.ratios[f"{ph}_vs_bound"] = ms / bound[ph]
            r.ratios[f"{ph}_vs_stream_bound"] = ms / nt_bound[ph]
        rows.append(r)
    if ("plain numpy", "alloc") in t2:
        rows.append(Result(name, shape, "plain numpy", step_alloc_ms=t2[("plain numpy", "alloc")]))
    if ("torch.compile", "alloc") in t2:
        rows.append(
            Result(
                name,
                shape,
                "torch.compile",
                fwd_ms=t2[("torch.compile", "fwd")],
                step_alloc_ms=t2[("torch.compile", "alloc")],
            )
        )
    torch_ms = t2.get(("torch", "alloc"))
    if torch_ms is not None:
        rows.append(Result(name, shape, "torch", fwd_ms=t2[("torch", "fwd")], step_alloc_ms=torch_ms))
        # the memory floor: forward and backward's bytes at the faster of the two probes, over
        # torch's time; a target of C / torch below it asks for more than this memory gives
        rows[-1].ratios["floor_vs_torch"] = (
            min(bound["fwd"] + bound["bwd"], nt_bound["fwd"] + nt_bound["bwd"]) / torch_ms
        )
    compiled_ms = t2.get(("torch.compile", "alloc"))
    if fused:  # each phase of each implementation against eager, torch.compile and the memory floor
        floor = {ph: min(bound[ph], nt_bound[ph]) for ph in ("fwd", "bwd")}
        phase = {}
        for impl in [label for label, _ in impls] + ["torch", "torch.compile"]:
            # the backward: fwd+bwd less fwd, both medians of the same rounds (a compiled
            # function's backward cannot be run again on one retained graph)
            total = t2[(impl, "step")] if (impl, "step") in t2 else t2[(impl, "alloc")]
            phase[impl] = {"fwd": t2[(impl, "fwd")], "bwd": total - t2[(impl, "fwd")]}
        for r in rows:
            if r.impl not in phase:
                continue
            for ph in ("fwd", "bwd"):
                v = phase[r.impl][ph]
                r.ratios[f"same_round_{ph}_ms"] = v
                r.ratios[f"{ph}_vs_eager"] = v / phase["torch"][ph]
                r.ratios[f"{ph}_vs_compile"] = v / phase["torch.compile"][ph]
                r.ratios[f"{ph}_vs_floor"] = v / floor[ph]
    for r in rows:
        best = r.step_ms if r.step_ms is not None else r.step_alloc_ms
        if torch_ms:
            r.ratios["step_vs_torch"] = best / torch_ms
        if compiled_ms:
            r.ratios["step_vs_torch_compile"] = best / compiled_ms
        if ("plain numpy", "alloc") in t2:
            r.ratios["step_vs_plain_numpy"] = best / t2[("plain numpy", "alloc")]
        r.ratios["step_vs_bound"] = best / (bound["fwd"] + bound["bwd"])
        if r.fwd_ms is not None and r.impl.startswith(("torch", "generated")):
            r.ratios["fwd_vs_bound"] = r.fwd_ms / bound["fwd"]
    return rows
