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
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .api import load, load_spec
from .build import build_shared

DEFAULT_SHAPES = {
    "layernorm": [(8192, 1024), (512, 8192), (65536, 128)],
    "rmsnorm": [(8192, 1024), (512, 8192), (65536, 128)],
    "online_layernorm": [(8192, 1024)],
    "batchnorm": [(32, 64, 56, 56)],
    "instancenorm": [(32, 64, 56, 56)],
    "groupnorm": [(32, 64, 56, 56)],
}
# issue targets (float32, 2 threads, preallocated outputs): ours/torch for fwd+bwd
TORCH_TARGETS = {"layernorm": 0.8, "rmsnorm": 0.25, "batchnorm": 0.6, "groupnorm": 0.8, "instancenorm": 0.8}
BOUND_TARGET = 1.25          # layernorm forward and backward each vs the bandwidth bound
NUMPY_TARGET = 0.6           # generated NumPy layernorm fwd+bwd vs the plain NumPy baseline


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


BATCH = 3   # timed calls in a row per implementation and round


def round_robin(fns: dict, repeat: int, warmup: int = 1) -> dict:
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

    def __init__(self, threads: int, mib: int = 256):
        self.threads, self.mib = threads, mib
        self.lib = ctypes.CDLL(str(build_shared(Path(__file__).with_name("bandwidth.c"))))
        self.n = n = mib * 2**20 // 4
        self.arrays = (np.ones(n, np.float32), np.zeros(n, np.float32))
        pa, pb = (ctypes.c_void_p(v.ctypes.data) for v in self.arrays)
        N, T = ctypes.c_int64(n), ctypes.c_int(threads)
        self.copy = lambda: self.lib.dg_copy(pa, pb, N, T)
        self.stream_copy = lambda: self.lib.dg_copy_stream(pa, pb, N, T)

    def rates(self, ms: dict) -> dict:
        """GB/s (bytes read + bytes written) from the median ms of copy and stream_copy."""
        return {f"{k}_GBps": 2 * self.n * 4 / ms[k] / 1e6 for k in ("copy", "stream_copy")} | {"MiB": self.mib}


# ------------------------------------------------------------------ plain NumPy baselines

def _view(name, x, params, kw):
    """(x4, params4, reduce axes, param axes, N) in the (O, G, Cg, S) view, as the runtime does."""
    from .runtime import resolve_layout
    spec = load_spec(name)
    meta = {"name": name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"]}
    L = resolve_layout(meta, x, {"p": params[0]}, kw.get("num_groups"))
    return (x.reshape(L.view4), [p.reshape(L.param4) for p in params], L.reduce_axes, L.param_axes, L.group_size)


def plain_numpy(name, x, params, dy, kw):
    """A textbook NumPy forward + backward (what one writes without derivgen)."""
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

def torch_step(name, x, params, dy, kw, threads):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    tx = torch.from_numpy(x).requires_grad_(True)
    tp = [torch.from_numpy(p).requires_grad_(True) for p in params]
    tdy = torch.from_numpy(dy)
    eps = kw.get("eps")

    def fwd():
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

    def fwd_only():
        with torch.no_grad():
            fwd()

    def step():
        tx.grad = None
        for p in tp:
            p.grad = None
        fwd().backward(tdy)
    return fwd_only, step


# ------------------------------------------------------------------ the bench

@dataclass
class Result:
    layer: str
    shape: tuple
    impl: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    step_ms: float | None = None          # forward + backward, preallocated outputs
    step_alloc_ms: float | None = None    # forward + backward, allocating outputs
    ratios: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)   # the probe taken beside this case (C and NumPy rows)


def _kwargs(name, x):
    kw: dict = {}
    if name == "groupnorm":
        kw["num_groups"] = 8
    if name == "online_layernorm":
        kw.update(alpha=0.1, prev_mean=0.0, prev_std=1.0)
    return kw


def run_bench(names, shapes=None, threads=None, dtype="float32", repeat=15, progress=None,
              tuned_malloc=True) -> dict:
    threads = threads or os.cpu_count() or 1
    tuned = tune_malloc() if tuned_malloc else False
    from .torch_ref import torch_available
    have_torch = torch_available()
    dt = np.dtype(dtype)
    probe = Bandwidth(threads)
    results: list[Result] = []
    for name in names:
        for shape in (shapes or DEFAULT_SHAPES.get(name) or [(8192, 1024)]):
            shape = tuple(shape)
            rng = np.random.default_rng(0)
            x = rng.standard_normal(shape, dtype=np.float32).astype(dt)
            dy = rng.standard_normal(shape, dtype=np.float32).astype(dt)
            spec = load_spec(name)
            pshape = (shape[-1],) if spec.layout == "trailing" else (shape[1],)
            params = [np.ones(pshape, dt) + 0.1 * rng.standard_normal(pshape).astype(dt) for _ in spec.params]
            kw = _kwargs(name, x)
            nbytes = x.nbytes
            setup = {}
            for backend in ("c", "numpy"):
                mod = load(name, backend=backend)
                mod.set_num_threads(threads)
                y = np.empty_like(x)
                _, cache = mod.forward(x, *params, out=y, **kw)
                setup[backend] = (mod, y, cache, mod.backward(dy, cache))

            def calls(backend):
                mod, y, cache, grads = setup[backend]
                return {f"{backend}_fwd": lambda: mod.forward(x, *params, out=y, **kw),
                        f"{backend}_bwd": lambda: mod.backward(dy, cache, out=grads),
                        f"{backend}_step": lambda: mod.backward(dy, mod.forward(x, *params, out=y, **kw)[1],
                                                                out=grads),
                        f"{backend}_alloc": lambda: mod.backward(dy, mod.forward(x, *params, **kw)[1])}
            fns = {**calls("c"), **calls("numpy")}
            # 1. each kernel beside the bandwidth probe, in turn within every round
            if progress:
                progress(f"{name} {shape} kernels beside the bandwidth probe")
            t1 = round_robin({"copy": probe.copy, "stream_copy": probe.stream_copy,
                              **{k: f for k, f in fns.items() if k.endswith(("_fwd", "_bwd"))}}, repeat)
            cbw = probe.rates(t1)
            moved = {"fwd": 2 * nbytes, "bwd": 3 * nbytes}        # fwd: x, y; bwd: x, dy, dx
            bound = {ph: b / (cbw["copy_GBps"] * 1e6) for ph, b in moved.items()}          # ms
            nt_bound = {ph: b / (cbw["stream_copy_GBps"] * 1e6) for ph, b in moved.items()}
            # 2. forward + backward of every implementation, side by side
            if progress:
                progress(f"{name} {shape} forward + backward side by side")
            step_fns = {k: f for k, f in fns.items() if k.endswith(("_step", "_alloc"))}
            step_fns["plain"] = lambda: plain_numpy(name, x, params, dy, kw)
            if have_torch:
                fwd_only, step = torch_step(name, x, params, dy, kw, threads)
                step_fns.update(torch_fwd=fwd_only, torch_step=step)
            t2 = round_robin(step_fns, repeat)
            row_results = []
            for backend in ("c", "numpy"):
                r = Result(name, shape, f"generated {backend}", fwd_ms=t1[f"{backend}_fwd"],
                           bwd_ms=t1[f"{backend}_bwd"], step_ms=t2[f"{backend}_step"],
                           step_alloc_ms=t2[f"{backend}_alloc"], bandwidth=cbw)
                for ph, ms in (("fwd", r.fwd_ms), ("bwd", r.bwd_ms)):
                    r.ratios[f"{ph}_vs_bound"] = ms / bound[ph]
                    r.ratios[f"{ph}_vs_stream_bound"] = ms / nt_bound[ph]
                row_results.append(r)
            row_results.append(Result(name, shape, "plain numpy", step_alloc_ms=t2["plain"]))
            torch_ms = None
            if have_torch:
                torch_ms = t2["torch_step"]
                row_results.append(Result(name, shape, "torch", fwd_ms=t2["torch_fwd"], step_alloc_ms=torch_ms))
            for r in row_results:
                best = r.step_ms if r.step_ms is not None else r.step_alloc_ms
                if torch_ms:
                    r.ratios["step_vs_torch"] = best / torch_ms
                r.ratios["step_vs_plain_numpy"] = best / t2["plain"]
                r.ratios["step_vs_bound"] = best / (bound["fwd"] + bound["bwd"])
            results += row_results
    probes = [r.bandwidth for r in results if r.impl == "generated c"]     # one probe per case
    bw = {k: statistics.median(p[k] for p in probes) for k in ("copy_GBps", "stream_copy_GBps")} if probes else {}
    bw.update(MiB=probe.mib, cases=len(probes),
              copy_GBps_range=[min(p["copy_GBps"] for p in probes), max(p["copy_GBps"] for p in probes)]
              if probes else [])
    return {"bandwidth": bw, "threads": threads, "dtype": dtype, "tuned_malloc": tuned, "torch": have_torch,
            "results": [asdict(r) for r in results]}


def format_report(report: dict) -> str:
    bw = report["bandwidth"]
    lo, hi = bw["copy_GBps_range"]
    lines = [f"bandwidth probe ({bw['MiB']} MiB arrays, {report['threads']} thread(s), beside each case): copy "
             f"{bw['copy_GBps']:.1f} GB/s median ({lo:.1f}-{hi:.1f}), streaming-store copy "
             f"{bw['stream_copy_GBps']:.1f} GB/s; dtype {report['dtype']}; "
             f"malloc {'tuned' if report['tuned_malloc'] else 'default'}",
             "bound = bytes moved (fwd: x, y; bwd: x, dy, dx) / copy bandwidth probed beside each case; "
             "'nt' = the same with the streaming-store copy", ""]
    head = ("layer", "shape", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "alloc ms", "x torch", "x bound", "fwd x bnd",
            "bwd x bnd", "fwd x nt", "bwd x nt")
    rows = []

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)
    for r in report["results"]:
        ra = r["ratios"]
        rows.append((r["layer"], "x".join(map(str, r["shape"])), r["impl"], f(r["fwd_ms"]), f(r["bwd_ms"]),
                     f(r["step_ms"]), f(r["step_alloc_ms"]), f(ra.get("step_vs_torch")), f(ra.get("step_vs_bound")),
                     f(ra.get("fwd_vs_bound")), f(ra.get("bwd_vs_bound")), f(ra.get("fwd_vs_stream_bound")),
                     f(ra.get("bwd_vs_stream_bound"))))
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    lines += target_lines(report)
    return "\n".join(lines)


def target_lines(report: dict) -> list[str]:
    out = ["targets (first shape of each layer; preallocated outputs):"]
    seen = set()
    for r in report["results"]:
        key = (r["layer"], tuple(r["shape"]))
        if r["layer"] in seen or r["impl"] != "generated c":
            continue
        seen.add(r["layer"])
        ra = r["ratios"]
        if r["layer"] in TORCH_TARGETS and "step_vs_torch" in ra:
            t = TORCH_TARGETS[r["layer"]]
            out.append(f"  {r['layer']} {'x'.join(map(str, key[1]))}: C fwd+bwd / torch = {ra['step_vs_torch']:.2f} "
                       f"(target <= {t}) {'met' if ra['step_vs_torch'] <= t else 'MISSED'}")
        if r["layer"] == "layernorm":
            for ph in ("fwd", "bwd"):
                v = ra[f"{ph}_vs_bound"]
                out.append(f"  layernorm {ph} / bandwidth bound = {v:.2f} (target <= {BOUND_TARGET}) "
                           f"{'met' if v <= BOUND_TARGET else 'MISSED'}; "
                           f"/ streaming-store bound = {ra[f'{ph}_vs_stream_bound']:.2f}")
            npy = next((q for q in report["results"] if q["layer"] == "layernorm" and tuple(q["shape"]) == key[1]
                        and q["impl"] == "generated numpy"), None)
            if npy:
                v = npy["ratios"]["step_vs_plain_numpy"]
                out.append(f"  layernorm generated NumPy / plain NumPy = {v:.2f} (target <= {NUMPY_TARGET}) "
                           f"{'met' if v <= NUMPY_TARGET else 'MISSED'}")
    return out


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'derivgen[plot]'") from None
    res = report["results"]
    cases = []
    for r in res:
        k = f"{r['layer']}\n{'x'.join(map(str, r['shape']))}"
        if k not in cases:
            cases.append(k)
    impls = ["generated c", "generated numpy", "plain numpy", "torch"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 4.5))
    w = 0.2
    for i, impl in enumerate(impls):
        vals = []
        for k in cases:
            r = next((q for q in res if f"{q['layer']}\n{'x'.join(map(str, q['shape']))}" == k and q["impl"] == impl), None)
            vals.append((r["step_ms"] or r["step_alloc_ms"]) if r else math.nan)
        ax.bar([j + (i - 1.5) * w for j in range(len(cases))], vals, w, label=impl)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, fontsize=8)
    ax.set_ylabel("forward + backward, ms (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"derivgen bench ({report['dtype']}, {report['threads']} threads)")
    fig.tight_layout()
    from .fsutil import atomic_write
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    atomic_write(path, buf.getvalue())
