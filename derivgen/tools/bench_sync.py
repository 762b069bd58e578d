"""``derivgen bench --torch --sync``: batch norm over a batch split across processes.

WORLD gloo processes on this machine each hold 1/WORLD of a 32x64x56x56 float32
batch and run derivgen.torch.SyncBatchNorm forward and backward; the same layer
runs in one process on the whole batch (derivgen's C kernels) beside it. Reported:
the median step of each, the time spent in the collectives (all_gather and
all_reduce, timed inside the step) against the rest, and the split passes' bytes
against the machine's copy bandwidth. The processes share the machine's cores:
with 2 cores and 2 processes each process runs one thread.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from derivgen import runtime as rt
from derivgen.runtime.machine import machine
from derivgen.tools.timing import Bandwidth, round_robin
from derivgen.torch import SyncBatchNorm
from derivgen.torch.nn import BatchNorm2d
from derivgen.torch.ops import layer, threads
from derivgen.torch.sync import _CSplit

SHAPE = (32, 64, 56, 56)


def _timed_collectives():
    """Wrap all_reduce/all_gather to add their time to a list (restored on exit)."""
    spent: list[float] = []
    orig = dist.all_reduce, dist.all_gather

    def wrap(fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent.append(time.perf_counter() - t0)

        return timed

    dist.all_reduce, dist.all_gather = wrap(orig[0]), wrap(orig[1])
    return spent, orig


def _join(ctx, timeout: float) -> bool:
    """Wait for the processes (errors raised as torch.multiprocessing does); False on timeout,
    after killing them."""
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                p.kill()
            return False
    return True


def _rank(rank, world, port, repeat, out, shape=SHAPE):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    g = torch.Generator().manual_seed(rank)
    n = shape[0] // world
    x = torch.randn((n, *shape[1:]), generator=g).requires_grad_(True)
    dy = torch.randn((n, *shape[1:]), generator=g)
    m = SyncBatchNorm(shape[1])
    spent, orig = _timed_collectives()
    steps, colls = [], []
    try:
        for i in range(repeat + 2):
            dist.barrier()
            del spent[:]
            t0 = time.perf_counter()
            x.grad = None
            m(x).backward(dy)
            t = time.perf_counter() - t0
            if i >= 2:
                steps.append(t)
                colls.append(sum(spent))
    finally:
        dist.all_reduce, dist.all_gather = orig
    res = torch.tensor([statistics.median(steps), statistics.median(colls)], dtype=torch.float64)
    every = [torch.empty_like(res) for _ in range(world)]
    dist.all_gather(every, res)
    if rank == 0:
        torch.save(torch.stack(every), out)
    del m, x, dy
    dist.destroy_process_group()
    # exit without interpreter teardown: a gloo group torn down during finalization can abort
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_sync_bench(world: int = 2, repeat: int = 10, timeout: float = 600) -> dict:
    """SyncBatchNorm over ``world`` gloo processes on this machine against one process on
    the whole batch and the bandwidth bound of the split's passes; the times in ms."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.pt")
        # spawn, not fork: a process that has run OpenMP kernels (derivgen's, torch's) cannot fork safely
        ctx = mp.start_processes(
            _rank, args=(world, port, repeat, out, SHAPE), nprocs=world, join=False, start_method="spawn"
        )
        if not _join(ctx, timeout=timeout):
            raise RuntimeError(f"the {world} benchmark processes did not finish in {timeout:g} s")
        per_rank = torch.load(out)
    # one process on the whole batch, all cores, derivgen's C kernels
    torch.set_num_threads(machine().cores)
    x = torch.randn(SHAPE).requires_grad_(True)
    dy = torch.randn(SHAPE)
    m = BatchNorm2d(SHAPE[1])
    one = []
    for i in range(repeat + 2):
        t0 = time.perf_counter()
        x.grad = None
        m(x).backward(dy)
        if i >= 2:
            one.append(time.perf_counter() - t0)

    probe = Bandwidth(machine().cores)
    bw = probe.rates(round_robin({"copy": probe.copy, "stream_copy": probe.stream_copy}, 5))["copy_GBps"]
    del probe
    kernels = _kernel_times(x.detach(), dy, repeat, bw)
    nbytes = x.numel() * 4
    # the split passes in float32 terms: forward reads x per level (2) and once to apply
    # (writes y); backward reads x and dy for its sums and again to apply (writes dx)
    passes = 2 + 2 + 2 + 3
    return {
        "world": world,
        "shape": list(SHAPE),
        "repeat": repeat,
        "sync_step_ms": [1e3 * float(v) for v in per_rank[:, 0]],
        "sync_collective_ms": [1e3 * float(v) for v in per_rank[:, 1]],
        "one_process_ms": 1e3 * statistics.median(one),
        "copy_gbps": bw,
        "bound_ms": 1e3 * passes * nbytes / (bw * 1e9),
        "kernels": kernels,
    }


def _kernel_times(x, dy, repeat, bw) -> list:
    """The C split kernels alone on the whole batch in this process (all cores):
    (name, ms, tensors read + written, ms at the copy bandwidth)."""

    lay = layer("batchnorm")
    c = _CSplit(lay, torch.float32)

    Lx = rt.layout_from_shapes(lay.meta, tuple(x.shape), {"gamma": (x.shape[1],), "beta": (x.shape[1],)}, None)
    g, b = torch.ones(x.shape[1]), torch.zeros(x.shape[1])
    dims = (Lx.O, Lx.G, Lx.Cg, Lx.S)
    pp = [g.data_ptr(), b.data_ptr()]
    opts = [1e-5, 0.1]
    n = float(Lx.group_size)
    stats = torch.zeros((3, Lx.n_groups), dtype=torch.float64)
    sums = torch.zeros((2, Lx.n_groups), dtype=torch.float64)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dg, db = torch.empty_like(g), torch.empty_like(b)

    f, th = c.fn, threads(c.kernel)
    for level in range(2):  # real statistics for the later kernels
        f["partial"](*dims, x.data_ptr(), *pp, *opts, level, stats.data_ptr(), n, sums.data_ptr(), th)
        f["finish"](*dims, *pp, *opts, level, sums.data_ptr(), n, stats.data_ptr())
    calls = {
        "partial, level 0 (sum x)": (
            lambda: f["partial"](*dims, x.data_ptr(), *pp, *opts, 0, stats.data_ptr(), n, sums.data_ptr(), th),
            1,
        ),
        "partial, level 1 (sum (x-mean)^2)": (
            lambda: f["partial"](*dims, x.data_ptr(), *pp, *opts, 1, stats.data_ptr(), n, sums.data_ptr(), th),
            1,
        ),
        "apply (y)": (lambda: f["apply"](*dims, x.data_ptr(), *pp, *opts, stats.data_ptr(), n, y.data_ptr(), th), 2),
        "backward partial (sum g, g*xhat)": (
            lambda: f["bpartial"](
                *dims, x.data_ptr(), dy.data_ptr(), *pp, *opts, stats.data_ptr(), n, sums.data_ptr(), th
            ),
            2,
        ),
        "backward apply (dx, dgamma, dbeta)": (
            lambda: f["bapply"](
                *dims,
                x.data_ptr(),
                dy.data_ptr(),
                *pp,
                *opts,
                stats.data_ptr(),
                sums.data_ptr(),
                n,
                1,
                dx.data_ptr(),
                dg.data_ptr(),
                db.data_ptr(),
                th,
            ),
            3,
        ),
    }
    ms = round_robin({k: v[0] for k, v in calls.items()}, repeat)
    nbytes = x.numel() * 4
    return [(k, ms[k], calls[k][1], 1e3 * calls[k][1] * nbytes / (bw * 1e9)) for k in calls]


def format_sync_report(r: dict) -> str:
    """The report of :func:`run_sync_bench` as text."""
    step = max(r["sync_step_ms"])
    coll = max(r["sync_collective_ms"])
    return "\n".join(
        [
            f"SyncBatchNorm over {r['world']} gloo processes on this machine, {'x'.join(map(str, r['shape']))} float32,",
            f"  each process 1/{r['world']} of the batch, median of {r['repeat']}",
            (
                f"  step (forward + backward), slowest process: {step:.2f} ms, of which collectives {coll:.2f} ms "
                f"({100 * coll / step:.0f}%)"
            ),
            (
                f"  one process on the whole batch (C kernels, all cores): {r['one_process_ms']:.2f} ms "
                f"(split / one: {step / r['one_process_ms']:.2f})"
            ),
            f"  bandwidth bound of the split's passes (9 tensor sweeps at {r['copy_gbps']:.1f} GB/s copy):",
            f"    {r['bound_ms']:.2f} ms (split / bound: {step / r['bound_ms']:.2f})",
            "  the C split kernels alone, one process, whole batch",
            "  (tensors read + written; time / bandwidth bound):",
            *[f"    {name:36s} {ms:7.2f} ms  {k} tensor(s)  {ms / bound:5.2f}x" for name, ms, k, bound in r["kernels"]],
        ]
    )
