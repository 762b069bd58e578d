"""Run by tests/torch/test_torch_sync.py in a subprocess of its own: WORLD gloo processes on
localhost, each with its part of a batch (parts of unequal sizes, one of them empty),
against one process on the concatenated batch. Exits non-zero on any failure and prints
one line per check. Usage: sync_driver.py CASE WORLD, CASE one of

  batchnorm   derivgen.torch.SyncBatchNorm, float32 and float64: outputs, every
              gradient (the parameters' summed over processes), running buffers,
              num_batches_tracked, against torch.nn.BatchNorm2d on the whole batch;
  spec        a user spec with a batch reduction and a non-standard statistic
              (Module(spec, sync=True)) against the same spec in one process;
  train       a small CNN under DistributedDataParallel after
              SyncBatchNorm.convert_sync_batchnorm, 10 SGD steps, against one process;
  badshape    one process has another channel count: every process raises SyncError;
  baddtype    one process fails its input checks: every process raises SyncError;
  raise       one process raises before the layer and exits: the others get an error from
              the collective (its peer is gone), not a hang.
"""

import datetime
import gc
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import derivgen.torch as dt
from derivgen.torch.sync import SyncError

ROOT = Path(__file__).resolve().parent.parent
# the spec of case "spec", written by main() for the ranks it forks
SPEC_PATH: Path | None = None

SPEC = """\
name = "quartic_batchnorm"
title = "Batch normalization by the fourth central moment"

[layout]
kind = "channels"
reduce = "batch"

[params]
gamma = { role = "scale" }
beta = { role = "shift" }

[options]
eps = { default = 1e-5, min = 0 }

[statistics]
mu = { expr = "mean(x)" }
m4 = { expr = "mean((x - mu)**4)" }
rs = { expr = "(m4 + eps)**(-1/4)" }

[normalized]
name = "xhat"
expr = "(x - mu)*rs"

[output]
y = "gamma*xhat + beta"
"""


def sizes(world):
    """Unequal parts, the last one empty: 5, 3, 4, 0 ... (total > 0)."""
    base = [5, 3, 4, 2, 6]
    return [base[r % len(base)] for r in range(world - 1)] + [0]


def batch(dtype, world, c=3):
    g = torch.Generator().manual_seed(7)
    n = sum(sizes(world))
    x = torch.randn(n, c, 4, 5, generator=g, dtype=torch.float64) * 2 + 0.5
    dy = torch.randn(n, c, 4, 5, generator=g, dtype=torch.float64)
    return x.to(dtype), dy.to(dtype)


def part(t, rank, world):
    s = sizes(world)
    lo = sum(s[:rank])
    return t[lo : lo + s[rank]]


def gather_sum(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def gather_cat(t, world):
    """The processes' parts concatenated in rank order (all_gather of padded parts)."""
    s = sizes(world)
    full = torch.zeros((max(s), *t.shape[1:]), dtype=t.dtype)
    full[: t.shape[0]] = t
    every = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(every, full)
    return torch.cat([e[:n] for e, n in zip(every, s)])


def close(name, a, b, rtol):
    a, b = a.double(), b.double()
    err = ((a - b).abs() / b.abs().clamp_min(1.0)).max().item() if a.numel() else 0.0
    if dist.get_rank() == 0:
        print(f"{name}: max relative difference {err:.2e}", flush=True)
    if not err <= rtol:
        raise AssertionError(f"{name}: {err:.3e} > {rtol}")


def case_batchnorm(rank, world):
    # float32/float64 parts run the C split kernels; a channels-last part the PyTorch target
    for dtype, rtol, fmt in (
        (torch.float64, 1e-12, None),
        (torch.float32, 2e-6, None),
        (torch.float64, 1e-12, torch.channels_last),
    ):
        x, dy = batch(dtype, world)  # the reference: float64 on the same (rounded) values
        ref = nn.BatchNorm2d(3, momentum=0.3).double()
        with torch.no_grad():
            ref.weight.copy_(torch.tensor([1.5, 0.5, -1.0]))
            ref.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        ours = dt.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3, momentum=0.3)))[0].to(dtype)
        ours.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in ref.state_dict().items()})
        assert type(ours) is dt.SyncBatchNorm
        for step in range(2):  # buffers after two updates
            xr = x.double().clone().requires_grad_(True)
            yr = ref(xr)
            yr.backward(dy.double())
            xo = part(x, rank, world).detach().clone()
            if fmt is not None:
                xo = xo.contiguous(memory_format=fmt)
            xo.requires_grad_(True)
            yo = ours(xo)
            yo.backward(part(dy, rank, world))
            dtype_ = f"{dtype}{'' if fmt is None else ' channels_last'}"
            close(f"{dtype_} step {step} y", gather_cat(yo.detach(), world), yr.detach(), rtol)
            close(f"{dtype_} step {step} dx", gather_cat(xo.grad, world), xr.grad, rtol)
            close(f"{dtype_} step {step} dweight", gather_sum(ours.weight.grad), ref.weight.grad, rtol)
            close(f"{dtype_} step {step} dbias", gather_sum(ours.bias.grad), ref.bias.grad, rtol)
            close(f"{dtype_} step {step} running_mean", ours.running_mean, ref.running_mean, rtol)
            close(f"{dtype_} step {step} running_var", ours.running_var, ref.running_var, rtol)
            assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
            for m in (ref, ours):
                m.weight.grad = m.bias.grad = None
        ours.eval()
        ref.eval()
        close(f"{dtype} eval y", ours(part(x, rank, world)), part(ref(x.double()), rank, world), rtol)


def case_spec(rank, world):
    path = SPEC_PATH  # one file for every rank: one build of its kernels (the others wait for it)
    x, dy = batch(torch.float64, world)
    ref = dt.Module(str(path), 3, dtype=torch.float64)
    ours = dt.Module(str(path), 3, sync=True, dtype=torch.float64)
    with torch.no_grad():
        for m in (ref, ours):
            m.gamma.copy_(torch.tensor([1.5, 0.5, -1.0]))
            m.beta.copy_(torch.tensor([0.1, -0.2, 0.3]))
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    yr.backward(dy)
    xo = part(x, rank, world).clone().requires_grad_(True)
    yo = ours(xo)
    yo.backward(part(dy, rank, world))
    close("spec y", gather_cat(yo.detach(), world), yr.detach(), 1e-12)
    close("spec dx", gather_cat(xo.grad, world), xr.grad, 1e-12)
    close("spec dgamma", gather_sum(ours.gamma.grad), ref.gamma.grad, 1e-12)
    close("spec dbeta", gather_sum(ours.beta.grad), ref.beta.grad, 1e-12)


# the zoo's batch layers with tensor inputs beside x: a position mask inside the means, per-(sample,
# channel) and per-element modulations; each process passes its part of every tensor
MULTI = ("masked_batchnorm", "conditional_batchnorm", "spade")


def multi_tensors(name, x, dtype):
    g = torch.Generator().manual_seed(11)
    n, c = x.shape[:2]
    if name == "masked_batchnorm":
        m = (torch.rand(n, 1, *x.shape[2:], generator=g) < 0.7).double()
        m[0] = 1.0
        return {"mask": m.to(dtype)}
    shape = (n, c) if name == "conditional_batchnorm" else tuple(x.shape)
    return {t: (torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 + 1).to(dtype) for t in ("gamma", "beta")}


def case_multi(rank, world):
    for name in MULTI:
        for dtype, rtol, fmt in (
            (torch.float64, 1e-12, None),
            (torch.float32, 2e-6, None),
            (torch.float64, 1e-12, "cl"),
        ):
            x, dy = batch(dtype, world)
            tens = multi_tensors(name, x, dtype)
            ref = dt.Module(name, 3, dtype=dtype)
            ours = dt.Module(name, 3, sync=True, dtype=dtype)
            with torch.no_grad():
                for p in ref.parameters():
                    p.copy_(torch.linspace(0.5, 1.5, p.numel(), dtype=dtype))
                ours.load_state_dict(ref.state_dict())
            grads = name != "masked_batchnorm"
            tr = {k: v.clone().requires_grad_(grads) for k, v in tens.items()}
            xr = x.clone().requires_grad_(True)
            ref(xr, **tr).backward(dy)
            xo = part(x, rank, world).clone()
            if fmt:
                xo = xo.contiguous(memory_format=torch.channels_last)
            xo.requires_grad_(True)
            to = {k: part(v, rank, world).clone().requires_grad_(grads) for k, v in tens.items()}
            yo = ours(xo, **to)
            yo.backward(part(dy, rank, world))
            label = f"{name} {dtype}{' channels_last' if fmt else ''}"
            assert not fmt or yo.is_contiguous(memory_format=torch.channels_last), label
            close(f"{label} y", gather_cat(yo.detach().contiguous(), world), ref(x, **tens).detach(), rtol)
            close(f"{label} dx", gather_cat(xo.grad.contiguous(), world), xr.grad, rtol)
            for k in tens if grads else ():
                close(f"{label} d{k}", gather_cat(to[k].grad, world), tr[k].grad, rtol)
            for (k, p), q in zip(ours.named_parameters(), ref.parameters()):
                close(f"{label} d{k}", gather_sum(p.grad), q.grad, rtol)


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 1),
    ).double()


def train(m, xs, ts):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, t in zip(xs, ts):
        opt.zero_grad()
        ((m(x) - t) ** 2).mean().backward()
        opt.step()


def case_train(rank, world):
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(10, 4 * world, 2, 6, 6, generator=g, dtype=torch.float64)
    ts = torch.randn(10, 4 * world, 1, generator=g, dtype=torch.float64)
    ref = cnn()
    train(ref, xs, ts)
    ours = nn.parallel.DistributedDataParallel(dt.SyncBatchNorm.convert_sync_batchnorm(cnn()))
    train(ours, xs[:, 4 * rank : 4 * rank + 4], ts[:, 4 * rank : 4 * rank + 4])
    mine = ours.module.state_dict()
    for k, v in ref.state_dict().items():
        if v.is_floating_point():
            close(f"train {k}", mine[k], v, 1e-10)
        else:
            assert torch.equal(mine[k], v), k


def case_bad(rank, world, what):
    x, _ = batch(torch.float64, world)
    m = dt.SyncBatchNorm(3).double()
    xo = part(x, rank, world)
    if rank == 1:
        xo = torch.randn(2, 5, 4, 5, dtype=torch.float64) if what == "badshape" else xo.to(torch.float16)
    try:
        m(xo)
    except SyncError as e:
        print(f"rank {rank} raised SyncError: {e}", flush=True)
        return
    raise AssertionError(f"rank {rank}: no error")


def case_raise(rank, world):
    x, _ = batch(torch.float64, world)
    m = dt.SyncBatchNorm(3).double()
    if rank == 1:
        print("rank 1 raising before the layer", flush=True)
        os._exit(3)  # a crash mid-step: no more collectives from here
    try:
        m(part(x, rank, world))
    except Exception as e:  # noqa: BLE001 - gloo: the peer closed the connection, or the timeout
        print(f"rank {rank} got {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        os._exit(0)
    raise AssertionError(f"rank {rank}: no error")


def rank_main(rank, world, port, case):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20 if case == "raise" else 60)
    )
    torch.set_num_threads(1)
    if case == "raise":
        case_raise(rank, world)
    try:
        if case in ("badshape", "baddtype"):
            case_bad(rank, world, case)
        else:
            {"batchnorm": case_batchnorm, "spec": case_spec, "train": case_train, "multi": case_multi}[case](
                rank, world
            )
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    sys.stdout.flush()  # no interpreter teardown with gloo's threads about
    sys.stderr.flush()  # (it can abort: see ddp_driver.py)
    os._exit(0)


def main():
    global SPEC_PATH
    case, world = sys.argv[1], int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if case == "raise":  # rank 1 exits with 3 on purpose; every other rank with 0
        ctx = mp.start_processes(rank_main, args=(world, port, case), nprocs=world, join=False, start_method="fork")
        for p in ctx.processes:
            p.join(120)
        codes = [p.exitcode for p in ctx.processes]
        assert codes == [0 if r != 1 else 3 for r in range(world)], codes
    elif case == "spec":
        with tempfile.TemporaryDirectory() as tmp:
            SPEC_PATH = Path(tmp) / "derivgen_sync_spec.toml"
            SPEC_PATH.write_text(SPEC)
            mp.start_processes(rank_main, args=(world, port, case), nprocs=world, join=True, start_method="fork")
    else:
        if case == "multi":  # built once here (no kernel runs before the fork: libgomp is not fork-safe)
            import derivgen

            for name in MULTI:
                assert derivgen.load(name, backend="c")._kernel.lib is not None
        mp.start_processes(rank_main, args=(world, port, case), nprocs=world, join=True, start_method="fork")
    print(f"{case} with {world} processes: ok")


if __name__ == "__main__":
    main()
