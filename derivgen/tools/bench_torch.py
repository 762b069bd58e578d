"""``derivgen bench --torch``: derivgen's modules against their torch.nn namesakes,
through autograd (forward, then backward of the output), side by side in one process.

Every case times the two modules round-robin (see derivgen.tools.timing.round_robin) on
the same input tensor, so the ratio compares them over the same stretch of the
machine's time. A transformer block's whole training step is timed too, once
with torch.nn norms and once converted, with the share of the step the norms take.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Collection

import torch
from torch import nn

from derivgen.runtime.machine import machine
from derivgen.tools.bench_targets import missed_below_floor
from derivgen.tools.timing import Bandwidth, round_robin
from derivgen.torch import nn as dnn
from derivgen.torch.fused import FusedAddRMSNorm, RMSNormGated

# (label, torch.nn module factory, input shape, memory format, target derivgen/torch or None,
#  sweeps: the fewest times forward + backward together move an x-sized tensor through
#  memory, whoever implements them; None where x fits in the caches)
# 5: the forward reads x and writes y, the backward reads x and dy and writes dx, where a
# group's values (a row, a channel of one sample or of the batch: at most 400 KB here)
# stay in the cache between a kernel's sweeps over them. Channels-last batch norm: 8. A
# channel's values span the whole 25.7 MB tensor, so the statistics need all of x read
# before any y is written (the forward reads x twice with one-pass statistics, three
# times with derivgen's two-pass ones), and the backward's two sums need all of x and dy
# read before any dx is (x and dy twice, dx once).
CASES = [
    ("LayerNorm", lambda: nn.LayerNorm(1024), (8192, 1024), None, 0.85, 5),
    ("BatchNorm2d", lambda: nn.BatchNorm2d(64), (32, 64, 56, 56), None, 0.6, 5),
    ("RMSNorm", lambda: nn.RMSNorm(1024), (8192, 1024), None, 0.3, 5),
    ("GroupNorm", lambda: nn.GroupNorm(32, 64), (32, 64, 56, 56), None, 0.8, 5),
    ("InstanceNorm2d", lambda: nn.InstanceNorm2d(64, affine=True), (32, 64, 56, 56), None, None, 5),
    ("BatchNorm2d channels_last", lambda: nn.BatchNorm2d(64), (32, 64, 56, 56), torch.channels_last, 0.6, 8),
    ("LayerNorm per call", lambda: nn.LayerNorm(1024), (8, 1024), None, 1.2, None),
]


def _inner(x) -> int:
    """Calls per timed sample: small inputs take tens of microseconds per call, too
    short for one perf_counter reading each, so a sample is a loop of calls."""
    return max(1, min(200, 2**16 // max(1, x.numel() // 16)))


def _step(m, x, dy):
    params = list(m.parameters())
    k = _inner(x)

    def call():
        for _ in range(k):
            x.grad = None
            for p in params:
                p.grad = None
            m(x).backward(dy)

    return call


def _fwd(m, x):
    k = _inner(x)

    def call():
        with torch.no_grad():
            for _ in range(k):
                m(x)

    return call


class Block(nn.Module):
    """A pre-norm transformer block (LayerNorm, attention, RMSNorm, MLP)."""

    def __init__(self, d: int = 512, heads: int = 8) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.RMSNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + attention(LayerNorm(x)), then + MLP(RMSNorm(.))."""
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def run_torch_bench(
    threads: int | None = None,
    repeat: int = 15,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
    cases: Collection[str] | None = None,
) -> dict:
    """The table of CASES (or those whose labels are in ``cases``) and the transformer
    block (unless ``cases`` leaves it out: include "block")."""
    threads = threads or machine().cores
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(threads, repeat, dtype, progress, cases)
    finally:
        torch.set_num_threads(before)


def _run(
    threads: int, repeat: int, dtype: str, progress: Callable[[str], None] | None, cases: Collection[str] | None
) -> dict:
    """The report: the cases' rows, then the second order and the transformer block where
    ``cases`` asks for them (one random generator, drawn from in that order)."""
    tdt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    bw = None  # the copy probes, made for the first case with a memory floor
    for label, make, shape, fmt, target, sweeps in CASES:
        if cases is not None and label not in cases:
            continue
        if sweeps is not None and bw is None:
            bw = Bandwidth(threads)
        rows.append(_case_row(label, make, shape, fmt, target, tdt, gen, repeat, sweeps, bw))
        if progress:
            progress(label)
    m = machine()
    rep = {
        "machine": {
            "cpu": m.cpu,
            "cores": m.cores,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "dtype": dtype,
        "repeat": repeat,
        "threads": threads,
        "cases": rows,
        "block": None,
    }
    if cases is None or "fused" in cases:
        if bw is None:
            bw = Bandwidth(threads)
        rep["fused"] = _fused_rows(tdt, gen, repeat, bw)
        if progress:
            progress("fused layers")
    if cases is None or "second" in cases:
        rep["second"] = _second_rows(tdt, gen, repeat)
        if progress:
            progress("second order")
    if cases is not None and "block" not in cases:
        return rep
    rep["block"] = _block_row(tdt, gen, repeat)
    if progress:
        progress("transformer block")
    return rep


def _case_row(
    label: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    fmt: torch.memory_format | None,
    target: float | None,
    tdt: torch.dtype,
    gen: torch.Generator,
    repeat: int,
    sweeps: int | None = None,
    bw: Bandwidth | None = None,
) -> dict:
    """One case's row: torch.nn and its derivgen twin, a training step (forward and
    backward) and a forward each, in ms per call; an ``error`` where derivgen refuses it.
    With ``sweeps`` and the copy probes ``bw``, timed beside the modules, the memory floor
    too: ``sweeps`` x-sized tensors at the faster probe, over torch.nn's step."""
    ref = make().to(tdt)
    ours = dnn.convert(copy.deepcopy(ref))
    x = torch.randn(shape, generator=gen, dtype=tdt)
    if fmt is not None:
        x = x.contiguous(memory_format=fmt)
    x.requires_grad_(True)
    dy = torch.randn(shape, generator=gen, dtype=tdt)
    if fmt is not None:
        dy = dy.contiguous(memory_format=fmt)
    row = {
        "case": label,
        "shape": list(shape),
        "target": target,
        "memory_format": "channels_last" if fmt is not None else "contiguous",
    }
    try:
        ours(x).backward(dy)
    except (TypeError, ValueError, NotImplementedError) as e:
        row["error"] = str(e).splitlines()[0]
        return row
    fns = {
        "torch_step": _step(ref, x, dy),
        "derivgen_step": _step(ours, x, dy),
        "torch_fwd": _fwd(ref, x),
        "derivgen_fwd": _fwd(ours, x),
    }
    probed = sweeps is not None and bw is not None
    if probed:
        fns.update(copy=bw.copy, stream_copy=bw.stream_copy)
    ms = round_robin(fns, repeat)
    row.update({k: ms[k] / _inner(x) for k in ("torch_step", "derivgen_step", "torch_fwd", "derivgen_fwd")})
    row["ratio"] = row["derivgen_step"] / row["torch_step"]
    row["fwd_ratio"] = row["derivgen_fwd"] / row["torch_fwd"]
    if probed:
        rates = bw.rates(ms)
        best = max(rates["copy_GBps"], rates["stream_copy_GBps"])
        row["bandwidth"] = rates
        row["sweeps"] = sweeps
        row["floor_ms"] = sweeps * x.numel() * x.element_size() / (best * 1e6)
        row["floor"] = row["floor_ms"] / row["torch_step"]
    return row


def below_floor(row: dict) -> bool:
    """Whether a case missed its target asking for less time than this machine's memory floor."""
    t = row.get("target")
    return missed_below_floor(t is not None and row["ratio"] <= t, t, row.get("floor"))


def _block_row(tdt: torch.dtype, gen: torch.Generator, repeat: int) -> dict:
    """A transformer block's training step (SGD), torch.nn against derivgen, and the
    share of it the two norms take."""
    torch.manual_seed(0)
    ref = Block().to(tdt)
    ours = dnn.convert(copy.deepcopy(ref))
    x = torch.randn(16, 128, 512, generator=gen, dtype=tdt)
    norms_x = torch.randn(16, 128, 512, generator=gen, dtype=tdt, requires_grad=True)
    dy = torch.randn(16, 128, 512, generator=gen, dtype=tdt)

    def train_step(m):
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def call():
            opt.zero_grad()
            m(x).backward(dy)
            opt.step()

        return call

    def norms_only(m):
        mods = [m.ln1, m.ln2]

        def call():
            norms_x.grad = None
            for mod in mods:
                for p in mod.parameters():
                    p.grad = None
                mod(norms_x).backward(dy)

        return call

    ms = round_robin(
        {
            "torch_step": train_step(ref),
            "derivgen_step": train_step(ours),
            "torch_norms": norms_only(ref),
            "derivgen_norms": norms_only(ours),
        },
        repeat,
    )
    return dict(
        ms,
        shape=[16, 128, 512],
        ratio=ms["derivgen_step"] / ms["torch_step"],
        torch_norm_share=ms["torch_norms"] / ms["torch_step"],
        derivgen_norm_share=ms["derivgen_norms"] / ms["derivgen_step"],
    )


# the fused layers (tensor inputs beside x, outputs beside y): (label, module factory, the
# same function in PyTorch as a user writes it, its inputs beside x, shape, sweeps). Sweeps:
# add+RMSNorm's forward reads x and residual and writes y and h, its backward reads dy, dh
# and x (or h) and writes dx (dresidual is the same values): 8; the gated RMSNorm's forward
# reads x and z and writes y, its backward reads dy, x and z and writes dx and dz: 8.
def _add_rmsnorm(x, residual, w, eps=1e-6):
    h = x + residual
    return torch.nn.functional.rms_norm(h, (x.shape[-1],), w, eps), h


def _rmsnorm_gated_before(x, z, w, eps=1e-5):
    return torch.nn.functional.rms_norm(x * torch.nn.functional.silu(z), (x.shape[-1],), w, eps)


FUSED = [
    ("FusedAddRMSNorm", lambda d: FusedAddRMSNorm(d, eps=1e-6), _add_rmsnorm, (8192, 4096), 8),
    ("FusedAddRMSNorm", lambda d: FusedAddRMSNorm(d, eps=1e-6), _add_rmsnorm, (32, 4096), None),
    (
        "RMSNormGated (gate before)",
        lambda d: RMSNormGated(d, eps=1e-5, norm_before_gate=False),
        _rmsnorm_gated_before,
        (8192, 4096),
        8,
    ),
]


def _fused_rows(tdt: torch.dtype, gen: torch.Generator, repeat: int, bw: Bandwidth) -> list[dict]:
    """Each fused layer's forward and forward + backward: derivgen.torch's module, the same
    function in eager PyTorch and through ``torch.compile``, and the memory floor, side by
    side (the backward is fwd+bwd less fwd, each timed in the same rounds)."""
    return [_fused_row(*case, tdt, gen, repeat, bw) for case in FUSED]


def _fused_row(
    label: str,
    make: Callable[[int], nn.Module],
    fn: Callable,
    shape: tuple[int, ...],
    sweeps: int | None,
    tdt: torch.dtype,
    gen: torch.Generator,
    repeat: int,
    bw: Bandwidth,
) -> dict:
    """One fused layer's row (:func:`_fused_rows`)."""
    ours = make(shape[-1]).to(tdt)
    x = torch.randn(shape, generator=gen, dtype=tdt, requires_grad=True)
    t = torch.randn(shape, generator=gen, dtype=tdt, requires_grad=True)
    w = torch.ones(shape[-1], dtype=tdt, requires_grad=True)
    cots = [torch.randn(shape, generator=gen, dtype=tdt) for _ in range(2)]
    compiled = torch.compile(fn)
    k = _inner(x)

    def step(f):
        def call():
            for _ in range(k):
                x.grad = t.grad = w.grad = None
                out = f(x, t)
                out = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(out, cots[: len(out)])

        return call

    def fwd(f):
        def call():
            with torch.no_grad():
                for _ in range(k):
                    f(x, t)

        return call

    impls = {
        "derivgen": lambda a, b: ours(a, b),
        "eager": lambda a, b: fn(a, b, w),
        "compile": lambda a, b: compiled(a, b, w),
    }
    fns = {}
    for name, f in impls.items():
        step(f)()  # compiled and warmed up outside the timing
        fns[name + "_step"], fns[name + "_fwd"] = step(f), fwd(f)
    fns.update(copy=bw.copy, stream_copy=bw.stream_copy)
    ms = round_robin(fns, repeat)
    row = {"case": label, "shape": list(shape)}
    for name in impls:
        row[name + "_fwd"] = ms[name + "_fwd"] / k
        row[name + "_step"] = ms[name + "_step"] / k
        row[name + "_bwd"] = row[name + "_step"] - row[name + "_fwd"]  # a compiled backward runs once per graph
    for ph in ("fwd", "bwd"):
        row[ph + "_vs_eager"] = row["derivgen_" + ph] / row["eager_" + ph]
        row[ph + "_vs_compile"] = row["derivgen_" + ph] / row["compile_" + ph]
    if sweeps is not None:
        rates = bw.rates(ms)
        best = max(rates["copy_GBps"], rates["stream_copy_GBps"])
        nbytes = x.numel() * x.element_size()
        row["bandwidth"] = rates
        row["floor_fwd_ms"] = 4 * nbytes / (best * 1e6)
        row["floor_bwd_ms"] = (sweeps - 4) * nbytes / (best * 1e6)
        row["fwd_vs_floor"] = row["derivgen_fwd"] / row["floor_fwd_ms"]
        row["bwd_vs_floor"] = row["derivgen_bwd"] / row["floor_bwd_ms"]
    return row


def _fused_lines(rows: list[dict]) -> list[str]:
    """The fused layers' table (:func:`_fused_rows`)."""
    out = [
        "",
        "fused layers, derivgen.torch's module (eager: the same function in PyTorch; compile: it through",
        "torch.compile; bwd = fwd+bwd - fwd, medians of the same rounds; floor: the",
        "bytes they must move; each ratio is fwd, then bwd):",
        f"{'case':26s} {'shape':>10s} {'fwd':>9s} {'bwd':>9s} {'/eager':>11s} {'/compile':>11s} {'/floor':>11s}",
    ]
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        floor = f"{r['fwd_vs_floor']:5.2f} {r['bwd_vs_floor']:5.2f}" if "fwd_vs_floor" in r else "-"
        out.append(
            f"{r['case']:26s} {shape:>10s} {_t(r['derivgen_fwd']):>9s} {_t(r['derivgen_bwd']):>9s} "
            f"{r['fwd_vs_eager']:5.2f} {r['bwd_vs_eager']:5.2f} {r['fwd_vs_compile']:5.2f} {r['bwd_vs_compile']:5.2f} "
            f"{floor:>11s}"
        )
    return out


SECOND_SHAPE = (8192, 1024)


def _second_rows(tdt, gen, repeat, shape=SECOND_SHAPE) -> list[dict]:
    """Layer norm's second order, each side's whole computation: the double backward
    (forward, backward with create_graph=True, and the gradient of a loss on the
    gradients: torch.nn runs PyTorch's hand-written layer_norm_double_backward,
    derivgen its derived kernel) and the JVP (torch.func.jvp of the module)."""
    ref = nn.LayerNorm(shape[-1]).to(tdt)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.2, generator=gen)
        ref.bias.normal_(0.0, 0.2, generator=gen)
    ours = dnn.convert(copy.deepcopy(ref))
    x = torch.randn(shape, generator=gen, dtype=tdt, requires_grad=True)
    dy, v, t = (torch.randn(shape, generator=gen, dtype=tdt) for _ in range(3))

    def double_backward(m):
        wrt = [x, *m.parameters()]

        def call():
            g = torch.autograd.grad(m(x), wrt, dy, create_graph=True)
            loss = (g[0] * v).sum() + (g[1] * g[1]).sum()
            torch.autograd.grad(loss, wrt, allow_unused=True)

        return call

    def jvp(m):
        xd = x.detach()

        def call():
            torch.func.jvp(m, (xd,), (t,))

        return call

    ms = round_robin(
        {
            "torch_bb": double_backward(ref),
            "derivgen_bb": double_backward(ours),
            "torch_jvp": jvp(ref),
            "derivgen_jvp": jvp(ours),
        },
        repeat,
    )
    return [
        {
            "case": "LayerNorm double backward",
            "shape": list(shape),
            "target": 0.5,
            "torch": ms["torch_bb"],
            "derivgen": ms["derivgen_bb"],
            "ratio": ms["derivgen_bb"] / ms["torch_bb"],
        },
        {
            "case": "LayerNorm JVP (torch.func.jvp)",
            "shape": list(shape),
            "target": 0.5,
            "torch": ms["torch_jvp"],
            "derivgen": ms["derivgen_jvp"],
            "ratio": ms["derivgen_jvp"] / ms["torch_jvp"],
        },
    ]


def _t(ms: float) -> str:
    """A time for the table: ms from 1 ms up, else us."""
    return f"{ms:.2f} ms" if ms >= 1 else f"{1e3 * ms:.1f} us"


def _floor_lines(rows: list[dict]) -> list[str]:
    """The memory floor of each case that has one (:func:`_case_row`), as lines under the table."""
    floored = [r for r in rows if "floor" in r]
    if not floored:
        return []
    copy_rate = statistics.median(r["bandwidth"]["copy_GBps"] for r in floored)
    nt = statistics.median(r["bandwidth"]["stream_copy_GBps"] for r in floored)
    mib = floored[0]["bandwidth"]["MiB"]
    out = [
        "",
        "memory floor: the fewest x-sized tensors forward + backward move through memory, at the",
        f"faster copy probe ({mib} MiB arrays beside each case; median copy {copy_rate:.1f} GB/s, streaming-store",
        f"copy {nt:.1f} GB/s), over torch.nn's fwd+bwd (tensors that partly stay in the last-level",
        "cache can run under it):",
    ]
    for r in floored:
        note = f"  target {r['target']} is below it" if below_floor(r) else ""
        out.append(f"  {r['case']:26s} {r['sweeps']} sweeps {_t(r['floor_ms']):>9s} {r['floor']:6.2f}{note}")
    return out


def format_torch_report(rep: dict) -> str:
    """The report of :func:`run_torch_bench` as a text table."""
    m = rep["machine"]
    lines = [
        f"derivgen.torch vs torch.nn, through autograd: {rep['dtype']}, {rep['threads']} threads,",
        f"median of {rep['repeat']} (round-robin), torch {m['torch']}",
        f"machine: {m['cpu']}, {m['cores']} cores",
        "",
        (
            f"{'case':26s} {'shape':>14s} {'torch fwd+bwd':>13s} {'derivgen':>9s} {'ratio':>6s} "
            f"{'fwd ratio':>9s} {'target':>7s}"
        ),
    ]
    for r in rep["cases"]:
        shape = "x".join(map(str, r["shape"]))
        tgt = f"<= {r['target']}" if r["target"] is not None else ""
        if "error" in r:
            lines.append(f"{r['case']:26s} {shape:>14s}   not supported: {r['error']}")
            continue
        ok = "" if r["target"] is None else (" met" if r["ratio"] <= r["target"] else " MISSED")
        lines.append(
            f"{r['case']:26s} {shape:>14s} {_t(r['torch_step']):>13s} {_t(r['derivgen_step']):>9s} "
            f"{r['ratio']:6.2f} {r['fwd_ratio']:9.2f} {tgt:>7s}{ok}"
        )
    lines += _floor_lines(rep["cases"])
    if rep.get("fused"):
        lines += _fused_lines(rep["fused"])
    if rep.get("second"):
        lines += [
            "",
            "second order, derived (derivgen.derive.second) vs PyTorch's hand-written formulas:",
            f"{'case':32s} {'shape':>12s} {'torch':>10s} {'derivgen':>10s} {'ratio':>6s} {'target':>7s}",
        ]
        for r in rep["second"]:
            ok = "  met" if r["ratio"] <= r["target"] else "  MISSED"
            lines.append(
                f"{r['case']:32s} {'x'.join(map(str, r['shape'])):>12s} {_t(r['torch']):>10s} "
                f"{_t(r['derivgen']):>10s} {r['ratio']:6.2f} {'<= ' + str(r['target']):>7s}{ok}"
            )
    b = rep["block"]
    if b is None:
        return "\n".join(lines)
    lines += [
        "",
        (
            f"transformer block training step ({'x'.join(map(str, b['shape']))}, LayerNorm + RMSNorm, SGD): "
            f"torch.nn {b['torch_step']:.1f} ms, derivgen {b['derivgen_step']:.1f} ms (ratio {b['ratio']:.2f}); "
            f"norms' share of the step: torch.nn {100 * b['torch_norm_share']:.1f}%, "
            f"derivgen {100 * b['derivgen_norm_share']:.1f}%"
        ),
    ]
    return "\n".join(lines)
