"""``derivgen bench --zoo``: every catalogue and zoo layer, derivgen.torch.Module against an
independent PyTorch forward of the same layer (bench_zoo_refs, bench_multi_refs: written from
the papers and the libraries, differentiated by autograd), eager and through ``torch.compile``
(Inductor), forward and forward + backward, side by side in one process.

Per layer: the arguments are drawn once (float64), the reference's float64 autograd gives
y and every gradient, and each float32 variant (derivgen, eager, compiled) must agree with
it -- y of a forward without autograd, then y and every gradient of a training step -- before
anything is timed; a layer that disagrees, has no reference, or is refused is listed with
its reason. The variants and the copy probes are then timed round-robin
(:func:`derivgen.tools.timing.round_robin`); the memory floor is the bytes forward + backward
must move (x, the tensors beside it and the outputs forward; x, the tensors, the cotangents
and the gradients backward) at the faster copy probe's rate, as ``bench --torch`` computes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch

import derivgen
from derivgen.runtime.machine import machine
from derivgen.tools.bench_torch import _inner
from derivgen.tools.bench_zoo_refs import reference
from derivgen.tools.timing import Bandwidth, round_robin

TRAILING, CHANNELS = (8192, 1024), (32, 64, 56, 56)
SMALL_TRAILING, SMALL_CHANNELS = (64, 128), (4, 8, 6, 6)
TOL = 2e-3  # float32 against the float64 reference, relative to the largest reference value
# options a layer needs (no default) or that fit the bench's shapes; num_groups: a Module keyword
OPTIONS = {"online_layernorm": {"alpha": 0.5}}
GROUPS = {"groupnorm": 32, "evonorm_s0": 32}
IMPLS = ("derivgen", "eager", "compile")


def layers() -> list[str]:
    """Every catalogue and zoo layer, in ``derivgen list``'s order."""
    return [*derivgen.names(), *derivgen.zoo()]


@dataclass
class Problem:
    """One layer's arguments (float64 NumPy, by the spec's names), options and cotangents."""

    name: str
    shape: tuple[int, ...]
    args: dict[str, np.ndarray]  # x, the tensors beside x, the parameters, the per-group inputs
    grads: list[str]  # the arguments with gradients, x first
    options: dict[str, float]
    groups: int | None
    buffers: dict[str, np.ndarray]
    cots: list[np.ndarray]  # one per output, y first
    size: int = 0
    module_kw: dict = field(default_factory=dict)


def _x_shape(spec, trailing: tuple, channels: tuple) -> tuple[int, ...]:
    """x's shape: ``channels`` for a channel layout; ``trailing`` otherwise, split into (B, T, D)
    for a layer with tensors beside x (per-sample ones are (B, D), as DiT's adaLN takes them)."""
    if spec.layout == "channels":
        return tuple(channels)
    if spec.multi and len(trailing) == 2:
        b = math.gcd(trailing[0], 8)
        return (b, trailing[0] // b, trailing[1])
    return tuple(trailing)


def _tensor_shape(kind: str, shape: tuple, channels: bool) -> tuple[int, ...]:
    """A tensor beside x by its declared kind: of x's shape, per sample, or per position."""
    if kind == "x":
        return shape
    if kind == "sample":
        return shape[:2] if channels else (shape[0], shape[-1])
    if kind == "position":
        return (shape[0], 1, *shape[2:])
    raise ValueError(f"tensor kind {kind!r}")


def problem(name: str, trailing: tuple = TRAILING, channels: tuple = CHANNELS, seed: int = 0) -> Problem:
    """Layer ``name``'s arguments at the bench's sizes: parameters near their initial values,
    per-group inputs in [0.5, 2], masks with three in four values kept."""
    spec = derivgen.load_spec(name)
    ch = spec.layout == "channels"
    shape = _x_shape(spec, trailing, channels)
    size = shape[1] if ch else shape[-1]
    rng = np.random.default_rng(seed)
    args = {"x": rng.normal(0.1, 1.0, shape)}
    grads = ["x"]
    for t in spec.tensors:
        ts = _tensor_shape(t.shape, shape, ch)
        if t.mask:
            m = (rng.random(ts) < 0.75).astype(np.float64)
            m[(0,) * (m.ndim - 1)] = 1.0  # every group one valid value at least
            m[..., 0] = 1.0
            args[t.name] = m
        else:
            args[t.name] = rng.normal(0.0, 0.7, ts)
            grads.append(t.name)
    for p in spec.params:
        v = p.init + 0.1 * rng.normal(size=() if p.scalar else (size,))
        if name == "frn" and p.name == "tau":
            v = 0.5 * rng.normal(size=size)  # a threshold inside the range of gamma*x̂ + beta
        args[p.name] = np.asarray(v, dtype=np.float64)
        grads.append(p.name)
    stat = shape[:2] if spec.reduce == "instance" else shape[:-1]
    for i in spec.inputs:
        args[i.name] = rng.uniform(0.5, 2.0, stat)
        grads.append(i.name)
    options = {o.name: o.default for o in spec.options} | OPTIONS.get(name, {})
    groups = math.gcd(GROUPS[name], size) if name in GROUPS else None
    if groups:
        options["num_groups"] = groups
    buffers = {b.name: np.full(size, float(b.init)) for b in spec.buffers}
    cots = [rng.normal(size=shape) for _ in range(1 + len(spec.outputs))]
    module_kw = OPTIONS.get(name, {}) | ({"num_groups": groups} if groups else {})
    return Problem(name, shape, args, grads, options, groups, buffers, cots, size, module_kw)


def _leaves(prob: Problem, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The arguments as torch leaves of ``dtype``, those with gradients requiring them."""
    return {k: torch.tensor(v, dtype=dtype).requires_grad_(k in prob.grads) for k, v in prob.args.items()}


def _run_ref(prob: Problem, ref: Callable, dtype: torch.dtype) -> tuple[list, dict]:
    """The reference's outputs and gradients in ``dtype`` (float64: the oracle)."""
    a = _leaves(prob, dtype)
    bufs = {k: torch.tensor(v, dtype=dtype) for k, v in prob.buffers.items()}
    outs = ref(a, prob.options, bufs)
    torch.autograd.backward(outs, [torch.tensor(c, dtype=dtype) for c in prob.cots])
    return [o.detach().double().numpy() for o in outs], {k: a[k].grad.double().numpy() for k in prob.grads}


class Variant:
    """One implementation on float32 arguments of its own: ``fwd`` (no autograd), ``step``
    (forward + backward through autograd) and what the last step gave (``result``)."""

    def __init__(self, prob: Problem, call: Callable[[dict], tuple], params: dict[str, torch.Tensor] | None = None):
        self.leaves = _leaves(prob, torch.float32)
        if params is not None:  # derivgen's module owns its parameters: the same values
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(self.leaves[k])
            self.leaves.update(params)
        self.grad_leaves = [self.leaves[k] for k in prob.grads]
        self.cots = [torch.tensor(c, dtype=torch.float32) for c in prob.cots]
        self.call, self.prob = call, prob
        self.outs: tuple = ()

    def fwd(self) -> None:
        with torch.no_grad():
            self.call(self.leaves)

    def step(self) -> None:
        for t in self.grad_leaves:
            t.grad = None
        self.outs = self.call(self.leaves)
        torch.autograd.backward(self.outs, self.cots)

    def result(self) -> tuple[list, dict]:
        with torch.no_grad():
            y = [o.double().numpy() for o in self.call(self.leaves)]
        self.step()
        return y + [o.detach().double().numpy() for o in self.outs], {
            k: self.leaves[k].grad.double().numpy() for k in self.prob.grads
        }


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (inf where the shapes differ or a value is not finite)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return math.inf
    err = float(np.max(np.abs(got - want), initial=0.0) / max(float(np.max(np.abs(want), initial=0.0)), 1e-30))
    return err if math.isfinite(err) else math.inf


def disagreement(got: tuple[list, dict], want: tuple[list, dict]) -> tuple[float, str]:
    """The largest relative error of a variant's outputs (twice: forward, then the step's) and
    gradients against the reference's, and what it is of."""
    outs, grads = got
    ref_outs, ref_grads = want
    worst, what = 0.0, ""
    for k, o in enumerate(outs):
        e = _rel(o, ref_outs[k % len(ref_outs)])
        if e > worst or not what:
            worst, what = e, f"output {k % len(ref_outs)}"
    for k, g in grads.items():
        e = _rel(g, ref_grads[k])
        if e > worst:
            worst, what = e, f"d{k}"
    return worst, what


def _buffers(prob: Problem) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in prob.buffers.items()}


def in_block(layer: Callable) -> Callable:
    """``layer`` (a function of the arguments returning its outputs) inside a transformer
    block's elementwise neighbours: (gelu(y) + x,), the layer's first output only."""

    def block(a: dict, *rest) -> tuple:
        return (torch.nn.functional.gelu(layer(a, *rest)[0]) + a["x"],)

    return block


def variants(prob: Problem, ref: Callable, compiled: bool, block: bool = False) -> dict[str, Variant]:
    """derivgen.torch.Module and the reference (eager; compiled by Inductor where ``compiled``).
    ``block``: each inside :func:`in_block`'s neighbours, derivgen's module under torch.compile
    with them (the reference is passed in its block already)."""
    import derivgen.torch as dt

    spec = derivgen.load_spec(prob.name)
    module = dt.Module(prob.name, prob.size, **prob.module_kw)
    with torch.no_grad():
        for k, v in prob.buffers.items():
            getattr(module, k).copy_(torch.as_tensor(v))
    tnames = [t.name for t in spec.tensors]
    inames = [i.name for i in spec.inputs]

    def ours(a: dict) -> tuple:
        out = module(a["x"], *(a[t] for t in tnames), **{i: a[i] for i in inames})
        return out if isinstance(out, tuple) else (out,)

    if block or compiled:
        # every layer's compiled code is the same code object (this lambda's, in_block's):
        # Dynamo keeps a few compiled versions of a code object and runs it eagerly past its
        # limit (8), so the layers after the first few of a run would be timed uncompiled; a
        # fresh start each
        torch._dynamo.reset()
    if block:
        ours = torch.compile(in_block(ours), dynamic=False)
    out = {"derivgen": Variant(prob, ours, dict(module.named_parameters()))}
    eager_bufs = _buffers(prob)
    out["eager"] = Variant(prob, lambda a: ref(a, prob.options, eager_bufs))
    if compiled:
        comp_bufs = _buffers(prob)
        fn = torch.compile(lambda a, bufs: ref(a, prob.options, bufs), dynamic=False)
        out["compile"] = Variant(prob, lambda a: fn(a, comp_bufs))
    return out


def _bytes(prob: Problem) -> int:
    """What forward + backward must move, float32: x, the tensors beside it and the outputs
    forward; x, the tensors, the cotangents, dx and the gradients of the tensors backward."""
    x = math.prod(prob.shape)
    tensors = [k for k in prob.args if k != "x" and k in {t.name for t in derivgen.load_spec(prob.name).tensors}]
    t_in = sum(prob.args[k].size for k in tensors)
    t_grad = sum(prob.args[k].size for k in tensors if k in prob.grads)
    outs = sum(c.size for c in prob.cots)
    return 4 * ((x + t_in + outs) + (x + t_in + outs + x + t_grad))


def bench_layer(
    name: str,
    trailing: tuple,
    channels: tuple,
    repeat: int,
    bw: Bandwidth | None,
    compiled: bool = True,
    block: bool = False,
) -> dict:
    """One layer's row: ms per call of each variant's forward and step, the ratios, the memory
    floor, the agreement; or ``error`` (why it was not timed). ``block``: the layer inside
    :func:`in_block`'s neighbours (gelu(y) + x) in every variant."""
    row: dict = {"layer": name}
    ref = reference(name)
    if ref is None:
        row["error"] = "no independent PyTorch reference"
        return row
    try:
        prob = problem(name, trailing, channels)
    except (TypeError, ValueError) as e:
        row["error"] = f"no bench arguments: {e}"
        return row
    if block:
        ref, prob.cots = in_block(ref), prob.cots[:1]
    row["shape"] = list(prob.shape)
    want = _run_ref(prob, ref, torch.float64)
    try:
        vs = variants(prob, ref, compiled, block)
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
        row["error"] = f"derivgen refused it: {str(e).splitlines()[0]}"
        return row
    row["agreement"] = {}
    for impl, v in vs.items():
        try:
            err, what = disagreement(v.result(), want)
        except Exception as e:  # noqa: BLE001 -- a variant that fails to run is reported, not raised
            row["error"] = f"{impl} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return row
        row["agreement"][impl] = err
        if err > TOL:
            row["error"] = f"{impl} disagrees with the float64 reference: {what} off by {err:.2g} (> {TOL:g})"
            return row
    k = _inner(torch.empty(prob.shape))
    fns: dict[str, Callable[[], object]] = {}
    for impl, v in vs.items():
        fns[f"{impl}_fwd"] = _loop(v.fwd, k)
        fns[f"{impl}_step"] = _loop(v.step, k)
    if bw is not None:
        fns.update(copy=bw.copy, stream_copy=bw.stream_copy)
    ms = round_robin(fns, repeat)
    for impl in vs:
        row[f"{impl}_fwd"] = ms[f"{impl}_fwd"] / k
        row[f"{impl}_step"] = ms[f"{impl}_step"] / k
    r = row
    r["step_vs_eager"] = r["derivgen_step"] / r["eager_step"]
    r["fwd_vs_eager"] = r["derivgen_fwd"] / r["eager_fwd"]
    if "compile" in vs:
        r["step_vs_compile"] = r["derivgen_step"] / r["compile_step"]
        r["fwd_vs_compile"] = r["derivgen_fwd"] / r["compile_fwd"]
    if bw is not None:
        rates = bw.rates(ms)
        best = max(rates["copy_GBps"], rates["stream_copy_GBps"])
        r["bandwidth"] = rates
        r["bytes"] = _bytes(prob)
        r["floor_ms"] = r["bytes"] / (best * 1e6)
        r["step_vs_floor"] = r["derivgen_step"] / r["floor_ms"]
    return row


def _loop(fn: Callable[[], None], k: int) -> Callable[[], None]:
    def call() -> None:
        for _ in range(k):
            fn()

    return call


def run_zoo_bench(
    names: Collection[str] | None = None,
    trailing: tuple = TRAILING,
    channels: tuple = CHANNELS,
    threads: int | None = None,
    repeat: int = 15,
    compiled: bool = True,
    floor: bool = True,
    progress: Callable[[str], None] | None = None,
    block: bool = False,
) -> dict:
    """Every layer's row (``names``: those only), the machine and the settings, as data;
    ``block``: each layer inside a block's neighbours, gelu(y) + x (:func:`in_block`)."""
    threads = threads or machine().cores
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    bw = Bandwidth(threads) if floor else None
    rows = []
    try:
        for name in names or layers():
            rows.append(bench_layer(name, trailing, channels, repeat, bw, compiled, block))
            if progress:
                progress(name)
    finally:
        torch.set_num_threads(before)
    return {
        "machine": machine().as_dict(),
        "torch": torch.__version__,
        "threads": threads,
        "dtype": "float32",
        "repeat": repeat,
        "trailing": list(trailing),
        "channels": list(channels),
        "compiled": compiled,
        "block": block,
        "tolerance": TOL,
        "rows": rows,
    }


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_zoo_report(rep: dict) -> str:
    """The report as text: the machine, then one row per layer (ms and ratios), the layers not
    timed with their reasons last."""
    m = rep["machine"]
    lines = [
        f"machine: {m['cpu']}; {m['cores']} core(s); ISA {' '.join(m['flags']) or '-'}"
        + (f" ({m['level']})" if m.get("level") else ""),
        (
            f"derivgen.torch.Module vs an independent PyTorch forward (eager, torch.compile/Inductor), through "
            f"autograd: {rep['dtype']}, {rep['threads']} threads, torch {rep['torch']}, median of {rep['repeat']} "
            f"(round-robin); trailing layers {'x'.join(map(str, rep['trailing']))}, channel layers "
            f"{'x'.join(map(str, rep['channels']))}; every variant within {rep['tolerance']:g} of the float64 reference"
        ),
        *(
            ["each layer inside a block, gelu(y) + x: derivgen's module under torch.compile with gelu and the add"]
            if rep.get("block")
            else []
        ),
        "",
    ]
    cols = ("layer", "shape", "eager", "compile", "derivgen", "/compile", "/eager", "fwd/eager", "fwd/comp", "/floor")
    table = [cols]
    for r in rep["rows"]:
        if "error" in r:
            continue
        table.append(
            (
                r["layer"],
                "x".join(map(str, r["shape"])),
                _f(r["eager_step"]),
                _f(r.get("compile_step")),
                _f(r["derivgen_step"]),
                _f(r.get("step_vs_compile")),
                _f(r["step_vs_eager"]),
                _f(r["fwd_vs_eager"]),
                _f(r.get("fwd_vs_compile")),
                _f(r.get("step_vs_floor")),
            )
        )
    legend = (
        "eager, compile, derivgen: fwd+bwd ms; /compile, /eager: derivgen's fwd+bwd over theirs; fwd/...: the "
        "same of the forward without autograd; /floor: derivgen's fwd+bwd over the bytes it must move at the "
        "faster copy probe's rate"
    )
    return table_text(lines, table, legend, rep["rows"])


def table_text(lines: list[str], table: list[tuple[str, ...]], legend: str, rows: list[dict]) -> str:
    """``lines`` (the header), then ``table`` in aligned columns, its ``legend``, and the rows
    not timed with their reasons."""
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    lines = [*lines, *("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table), "", legend]
    skipped = [r for r in rows if "error" in r]
    if skipped:
        lines += ["", "not timed:"] + [f"  {r['layer']}: {r['error']}" for r in skipped]
    return "\n".join(lines)
