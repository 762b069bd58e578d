"""`derivgen bench --dtype bfloat16`: the bfloat16 C kernels per byte against the float32 ones.

bfloat16 tensors move half the bytes of float32 ones, so a kernel limited by memory
takes half the time. This bench calls derivgen.torch's forward and backward operators
(``torch.ops.derivgen.<layer>_train_forward`` / ``_backward``: the generated C kernels, the
bfloat16 ones from the extras build) on the same values in float32 and in bfloat16,
PyTorch's own layers in both dtypes, and the streaming-store bandwidth probe, side by
side in one process. It reports each pass's time over the streaming-store bound (bytes
moved: forward x, y; backward x, dy, dx, at the dtype's size) and the per-byte ratio
bfloat16 / float32 (1.0: as fast per byte; 2.0: no faster per call than float32).

The operators allocate their outputs on every call, as they do inside a model; the
allocator is tuned (no mmap for large blocks) as in ``derivgen bench``, so that
allocation is not page faults.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from derivgen.runtime.machine import machine
from derivgen.spec import load_catalogue
from derivgen.tools.bench import _inputs
from derivgen.tools.bench_targets import DEFAULT_SHAPES
from derivgen.tools.timing import Bandwidth, round_robin, tune_malloc
from derivgen.torch import ops as dops

LAYERS = ("layernorm", "rmsnorm", "batchnorm", "groupnorm", "instancenorm")
PER_BYTE_TARGET = 1.2  # bfloat16 time per byte / float32 time per byte


def _torch_layer(name: str, shape: tuple, kw: dict) -> Callable:
    """PyTorch's functional layer of a catalogue layer: (x, params) -> y."""
    if name == "layernorm":
        return lambda x, p: F.layer_norm(x, shape[-1:], p[0], p[1], 1e-5)
    if name == "rmsnorm":
        return lambda x, p: F.rms_norm(x, shape[-1:], p[0], 1e-6)
    if name == "batchnorm":
        return lambda x, p: F.batch_norm(x, None, None, p[0], p[1], True, 0.1, 1e-5)
    if name == "instancenorm":
        return lambda x, p: F.instance_norm(x, weight=p[0], bias=p[1], eps=1e-5)
    if name == "groupnorm":
        return lambda x, p: F.group_norm(x, kw["num_groups"], p[0], p[1], 1e-5)
    raise KeyError(name)


def _case(name: str, shape: tuple, repeat: int, probe: Bandwidth, progress) -> dict:
    """One layer at one shape: each pass of derivgen's operators and of torch's layer in
    float32 and bfloat16, with the bandwidth probe, in the same rounds."""
    spec = load_catalogue(name)
    x, dy, params, kw = _inputs(spec, shape, np.dtype(np.float32), True)
    dops.layer(name)  # registers the layer's operators
    ops = torch.ops.derivgen
    fwd_op = getattr(ops, f"{name}_train_forward")
    bwd_op = getattr(ops, f"{name}_train_backward")
    options = [float(kw.get(o.name, o.default)) for o in spec.options]
    groups = int(kw.get("num_groups", 0))
    fns: dict = {("probe", "-", "stream"): probe.stream_copy}
    nbytes = {}
    for dt, label in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        tx, tdy = torch.from_numpy(x).to(dt), torch.from_numpy(dy).to(dt)
        tp = [torch.from_numpy(p).to(dt) for p in params]
        nbytes[label] = tx.numel() * tx.element_size()
        # the training-mode operators (running buffers are updated outside them, in derivgen.torch.nn)
        stats = list(fwd_op(tx, *tp, *options, groups)[1:])

        def fwd(tx=tx, tp=tp):
            fwd_op(tx, *tp, *options, groups)

        def bwd(tdy=tdy, tx=tx, tp=tp, s=stats):
            bwd_op(tdy, tx, *tp, *s, *options, groups)

        layer = _torch_layer(name, shape, kw)
        gx = tx.clone().requires_grad_(True)
        gp = [p.clone().requires_grad_(True) for p in tp]
        y = layer(gx, gp)

        def torch_fwd(tx=tx, tp=tp, layer=layer):
            with torch.no_grad():
                layer(tx, tp)

        def torch_bwd(y=y, gx=gx, gp=gp, tdy=tdy):
            torch.autograd.grad(y, [gx, *gp], tdy, retain_graph=True)

        fns.update(
            {
                ("derivgen", label, "fwd"): fwd,
                ("derivgen", label, "bwd"): bwd,
                ("torch", label, "fwd"): torch_fwd,
                ("torch", label, "bwd"): torch_bwd,
            }
        )
    if progress:
        progress(f"{name} {shape} float32 and bfloat16 side by side")
    t = round_robin(fns, repeat)
    gbps = probe.rate(t[("probe", "-", "stream")])  # the streaming-store copy
    row: dict = {"layer": name, "shape": list(shape), "stream_copy_GBps": gbps, "ms": {}, "ratios": {}}
    for (impl, label, phase), ms in t.items():
        if impl == "probe":
            continue
        row["ms"][f"{impl} {label} {phase}"] = ms
        moved = (2 if phase == "fwd" else 3) * nbytes[label]
        row["ratios"][f"{impl} {label} {phase} / nt bound"] = ms / (moved / (gbps * 1e6))
    for impl in ("derivgen", "torch"):
        for phase in ("fwd", "bwd"):
            per_byte = (t[(impl, "bfloat16", phase)] / nbytes["bfloat16"]) / (
                t[(impl, "float32", phase)] / nbytes["float32"]
            )
            row["ratios"][f"{impl} {phase} bfloat16 / float32 per byte"] = per_byte
        row["ratios"]["derivgen / torch bfloat16 fwd+bwd"] = (
            t[("derivgen", "bfloat16", "fwd")] + t[("derivgen", "bfloat16", "bwd")]
        ) / (t[("torch", "bfloat16", "fwd")] + t[("torch", "bfloat16", "bwd")])
    return row


def run_bf16_bench(
    layers: Iterable[str],
    shapes: Sequence[tuple] | None = None,
    threads: int | None = None,
    repeat: int = 15,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The bfloat16 kernels of catalogue ``layers`` against their float32 ones and torch's."""
    threads = threads or machine().cores
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernels' threads too (derivgen.torch.plan.threads)
    tuned = tune_malloc()
    probe = Bandwidth(threads)
    rows = []
    try:
        for name in layers:
            for shape in shapes or DEFAULT_SHAPES[name][:1]:
                rows.append(_case(name, tuple(shape), repeat, probe, progress))
    finally:
        torch.set_num_threads(before)
    return {
        "machine": machine().as_dict(),
        "threads": threads,
        "torch": torch.__version__,
        "tuned_malloc": tuned,
        "stream_copy_GBps": statistics.median(r["stream_copy_GBps"] for r in rows) if rows else None,
        "results": rows,
        "per_byte_target": PER_BYTE_TARGET,
    }


def format_bf16_report(report: dict) -> str:
    """The report as a table: per layer and shape, each pass over the streaming-store bound
    in float32 and bfloat16, and the per-byte ratio."""
    m = report["machine"]
    lines = [
        f"machine: {m['cpu']}; {m['cores']} core(s); CPU flags: {' '.join(m['flags']) or '-'}",
        (
            f"threads {report['threads']}; torch {report['torch']}; malloc {'tuned' if report['tuned_malloc'] else 'default'}; "
            f"streaming-store copy {report['stream_copy_GBps']:.1f} GB/s (median over the cases)"
        ),
        (
            "nt bound = bytes moved (fwd: x, y; bwd: x, dy, dx) at the dtype's size / streaming-store copy bandwidth; "
            "per byte = (bf16 ms / bf16 bytes) / (f32 ms / f32 bytes)"
        ),
        "",
        (
            f"{'case':<26} {'impl':<9} {'f32 fwd/nt':>10} {'bf16 fwd/nt':>11} {'f32 bwd/nt':>10} {'bf16 bwd/nt':>11} "
            f"{'fwd per byte':>12} {'bwd per byte':>12}"
        ),
    ]
    for r in report["results"]:
        case = f"{r['layer']} {'x'.join(map(str, r['shape']))}"
        q = r["ratios"]
        for impl in ("derivgen", "torch"):
            lines.append(
                f"{case:<26} {impl:<9} {q[f'{impl} float32 fwd / nt bound']:>10.2f} "
                f"{q[f'{impl} bfloat16 fwd / nt bound']:>11.2f} {q[f'{impl} float32 bwd / nt bound']:>10.2f} "
                f"{q[f'{impl} bfloat16 bwd / nt bound']:>11.2f} {q[f'{impl} fwd bfloat16 / float32 per byte']:>12.2f} "
                f"{q[f'{impl} bwd bfloat16 / float32 per byte']:>12.2f}"
            )
            case = ""
        lines.append(f"{'':<26} derivgen / torch, bfloat16 fwd+bwd: {q['derivgen / torch bfloat16 fwd+bwd']:.2f}")
    worst = [
        (r["layer"], ph, r["ratios"][f"derivgen {ph} bfloat16 / float32 per byte"])
        for r in report["results"]
        for ph in ("fwd", "bwd")
    ]
    bad = [f"{n} {ph} {v:.2f}" for n, ph, v in worst if v > report["per_byte_target"]]
    lines.append("")
    lines.append(
        f"target: bfloat16 per byte within {report['per_byte_target']}x of float32: "
        + ("met" if not bad else "missed by " + ", ".join(bad))
    )
    return "\n".join(lines)
