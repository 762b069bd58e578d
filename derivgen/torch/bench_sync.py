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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _rank(rank, world, port, repeat, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from derivgen.torch import SyncBatchNorm
    g = torch.Generator().manual_seed(rank)
    n = SHAPE[0] // world
    x = torch.randn((n, *SHAPE[1:]), generator=g).requires_grad_(True)
    dy = torch.randn((n, *SHAPE[1:]), generator=g)
    m = SyncBatchNorm(SHAPE[1])
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
    dist.destroy_process_group()


def run_sync_bench(world: int = 2, repeat: int = 10) -> dict:
    from ..bench import Bandwidth
    from ..machine import machine
    from .nn import BatchNorm2d
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.pt")
        mp.start_processes(_rank, args=(world, port, repeat, out), nprocs=world, join=True, start_method="fork")
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
    from ..bench import round_robin
    probe = Bandwidth(machine().cores)
    bw = probe.rates(round_robin({"copy": probe.copy, "stream_copy": probe.stream_copy}, 5))["copy_GBps"]
    del probe
    nbytes = x.numel() * 4
    # the split passes in float32 terms: forward reads x per level (2) and once to apply
    # (writes y); backward reads x and dy for its sums and again to apply (writes dx)
    passes = 2 + 2 + 2 + 3
    return {"world": world, "shape": list(SHAPE), "repeat": repeat,
            "sync_step_ms": [1e3 * float(v) for v in per_rank[:, 0]],
            "sync_collective_ms": [1e3 * float(v) for v in per_rank[:, 1]],
            "one_process_ms": 1e3 * statistics.median(one), "copy_gbps": bw,
            "bound_ms": 1e3 * passes * nbytes / (bw * 1e9)}


def format_sync_report(r: dict) -> str:
    step = max(r["sync_step_ms"])
    coll = max(r["sync_collective_ms"])
    return "\n".join([
        f"SyncBatchNorm over {r['world']} gloo processes on this machine, {'x'.join(map(str, r['shape']))} "
        f"float32, each process 1/{r['world']} of the batch, median of {r['repeat']}",
        f"  step (forward + backward), slowest process: {step:.2f} ms, of which collectives {coll:.2f} ms "
        f"({100 * coll / step:.0f}%)",
        f"  one process on the whole batch (C kernels, all cores): {r['one_process_ms']:.2f} ms "
        f"(split / one: {step / r['one_process_ms']:.2f})",
        f"  bandwidth bound of the split's passes (9 tensor sweeps at {r['copy_gbps']:.1f} GB/s copy): "
        f"{r['bound_ms']:.2f} ms (split / bound: {step / r['bound_ms']:.2f})",
    ])
