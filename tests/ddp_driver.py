"""Run by tests/torch/test_torch_ddp.py in a subprocess of its own: a model with derivgen norms
(LayerNorm, RMSNorm, GroupNorm: no batch statistics) trained under DistributedDataParallel
with the gloo backend on WORLD processes, each on its share of the batch, against the same
model trained in one process on the whole batch. Prints the largest relative difference
of any parameter; exits non-zero on any failure."""

import gc
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import derivgen.torch as dt

STEPS = 8


def model():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Linear(6, 8),
        nn.LayerNorm(8),
        nn.GELU(),
        nn.Linear(8, 12),
        nn.RMSNorm(12),
        nn.Unflatten(1, (4, 3)),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(12, 1),
    ).double()
    return dt.convert(m)


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 8, 6, generator=g, dtype=torch.float64), torch.randn(
        STEPS, 8, 1, generator=g, dtype=torch.float64
    )


def train(m, xs, ts):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, t in zip(xs, ts):
        opt.zero_grad()
        ((m(x) - t) ** 2).mean().backward()
        opt.step()


def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = nn.parallel.DistributedDataParallel(model())
    xs, ts = data()
    per = xs.shape[1] // world
    train(m, xs[:, rank * per : (rank + 1) * per], ts[:, rank * per : (rank + 1) * per])
    if rank == 0:
        torch.save(m.module.state_dict(), out)
    dist.barrier()
    # End the rank without interpreter teardown: DDP's reducer holds the process group, and a gloo
    # group destroyed during finalization can abort ("terminate called without an active
    # exception", SIGABRT; seen once in CI). Drop the model, destroy the group, exit at once.
    del m
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    world = int(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ddp.pt")
        mp.spawn(rank_main, args=(world, port, out), nprocs=world, join=True)
        got = torch.load(out)
    ref = model()
    train(ref, *data())
    worst = 0.0
    for k, v in ref.state_dict().items():
        worst = max(worst, ((got[k] - v).abs() / v.abs().clamp_min(1e-12)).max().item())
    print(f"max relative difference {worst:.3e}")
    sys.exit(0 if worst < 1e-10 else 1)


if __name__ == "__main__":
    main()
