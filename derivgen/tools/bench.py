"""`derivgen bench`: generated C, generated NumPy, a plain NumPy baseline,
PyTorch CPU and a STREAM-like bandwidth probe, side by side in one process.

Timings are medians of repeated runs after warm-up. By default glibc malloc is
tuned (no mmap for large blocks, no trimming) so that allocating libraries --
torch, and our own calls without preallocated outputs -- are not charged for
page-faulting fresh memory on every call; ``--default-malloc`` shows that cost.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import math
import os
import statistics
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from derivgen.api import derive, load, load_spec
from derivgen.runtime import aligned_empty, resolve_layout
from derivgen.runtime.build import build_shared, march_cflags, user_cflags
from derivgen.runtime.fsutil import atomic_write
from derivgen.runtime.machine import machine
from derivgen.spec.model import Spec
from derivgen.tools.baseline import PlainNumPy
from derivgen.tools.torch_ref import torch_available

# the catalogue layers' bench shapes; the first one of each is the one the targets judge
DEFAULT_SHAPES = {
    "layernorm": [(8192, 1024), (512, 8192), (65536, 128), (16384, 256)],
    "rmsnorm": [(8192, 1024), (512, 8192), (65536, 128)],
    "online_layernorm": [(8192, 1024)],
    "batchnorm": [(32, 64, 56, 56)],
    "instancenorm": [(32, 64, 56, 56)],
    "groupnorm": [(32, 64, 56, 56)],
}
# targets (2 threads, preallocated outputs): C fwd+bwd / torch, per (layer, shape, dtype);
# shape None is the layer's first bench shape
TORCH_TARGETS = [
    ("layernorm", (8192, 1024), "float32", 0.75),
    ("layernorm", (65536, 128), "float32", 0.9),
    ("layernorm", (16384, 256), "float32", 0.9),
    ("layernorm", (512, 8192), "float32", 0.8),
    ("groupnorm", None, "float32", 0.7),
    ("rmsnorm", None, "float32", 0.2),
    ("batchnorm", None, "float32", 0.5),
    ("instancenorm", None, "float32", 0.5),
    ("layernorm", (8192, 1024), "float64", 0.8),
]
# targets for the forward and the backward each / the streaming-store bound, per (layer, shape):
# long rows 1.2, short rows (several in flight per sweep) 1.5, channel layouts 1.3
NT_TARGETS = [
    ("layernorm", (8192, 1024), 1.2),
    ("layernorm", (512, 8192), 1.2),
    ("layernorm", (65536, 128), 1.5),
    ("layernorm", (16384, 256), 1.5),
    ("rmsnorm", None, 1.2),
    ("online_layernorm", None, 1.2),
    ("groupnorm", None, 1.3),
    ("instancenorm", None, 1.3),
    ("batchnorm", None, 1.3),
]
NUMPY_TARGET = 0.6  # generated NumPy layer norm fwd+bwd / plain NumPy (float32, first shape)
# the CPU flags a -march build needs to run here
ISA_NEEDS = {
    "x86-64-v4": ("avx512f", "avx512bw", "avx512vl"),
    "x86-64-v3": ("avx2", "fma"),
    "x86-64-v2": ("sse4_2",),
    "x86-64": (),
}


def tune_malloc() -> bool:
    """Keep large blocks on the heap and untrimmed (glibc only)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


BATCH = 3  # timed calls in a row per implementation and round


def round_robin(fns: dict[object, Callable[[], object]], repeat: int, warmup: int = 1) -> dict[object, float]:
    """Median ms of ``repeat`` timed calls of each callable, taken in rounds: in
    every round each callable runs ``warmup`` untimed calls and then up to BATCH
    timed calls in a row. Back-to-back calls keep the cores busy (an idle vCPU
    wakes up slowly), while the rounds spread every implementation over the
    same stretch of time: the shared machine's speed drifts by tens of percent
    over seconds, and only ratios of medians taken side by side are stable."""
    ts: dict = {k: [] for k in fns}
    while any(len(v) < repeat for v in ts.values()):
        for k, fn in fns.items():
            for _ in range(warmup):
                fn()
            for _ in range(min(BATCH, repeat - len(ts[k]))):
                t0 = time.perf_counter()
                fn()
                ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


# ------------------------------------------------------------------ bandwidth


class Bandwidth:
    """STREAM-like copy probe over two 256 MiB arrays (far larger than the caches)."""

    def __init__(self, threads: int, mib: int = 256) -> None:
        self.threads, self.mib = threads, mib
        self.lib = ctypes.CDLL(str(build_shared(Path(__file__).with_name("bandwidth.c"))))
        self.n = n = mib * 2**20 // 4
        self.arrays = (np.ones(n, np.float32), np.zeros(n, np.float32))
        pa, pb = (ctypes.c_void_p(v.ctypes.data) for v in self.arrays)
        N, T = ctypes.c_int64(n), ctypes.c_int(threads)
        self.copy = lambda: self.lib.dg_copy(pa, pb, N, T)
        self.stream_copy = lambda: self.lib.dg_copy_stream(pa, pb, N, T)

    def rate(self, ms: float) -> float:
        """GB/s (bytes read + bytes written) of one copy taking ``ms``."""
        return 2 * self.n * 4 / ms / 1e6

    def rates(self, ms: dict[str, float]) -> dict[str, float]:
        """GB/s (bytes read + bytes written) from the median ms of copy and stream_copy."""
        return {f"{k}_GBps": self.rate(ms[k]) for k in ("copy", "stream_copy")} | {"MiB": self.mib}


# ------------------------------------------------------------------ plain NumPy baselines


def _view(name: str, x: np.ndarray, params: list[np.ndarray], kw: dict) -> tuple:
    """(x4, params4, reduce axes, param axes, N) in the (O, G, Cg, S) view, as the runtime does."""
    spec = load_spec(name)
    meta = {"name": name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"]}
    layout = resolve_layout(meta, x, {"p": params[0]}, kw.get("num_groups"))
    return (
        x.reshape(layout.view4),
        [p.reshape(layout.param4) for p in params],
        layout.reduce_axes,
        layout.param_axes,
        layout.group_size,
    )


def plain_numpy(name: str, x: np.ndarray, params: list[np.ndarray], dy: np.ndarray, kw: dict) -> tuple:
    """A textbook NumPy forward + backward of a catalogue layer (what one writes without
    derivgen): (y, (dx, the parameters' gradients...))."""
    x4, p4, ax, pax, N = _view(name, x, params, kw)
    dy4 = dy.reshape(x4.shape)
    eps = kw.get("eps", 1e-6 if name == "rmsnorm" else (0.0 if name == "online_layernorm" else 1e-5))
    if name == "rmsnorm":
        (gamma,) = p4
        r = 1.0 / np.sqrt(np.mean(x4 * x4, axis=ax, keepdims=True) + eps)
        xhat = x4 * r
        y = gamma * xhat
        g = dy4 * gamma
        dx = r * (g - xhat * np.mean(g * xhat, axis=ax, keepdims=True))
        return y, (dx, np.sum(dy4 * xhat, axis=pax))
    gamma, beta = p4
    if name == "online_layernorm":
        a, pm, ps = kw["alpha"], kw["prev_mean"], kw["prev_std"]
        mu = a * np.mean(x4, axis=ax, keepdims=True) + (1 - a) * pm
        d = x4 - mu
        s = np.sqrt(np.sum(d * d, axis=ax, keepdims=True) / (N - 1) + eps)
        sig = a * s + (1 - a) * ps
        xhat = d / sig
        y = gamma * xhat + beta
        g = dy4 * gamma
        m_g, m_gx = np.mean(g, axis=ax, keepdims=True), np.mean(g * xhat, axis=ax, keepdims=True)
        dsig = -N * m_gx / sig
        ds = a * dsig
        dmu = -N * m_g / sig + ds * (-(np.sum(d, axis=ax, keepdims=True)) / ((N - 1) * s))
        dx = g / sig + ds * d / ((N - 1) * s) + a * dmu / N
        return y, (dx, np.sum(dy4 * xhat, axis=pax), np.sum(dy4, axis=pax))
    mu = np.mean(x4, axis=ax, keepdims=True)
    var = np.var(x4, axis=ax, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x4 - mu) * rstd
    y = gamma * xhat + beta
    g = dy4 * gamma
    dx = rstd * (g - np.mean(g, axis=ax, keepdims=True) - xhat * np.mean(g * xhat, axis=ax, keepdims=True))
    return y, (dx, np.sum(dy4 * xhat, axis=pax), np.sum(dy4, axis=pax))


# ------------------------------------------------------------------ torch


def torch_step(
    name: str, x: np.ndarray, params: list[np.ndarray], dy: np.ndarray, kw: dict, threads: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """PyTorch's own layer on the same arrays (shared, not copied), with ``threads`` threads:
    (forward without autograd, forward + backward through autograd)."""
    import torch  # optional dependency: only when it is installed
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    tx = torch.from_numpy(x).requires_grad_(True)
    tp = [torch.from_numpy(p).requires_grad_(True) for p in params]
    tdy = torch.from_numpy(dy)
    eps = kw.get("eps")

    def fwd() -> torch.Tensor:
        """y by torch's own functional layer (online layer norm: from its formula)."""
        if name == "layernorm":
            return F.layer_norm(tx, tuple(params[0].shape), tp[0], tp[1], eps or 1e-5)
        if name == "rmsnorm":
            return F.rms_norm(tx, tuple(params[0].shape), tp[0], eps or 1e-6)
        if name == "batchnorm":
            return F.batch_norm(tx, None, None, tp[0], tp[1], True, 0.1, eps or 1e-5)
        if name == "instancenorm":
            return F.instance_norm(tx, weight=tp[0], bias=tp[1], eps=eps or 1e-5)
        if name == "groupnorm":
            return F.group_norm(tx, kw["num_groups"], tp[0], tp[1], eps or 1e-5)
        if name == "online_layernorm":
            a = kw["alpha"]
            mu = a * tx.mean(-1, keepdim=True) + (1 - a) * kw["prev_mean"]
            s = torch.sqrt(((tx - mu) ** 2).sum(-1, keepdim=True) / (x.shape[-1] - 1))
            sig = a * s + (1 - a) * kw["prev_std"]
            return tp[0] * (tx - mu) / sig + tp[1]
        raise KeyError(name)

    def fwd_only() -> None:
        """The forward without autograd."""
        with torch.no_grad():
            fwd()

    def step() -> None:
        """Forward and backward through autograd."""
        tx.grad = None
        for p in tp:
            p.grad = None
        fwd().backward(tdy)

    return fwd_only, step


def fused_torch_step(
    name: str,
    x: np.ndarray,
    tensors: list[np.ndarray],
    params: list[np.ndarray],
    dy: np.ndarray,
    cots: dict,
    kw: dict,
    threads: int,
    compiled: bool,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """What a user writes instead of a fused layer, in PyTorch on the same arrays: eager, or the
    same function through ``torch.compile`` (forward without autograd, forward + backward)."""
    import torch  # optional dependency: only when it is installed
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    tx = torch.from_numpy(x).requires_grad_(True)
    tt = [torch.from_numpy(t).requires_grad_(True) for t in tensors]
    tp = [torch.from_numpy(p).requires_grad_(True) for p in params]
    tdy, tcots = torch.from_numpy(dy), [torch.from_numpy(c) for c in cots.values()]
    eps = kw.get("eps", 1e-6 if name == "add_rmsnorm" else 1e-5)
    d = x.shape[-1]

    def fn(x, t, w):
        if name == "add_rmsnorm":  # vLLM / Liger: h = x + residual, y = rms_norm(h) * w; (y, h)
            h = x + t
            return F.rms_norm(h, (d,), w, eps), h
        if name == "rmsnorm_gated":  # Mamba-2, gate after the norm
            return (F.rms_norm(x, (d,), w, eps) * F.silu(t),)
        return (F.rms_norm(x * F.silu(t), (d,), w, eps),)  # rmsnorm_gated_before

    f = torch.compile(fn) if compiled else fn

    def fwd_only() -> None:
        with torch.no_grad():
            f(tx, tt[0], tp[0])

    def step() -> None:
        for v in (tx, *tt, *tp):
            v.grad = None
        outs = f(tx, tt[0], tp[0])
        torch.autograd.backward(outs, [tdy, *tcots])

    return fwd_only, step


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


def evaluate_targets(report: dict) -> list[dict]:
    """Every target that this report's rows can judge, per C build."""
    res, dtype = report["results"], report["dtype"]
    # the project's targets: catalogue layers at their default shapes (a first shape is the
    # layer's first default one), whatever else the run timed
    first = {layer: shapes[0] for layer, shapes in DEFAULT_SHAPES.items()}
    out = []

    def row(layer: str, shape: tuple, impl: str) -> dict | None:
        """The report's row of one layer, shape and implementation, if it has one."""
        return next((q for q in res if q["layer"] == layer and tuple(q["shape"]) == shape and q["impl"] == impl), None)

    c_labels = [b["label"] for b in report["builds"] if not b["skipped"]]
    for label in c_labels:
        for layer, shape, dt, limit in TORCH_TARGETS:
            shape = first.get(layer) if shape is None else shape
            r = row(layer, shape, label) if dt == dtype else None
            if r is None or "step_vs_torch" not in r["ratios"]:
                continue
            v = r["ratios"]["step_vs_torch"]
            t = row(layer, shape, "torch")
            out.append(
                {
                    "build": label,
                    "what": f"{layer} {'x'.join(map(str, shape))} fwd+bwd / torch",
                    "value": v,
                    "limit": limit,
                    "met": v <= limit,
                    "floor": t["ratios"].get("floor_vs_torch") if t else None,
                }
            )
        for layer, shape, limit in NT_TARGETS:
            shape = first.get(layer) if shape is None else shape
            r = row(layer, shape, label) if dtype == "float32" else None
            if r is None:
                continue
            for ph, word in (("fwd", "forward"), ("bwd", "backward")):
                v = r["ratios"][f"{ph}_vs_stream_bound"]
                out.append(
                    {
                        "build": label,
                        "what": f"{layer} {'x'.join(map(str, shape))} {word} / streaming-store bound",
                        "value": v,
                        "limit": limit,
                        "met": v <= limit,
                    }
                )
    shape = first.get("layernorm")
    r = row("layernorm", shape, "generated numpy") if shape and dtype == "float32" else None
    if r is not None:
        v = r["ratios"]["step_vs_plain_numpy"]
        out.append(
            {
                "build": "generated numpy",
                "what": f"layernorm {'x'.join(map(str, shape))} fwd+bwd / plain numpy",
                "value": v,
                "limit": NUMPY_TARGET,
                "met": v <= NUMPY_TARGET,
            }
        )
    return out


def header_lines(report: dict) -> list[str]:
    """The report's preamble: the machine, each C build, the bandwidth probe, what 'bound' means."""
    m = report["machine"]
    caches = (
        ", ".join(f"{k} {v >> 20} MiB" if v >= 1 << 20 else f"{k} {v >> 10} KiB" for k, v in m["caches"].items())
        or "caches unknown"
    )
    lines = [f"machine: {m['cpu']}; {m['cores']} core(s); {caches}; CPU flags: {' '.join(m['flags']) or '-'}"]
    for b in report["builds"]:
        what = f"skipped ({b['skipped']})" if b["skipped"] else f"targets {b['isa'] or '?'}"
        lines.append(f"{b['label']}: CFLAGS {' '.join(b['cflags'])}; {what}")
    bw = report["bandwidth"]
    if bw.get("cases"):
        lo, hi = bw["copy_GBps_range"]
        lines.append(
            f"bandwidth probe ({bw['MiB']} MiB arrays, {report['threads']} thread(s), beside each case): "
            f"copy {bw['copy_GBps']:.1f} GB/s median ({lo:.1f}-{hi:.1f}), streaming-store copy "
            f"{bw['stream_copy_GBps']:.1f} GB/s; dtype {report['dtype']}; "
            f"malloc {'tuned' if report['tuned_malloc'] else 'default'}"
        )
    lines.append(
        "bound = bytes moved (fwd: x, y; bwd: x, dy, dx) / copy bandwidth probed beside each case; "
        "'nt' = the same with the streaming-store copy; every array 64-byte aligned (as torch allocates "
        "and derivgen allocates outputs), shared by all implementations"
    )
    return lines


def format_report(report: dict) -> str:
    """The report as text that fits 100 columns: the preamble, the timings, the ratios to the
    bandwidth bounds, and the targets."""
    lines = [_wrap(line) for line in header_lines(report)] + [""]

    def f(v: float | None, fmt: str = "{:.2f}") -> str:
        """A cell: the value formatted, or '-'."""
        return "-" if v is None else fmt.format(v)

    def key(r: dict) -> tuple:
        return (r["layer"], "x".join(map(str, r["shape"])), r["impl"])

    res = report["results"]
    times = [
        ("layer", "shape", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "alloc ms", "x torch"),
        *(
            (
                *key(r),
                f(r["fwd_ms"]),
                f(r["bwd_ms"]),
                f(r["step_ms"]),
                f(r["step_alloc_ms"]),
                f(r["ratios"].get("step_vs_torch")),
            )
            for r in res
        ),
    ]
    bounds = [
        ("layer", "shape", "impl", "x bound", "fwd x bnd", "bwd x bnd", "fwd x nt", "bwd x nt"),
        *(
            (
                *key(r),
                *(
                    f(r["ratios"].get(k))
                    for k in (
                        "step_vs_bound",
                        "fwd_vs_bound",
                        "bwd_vs_bound",
                        "fwd_vs_stream_bound",
                        "bwd_vs_stream_bound",
                    )
                ),
            )
            for r in res
        ),
    ]
    fused = [r for r in res if "fwd_vs_eager" in r["ratios"]]
    tables = [times, bounds]
    if fused:  # the fused layers: each phase timed in the same rounds as PyTorch's
        tables.append(
            [
                ("layer", "shape", "impl", "fwd ms", "bwd ms", "fwd x eager", "bwd x eager", "fwd x compile")
                + ("bwd x compile", "fwd x floor", "bwd x floor"),
                *(
                    (
                        *key(r),
                        *(
                            f(r["ratios"].get(k))
                            for k in (
                                "same_round_fwd_ms",
                                "same_round_bwd_ms",
                                "fwd_vs_eager",
                                "bwd_vs_eager",
                                "fwd_vs_compile",
                                "bwd_vs_compile",
                                "fwd_vs_floor",
                                "bwd_vs_floor",
                            )
                        ),
                    )
                    for r in fused
                ),
            ]
        )
    for table in tables:
        widths = [max(len(str(x[i])) for x in table) for i in range(len(table[0]))]
        lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        lines.append("")
    lines += [_wrap(line) for line in target_lines(report)]
    return "\n".join(lines)


def _wrap(line: str) -> str:
    """A line of prose folded to 100 columns (continuations indented)."""
    return textwrap.fill(line, 100, subsequent_indent="    ", break_on_hyphens=False) if len(line) > 100 else line


def missed_below_floor(met: bool, limit: float | None, floor: float | None) -> bool:
    """Whether a target (``limit``) was missed asking for less time than this machine's
    memory floor (both as fractions of torch's time)."""
    return not met and limit is not None and floor is not None and limit < floor


def _below_floor(target: dict) -> bool:
    """:func:`missed_below_floor` of one of :func:`evaluate_targets`' targets."""
    return missed_below_floor(target["met"], target["limit"], target.get("floor"))


def target_lines(report: dict) -> list[str]:
    """The project's targets this report can judge, each met or MISSED, and how many were met."""
    targets = report.get("targets") or evaluate_targets(report)
    if not targets:
        return ["targets: none of this run's cases has one"]
    out = [
        f"targets ({report['dtype']}, {report['threads']} thread(s), preallocated outputs; the targets are set for float32, 2 threads):"
    ]
    # a table under each build's name, so that a line fits 100 columns unfolded
    width = max(len(t["what"]) for t in targets)
    build = None
    for t in targets:
        if t["build"] != build:
            build = t["build"]
            out.append(f"  {build}:")
        out.append(f"    {t['what']:<{width}}  {t['value']:.2f} (<= {t['limit']})  {'met' if t['met'] else 'MISSED'}")
        if _below_floor(t):
            out.append(f"      below this machine's memory floor, {t['floor']:.2f} of torch")
    met = sum(t["met"] for t in targets)
    unreachable = sum(map(_below_floor, targets))
    out.append(
        f"  {met} of {len(targets)} met"
        + (
            f"; {unreachable} missed below the memory floor (bytes moved / the faster copy probe)"
            if unreachable
            else ""
        )
    )
    return out


def plot(report: dict, path: str) -> None:
    """A bar chart (PNG, log scale) of every implementation's forward + backward per case;
    RuntimeError without matplotlib."""
    try:  # imported here: matplotlib is an optional dependency (derivgen[plot])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    res = report["results"]
    cases = []
    for r in res:
        k = f"{r['layer']}\n{'x'.join(map(str, r['shape']))}"
        if k not in cases:
            cases.append(k)
    impls = list(dict.fromkeys(r["impl"] for r in res))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 4.5))
    w = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        vals = []
        for k in cases:
            r = next(
                (q for q in res if f"{q['layer']}\n{'x'.join(map(str, q['shape']))}" == k and q["impl"] == impl), None
            )
            vals.append((r["step_ms"] or r["step_alloc_ms"]) if r else math.nan)
        ax.bar([j + (i - (len(impls) - 1) / 2) * w for j in range(len(cases))], vals, w, label=impl)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, fontsize=8)
    ax.set_ylabel("forward + backward, ms (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"derivgen bench ({report['dtype']}, {report['threads']} threads)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    atomic_write(path, buf.getvalue())


# ------------------------------------------------------------------ JAX


def run_jax_bench(repeat: int = 15, dtype: str = "float32", progress: Callable[[str], None] | None = None) -> dict:
    """``bench --jax``: derivgen.jax's jitted forward + backward against Flax's layers
    (derivgen.jax.bench; JAX and Flax are optional dependencies, imported only here)."""
    from derivgen.jax.bench import run_jax_bench as run

    return run(repeat, dtype, progress)


def format_jax_report(report: dict) -> str:
    """``bench --jax``'s report as text."""
    from derivgen.jax.bench import format_jax_report as fmt

    return fmt(report)
