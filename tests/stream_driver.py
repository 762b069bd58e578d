"""Runs every C kernel over a fixed set of inputs and saves every result to an
.npz file (argv[1]). Executed in subprocesses built with different CFLAGS (see
test_streaming.py): the streaming-store, prefetch and tile paths must give
exactly the bits of the plain path."""

import sys

import numpy as np

import derivgen

CASES = {
    # rows of 1024 and 128: the backward's rows in lockstep (8 and a remainder) with a head
    "layernorm": [((5, 1000), (1000,)), ((3, 37), (37,)), ((2, 3, 40), (3, 40)), ((9, 1024), (1024,))],
    "rmsnorm": [((4, 333), (333,)), ((7, 64), (64,)), ((19, 128), (128,))],
    "online_layernorm": [((4, 300), (300,))],
    "batchnorm": [((3, 5, 7, 9), (5,)), ((9, 4, 33), (4,))],
    "instancenorm": [((2, 3, 50), (3,)), ((2, 4, 7, 9), (4,))],
    "groupnorm": [((2, 6, 35), (6,)), ((3, 4, 5, 7), (4,))],
}


def misaligned(a):
    """A C-contiguous copy of ``a`` that starts one element past a 64-byte boundary."""
    buf = np.empty(a.size + 16, a.dtype)
    start = (-buf.ctypes.data % 64) // a.itemsize + 1
    out = buf[start : start + a.size].reshape(a.shape)
    out[...] = a
    return out


rng = np.random.default_rng(7)
results = {}
for name, cases in CASES.items():
    k = derivgen.load(name, backend="c")
    for threads in (1, 2):
        k.set_num_threads(threads)
        for ci, (xs, ps) in enumerate(cases):
            for dtype in (np.float32, np.float64):
                key = f"{name}/{threads}/{ci}/{np.dtype(dtype).name}"
                r = np.random.default_rng([ci, len(name), xs[-1]])
                x = misaligned(r.normal(size=xs).astype(dtype) * 3 + 1)
                dy = misaligned(r.normal(size=xs).astype(dtype))
                params = [misaligned(r.normal(size=ps).astype(dtype)) for _ in k._META["params"]]
                kw = {}
                if name == "groupnorm":
                    kw["num_groups"] = 2
                if name == "online_layernorm":
                    kw.update(
                        alpha=0.3,
                        prev_mean=r.normal(size=xs[:-1]).astype(dtype),
                        prev_std=np.abs(r.normal(size=xs[:-1])).astype(dtype) + 1,
                    )
                modes = [True, False] if name == "batchnorm" else [None]
                for training in modes:
                    kk = dict(kw)
                    if training is not None:
                        kk.update(training=training, running_mean=np.zeros(ps, dtype), running_var=np.ones(ps, dtype))
                    y = misaligned(np.zeros(xs, dtype))
                    _, cache = k.forward(x, *params, out=y, **kk)
                    grads = k.backward(dy, cache)
                    tag = f"{key}/{training}"
                    results[f"{tag}/y"] = y.copy()
                    for field, value in grads._asdict().items():
                        results[f"{tag}/{field}"] = np.asarray(value).copy()

# the extras library through derivgen.torch: bfloat16 rows (the lockstep backward, streamed
# from registers as integer vectors) and channels-last batch, group and instance norm (the
# NHWC kernels)
import os

try:
    import torch
except ImportError:
    torch = None
if os.environ.get("STREAM_TORCH") == "1":
    if torch is None:
        raise SystemExit("STREAM_TORCH=1 needs torch")
    import derivgen.torch as dtorch

    TORCH_CASES = [
        ("layernorm", (19, 256), 256, torch.bfloat16, False),
        ("layernorm", (9, 1000), 1000, torch.bfloat16, False),
        ("rmsnorm", (11, 1024), 1024, torch.bfloat16, False),
        ("batchnorm", (3, 8, 5, 7), 8, torch.bfloat16, False),
        ("batchnorm", (3, 8, 5, 7), 8, torch.float32, True),
        ("groupnorm", (2, 8, 9, 5), 8, torch.bfloat16, True),
        # channels last, a channel per group: rows staged and streamed, a whole chunk of 256
        # positions lane by lane, 70 channels (a block of 64 and 6)
        ("instancenorm", (2, 70, 16, 17), 70, torch.float32, True),
        ("instancenorm", (1, 8, 16, 17), 8, torch.bfloat16, True),
    ]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for ci, (name, xs, size, dtype, cl) in enumerate(TORCH_CASES):
            g = torch.Generator().manual_seed(ci)
            m = dtorch.Module(name, size, **({"num_groups": 2} if name == "groupnorm" else {}))
            with torch.no_grad():
                for p in m.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
            m = m.to(dtype)
            x = (torch.randn(xs, generator=g) * 3 + 1).to(dtype)
            dy = torch.randn(xs, generator=g).to(dtype)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
                dy = dy.contiguous(memory_format=torch.channels_last)
            x.requires_grad_(True)
            y = m(x)
            y.backward(dy)
            tag = f"torch/{threads}/{ci}"
            results[f"{tag}/y"] = y.detach().float().numpy().copy()
            results[f"{tag}/dx"] = x.grad.float().numpy().copy()
            for pn, p in m.named_parameters():
                results[f"{tag}/d{pn}"] = p.grad.float().numpy().copy()
np.savez(sys.argv[1], **results)
print(f"saved {len(results)} arrays", flush=True)
