"""Runs every C kernel over the shape and edge-case matrix; executed in a
subprocess whose C is built with -fsanitize=address,undefined (see
test_sanitizers.py), so any memory or UB fault aborts that process."""

import sys
import tempfile
from pathlib import Path

import numpy as np

import derivgen

rng = np.random.default_rng(0)
count = 0

if "--out-of-bounds" in sys.argv:
    # negative control: claim 4 rows where x has 3; the sanitizer must abort
    import ctypes

    k = derivgen.load("rmsnorm", backend="c")
    lib = k._kernel.lib
    x = np.ones((3, 8), np.float32)
    y = np.empty((4, 8), np.float32)
    g = np.ones(8, np.float32)
    st = [np.empty(4) for _ in range(2)]
    p = [ctypes.c_void_p(a.ctypes.data) for a in (x, g, y, *st)]
    lib.rmsnorm_train_forward_f32(
        ctypes.c_int64(4),
        ctypes.c_int64(1),
        ctypes.c_int64(8),
        ctypes.c_int64(1),
        p[0],
        p[1],
        ctypes.c_double(1e-6),
        p[2],
        p[3],
        p[4],
        ctypes.c_int(1),
    )
    print("no fault detected")
    sys.exit(0)

# Block statistics (block passes into the threads' scratch; with --blocks): instance blocks of
# a batch group (a channel: G = C groups, whose split kernels run below too), and all three
# kinds in the whole-tensor group, nested (a sample variance about the instance means)
BLOCK_SPECS = {
    "blocks_in_batch": (
        "batch",
        ['mu = "mean(x)"', "im = \"mean(x, 'instance')\"", "iv = \"mean((x - im)**2, 'instance')\""],
        "gamma*x/maximum(sqrt(iv + eps), 0.5) + beta*(x - mu)",
    ),
    "blocks_of_all_kinds": (
        "all",
        [
            "a = \"mean(x, 'instance')\"",
            "b = \"mean(x, 'sample')\"",
            "c = \"mean(x, 'batch')\"",
            "v = \"mean((x - a)**2, 'sample')\"",
        ],
        "gamma*(x - a)/sqrt(v + eps) + beta*(b - c)",
    ),
}
BLOCK_PATHS = {}
_blockdir = Path(tempfile.mkdtemp())
for _name, (_reduce, _stats, _y) in BLOCK_SPECS.items() if "--blocks" in sys.argv else ():
    BLOCK_PATHS[_name] = _blockdir / f"{_name}.toml"
    BLOCK_PATHS[_name].write_text(
        f"""name = "{_name}"
title = "{_name}"
[layout]
kind = "channels"
reduce = "{_reduce}"
[params]
gamma = {{ role = "scale" }}
beta = {{ role = "shift" }}
[options]
eps = {{ default = 1e-5, min = 0 }}
[statistics]
{chr(10).join(_stats)}
[output]
y = "{_y}"
"""
    )

SHAPES = {
    "layernorm": [((1, 1), (1,)), ((3, 7), (7,)), ((2, 3, 5), (3, 5)), ((17,), (17,)), ((5, 1, 33), (33,))],
    "rmsnorm": [((1, 1), (1,)), ((4, 9), (9,)), ((2, 2, 3), (2, 3))],
    "prmsnorm": [((1, 1), (1,)), ((4, 9), (9,)), ((3, 40), (40,))],  # leading(p): a position mask
    "online_layernorm": [((1, 2), (2,)), ((4, 9), (9,)), ((2, 3, 5), (5,))],
    # (1, 3, 16, 17): 272 positions, a whole chunk of 256 that the channels-last sums take lane by lane
    "batchnorm": [
        ((2, 1), (1,)),
        ((3, 4), (4,)),
        ((2, 3, 5), (3,)),
        ((1, 2, 3, 3), (2,)),
        ((5, 3, 1, 1), (3,)),
        ((1, 3, 16, 17), (3,)),
    ],
    # (1, 3, 16, 17): a whole chunk of 256 positions that the channels-last sums take lane by lane
    "instancenorm": [
        ((1, 1, 2), (1,)),
        ((2, 3, 5), (3,)),
        ((2, 2, 3, 3), (2,)),
        ((3, 4, 2), (4,)),
        ((1, 3, 16, 17), (3,)),
    ],
    "groupnorm": [((1, 2, 2), (2,)), ((2, 6, 5), (6,)), ((2, 4, 3, 3), (4,)), ((3, 6), (6,))],
    # a position layout: blocks of positions shorter than, equal to and longer than the block
    "layernorm2d": [((1, 1, 1), (1,)), ((2, 3, 5), (3,)), ((2, 5, 3, 3), (5,)), ((3, 4), (4,)), ((2, 3, 70), (3,))],
    # window(x**2, size): neighbours past the group's ends, windows wider than the group
    "lrn": [((1, 1, 1), ()), ((2, 3, 5), ()), ((2, 7, 3, 3), ()), ((3, 4), ())],
}
BLOCK_SHAPES = {
    "blocks_in_batch": [((2, 1), (1,)), ((3, 4), (4,)), ((2, 3, 37), (3,)), ((1, 2, 3, 3), (2,))],
    "blocks_of_all_kinds": [((1, 1, 1), (1,)), ((2, 3, 5), (3,)), ((2, 3, 2, 2), (3,)), ((3, 4), (4,))],
}
SHAPES.update({n: s for n, s in BLOCK_SHAPES.items() if n in BLOCK_PATHS})
N_PARAMS = {"rmsnorm": 1, "prmsnorm": 1, "lrn": 0}
# layers with tensor inputs whose channels-last kernels run below: a position mask inside the
# means, tensors of x's shape (one read only by the forward); (2, 3, 16, 17): whole chunks of lanes
MULTI_NHWC = {
    "masked_batchnorm": [(1, 1, 2, 3), (3, 2, 5, 1), (2, 3, 16, 17)],
    # per-(sample, channel) tensors read at their own shape, their gradients summed per run
    "conditional_batchnorm": [(1, 1, 2, 3), (3, 2, 5, 1), (2, 3, 16, 17)],
    "spade": [(1, 2, 1, 3), (2, 3, 16, 17)],
}


def _prebuild() -> None:
    """Compile every library this run loads (the kernels, and the extras of those that have
    them) two at a time: the sanitized compiles are most of the run's time, one core each."""
    from concurrent.futures import ThreadPoolExecutor

    from derivgen.runtime.build import build_shared

    jobs = []
    for name in SHAPES:
        kernel = derivgen.load(BLOCK_PATHS.get(name, name), backend="c")._kernel
        jobs += [(kernel.source, None), (kernel.source, ["-DDG_SECOND_ONLY"])]
        if not kernel.meta.inputs:
            jobs.append((kernel.source, ["-DDG_EXTRAS_ONLY"]))
    for name in MULTI_NHWC:
        kernel = derivgen.load(name, backend="c")._kernel
        jobs += [(kernel.source, None), (kernel.source, ["-DDG_EXTRAS_ONLY"])]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda job: build_shared(job[0], extra=job[1]), jobs))


_prebuild()

for name, shapes in SHAPES.items():
    k = derivgen.load(BLOCK_PATHS.get(name, name), backend="c")
    for threads in (1, 2):
        k.set_num_threads(threads)
        for xs, ps in shapes:
            for dtype in (np.float32, np.float64):
                for variant in ("plain", "strided", "nan", "eps0"):
                    x = rng.normal(size=xs).astype(dtype)
                    if variant == "strided":
                        x = np.repeat(x, 2, axis=-1)[..., ::2]
                    if variant == "nan":
                        x.flat[0] = np.nan
                    params = [rng.normal(size=ps).astype(dtype) for _ in range(N_PARAMS.get(name, 2))]
                    kw = {"p": 0.5} if name == "prmsnorm" else {"size": 4, "alpha": 0.5} if name == "lrn" else {}
                    if k._META["reduce"] == "group":
                        kw["num_groups"] = 2 if xs[1] % 2 == 0 else 1
                    if name == "online_layernorm":
                        lead = xs[:-1]
                        kw.update(
                            alpha=0.4,
                            prev_mean=rng.normal(size=lead).astype(dtype),
                            prev_std=np.abs(rng.normal(size=lead)).astype(dtype) + 1,
                        )
                    if variant == "eps0" and name not in ("online_layernorm", "lrn"):
                        kw["eps"] = 0.0
                    modes = [True, False] if name == "batchnorm" else [None]
                    for training in modes:
                        kk = dict(kw)
                        if training is not None:
                            kk.update(
                                training=training, running_mean=np.zeros(ps, dtype), running_var=np.ones(ps, dtype)
                            )
                        y, c = k.forward(x, *params, **kk)
                        dy = rng.normal(size=xs).astype(dtype)
                        g = k.backward(dy, c)
                        # second order: every seed given (inputs too), and none
                        seeds = {"ddinputs": {i: np.ones_like(kk[i]) for i in ("prev_mean", "prev_std") if i in kk}}
                        k.backward_backward(dy, c, dy, [np.ones_like(p) for p in params], **seeds)
                        k.backward_backward(dy, c)
                        k.jvp(
                            c,
                            dy,
                            [np.ones_like(p) for p in params],
                            tinputs={i: np.ones_like(kk[i]) for i in ("prev_mean", "prev_std") if i in kk},
                        )
                        count += 1

# The extras library (-DDG_EXTRAS_ONLY: bfloat16 kernels, and the channels-last kernels of
# the channel layouts), called as derivgen.torch calls them, without torch: NHWC arrays are
# NumPy arrays laid out (N, *spatial, C), bfloat16 ones uint16. The channels-last results
# must be the NCHW kernels' bits.
import os

from derivgen.runtime import resolve_layout
from derivgen.runtime.build import user_cflags
from derivgen.runtime.cbind import CKernel


def ptr(a):
    return None if a is None else a.ctypes.data


def run_pair(kern, meta, mode, sfx, L, x, dy, params, opts, bufs, threads):
    """forward + backward of one kernel pair; returns (y, stats, dx, dparams)."""
    n_st = len(meta["stats"][mode])
    st = [np.empty(L.n_groups) for _ in range(n_st)]
    y = np.empty_like(x)
    b = [bufs.get(k) for k in meta["buffers"]]
    assert (
        kern.cfunc(mode, "forward", sfx)(
            L.O, L.G, L.Cg, L.S, ptr(x), *map(ptr, params), *opts, *map(ptr, b), ptr(y), *map(ptr, st), threads
        )
        == 0
    )
    dx = np.empty_like(x)
    dps = [np.empty_like(p) for p in params]
    assert (
        kern.cfunc(mode, "backward", sfx)(
            L.O,
            L.G,
            L.Cg,
            L.S,
            ptr(x),
            ptr(dy),
            *map(ptr, params),
            *opts,
            *map(ptr, st),
            ptr(dx),
            *map(ptr, dps),
            threads,
        )
        == 0
    )
    return y, st, dx, dps


extras = 0
for name, shapes in SHAPES.items():
    k = derivgen.load(BLOCK_PATHS.get(name, name), backend="c")
    meta = k._META
    if meta["inputs"]:
        continue  # online layer norm: bfloat16 covered by the torch tests
    flags = os.environ.get("CFLAGS")
    ext = CKernel(meta, k._kernel.source, cflags=None if flags is None else user_cflags(), extra=["-DDG_EXTRAS_ONLY"])
    for xs, ps in shapes:
        groups = (2 if xs[1] % 2 == 0 else 1) if meta["reduce"] == "group" else None
        x64 = rng.normal(size=xs)
        L = resolve_layout(meta, x64, {p: np.empty(ps) for p in meta["params"]}, groups)
        for mode in meta["modes"]:
            opts = [4.0 if o == "size" else 0.1 if o == "momentum" else 1e-5 for o in meta["options"]]
            bufs = {"running_mean": rng.normal(size=ps), "running_var": rng.random(ps) + 0.5} if meta["buffers"] else {}
            for threads in (1, 2):
                # bfloat16, NCHW
                xb = (x64.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
                pb = [
                    (rng.normal(size=ps).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
                    for _ in meta["params"]
                ]
                bb = {kk: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) for kk, v in bufs.items()}
                run_pair(ext, meta, mode, "bf16", L, xb, xb.copy(), pb, opts, bb, threads)
                extras += 1
                # S == 1: the layouts coincide (NCHW kernels); a position layout and block
                # statistics have no channels-last kernels
                if meta["layout"] != "channels" or meta["reduce"] == "position" or meta.get("blocks") or L.S == 1:
                    continue
                for dtype, sfx in ((np.float32, "f32"), (np.float64, "f64")):
                    x = x64.astype(dtype)
                    dy = rng.normal(size=xs).astype(dtype)
                    params = [rng.normal(size=ps).astype(dtype) for _ in meta["params"]]
                    bd = {kk: v.astype(dtype) for kk, v in bufs.items()}
                    ref = run_pair(k._kernel, meta, mode, sfx, L, x, dy, params, opts, bd, threads)
                    nhwc = lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))
                    got = run_pair(ext, meta, mode, "nhwc_" + sfx, L, nhwc(x), nhwc(dy), params, opts, bd, threads)
                    assert np.array_equal(np.moveaxis(got[0], -1, 1), ref[0], equal_nan=True), (name, xs, sfx)
                    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got[1], ref[1]))
                    assert np.array_equal(np.moveaxis(got[2], -1, 1), ref[2], equal_nan=True), (name, xs, sfx)
                    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got[3], ref[3]))
                    extras += 1
# The split-reduction kernels of the batch layout (train mode), over parts of the batch
# (one of them empty), against the one-piece kernels
splits = 0
for name, xs, ps in [(n, xs, ps) for n in ("batchnorm", "blocks_in_batch") if n in SHAPES for xs, ps in SHAPES[n]]:
    k = derivgen.load(BLOCK_PATHS.get(name, name), backend="c")
    meta = k._META
    for dtype, sfx in ((np.float32, "f32"), (np.float64, "f64")):
        x = rng.normal(size=xs).astype(dtype)
        dy = rng.normal(size=xs).astype(dtype)
        params = [rng.normal(size=ps).astype(dtype) for _ in meta["params"]]
        opts = [1e-5 if o == "eps" else default for o, (default, _, _) in meta["options"].items()]
        L = resolve_layout(meta, x, {p: np.empty(ps) for p in meta["params"]}, None)
        for threads in (1, 2):
            ref = run_pair(k._kernel, meta, "train", sfx, L, x, dy, params, opts, {}, threads)
            cut = xs[0] // 2
            parts = [(x[:cut], dy[:cut]), (x[cut:], dy[cut:])]
            Ls = [
                L.__class__(
                    O=p[0].shape[0],
                    G=L.G,
                    Cg=L.Cg,
                    S=L.S,
                    per_sample=False,
                    x_shape=p[0].shape,
                    param_shape=L.param_shape,
                    group_shape=L.group_shape,
                )
                for p in parts
            ]
            fn = {
                kind: k._kernel.split_cfunc(kind, sfx) for kind in ("partial", "finish", "apply", "bpartial", "bapply")
            }
            n = float(L.group_size)
            stats = np.zeros((len(meta["stats"]["train"]), L.n_groups))
            for level, nsums in enumerate(meta["split"]["levels"]):
                total = np.zeros((nsums, L.n_groups))
                for (xp, _), Lp in zip(parts, Ls):
                    sums = np.zeros((nsums, L.n_groups))
                    assert (
                        fn["partial"](
                            Lp.O,
                            Lp.G,
                            Lp.Cg,
                            Lp.S,
                            ptr(np.ascontiguousarray(xp)),
                            *map(ptr, params),
                            *opts,
                            level,
                            ptr(stats),
                            n,
                            ptr(sums),
                            threads,
                        )
                        == 0
                    )
                    total += sums
                assert (
                    fn["finish"](L.O, L.G, L.Cg, L.S, *map(ptr, params), *opts, level, ptr(total), n, ptr(stats)) == 0
                )
            assert all(np.allclose(stats[i], ref[1][i], rtol=1e-12, atol=1e-12) for i in range(len(ref[1])))
            bsum = np.zeros((meta["split"]["backward"], L.n_groups))
            ys, dxs, dps = [], [], np.zeros((len(params), *ps))
            for j, ((xp, dp), Lp) in enumerate(zip(parts, Ls)):
                xp, dp = np.ascontiguousarray(xp), np.ascontiguousarray(dp)
                y = np.empty_like(xp)
                assert (
                    fn["apply"](
                        Lp.O, Lp.G, Lp.Cg, Lp.S, ptr(xp), *map(ptr, params), *opts, ptr(stats), n, ptr(y), threads
                    )
                    == 0
                )
                ys.append(y)
                sums = np.zeros_like(bsum)
                assert (
                    fn["bpartial"](
                        Lp.O,
                        Lp.G,
                        Lp.Cg,
                        Lp.S,
                        ptr(xp),
                        ptr(dp),
                        *map(ptr, params),
                        *opts,
                        ptr(stats),
                        n,
                        ptr(sums),
                        threads,
                    )
                    == 0
                )
                bsum += sums
            for j, ((xp, dp), Lp) in enumerate(zip(parts, Ls)):
                xp, dp = np.ascontiguousarray(xp), np.ascontiguousarray(dp)
                dx = np.empty_like(xp)
                d = [np.empty_like(p) for p in params]
                if Lp.O:
                    assert (
                        fn["bapply"](
                            Lp.O,
                            Lp.G,
                            Lp.Cg,
                            Lp.S,
                            ptr(xp),
                            ptr(dp),
                            *map(ptr, params),
                            *opts,
                            ptr(stats),
                            ptr(bsum),
                            n,
                            int(j == 0),
                            ptr(dx),
                            *map(ptr, d),
                            threads,
                        )
                        == 0
                    )
                    dps += np.array(d, dtype=np.float64)
                dxs.append(dx)
            tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-12}
            assert np.allclose(np.concatenate(ys), ref[0], **tol), (xs, sfx)
            assert np.allclose(np.concatenate(dxs), ref[2], **tol), (xs, sfx)
            assert all(np.allclose(a, b, **tol) for a, b in zip(dps, ref[3])), (xs, sfx)
            splits += 1
# Layers with tensor inputs beside x and outputs beside y (the zoo's): odd shapes, 1 and 2
# threads, both dtypes, every cotangent given and none
MULTI_SHAPES = {
    "add_rmsnorm": [(1, 1), (3, 7), (2, 3, 33)],
    "flash_layernorm_parallel": [(1, 2), (4, 9), (2, 2, 17)],
    # (2, 130, 5): a sample's rows in two units of DG_SAMPLE_ROWS, the last not whole DG_ROWS
    "adaln": [(1, 1, 3), (2, 3, 7), (3, 1, 33), (2, 130, 5)],
    "masked_batchnorm": [(1, 1, 2), (3, 2, 5), (2, 3, 37)],
    "conditional_batchnorm": [(1, 1, 2), (3, 2, 5), (2, 3, 37)],
}
multi = 0
for name, shapes in MULTI_SHAPES.items():
    k = derivgen.load(name, backend="c")
    spec = derivgen.load_spec(name)
    for threads in (1, 2):
        k.set_num_threads(threads)
        for xs in shapes:
            for dtype in (np.float32, np.float64):
                x = rng.normal(size=xs).astype(dtype)
                ts = []
                for t in spec.tensors:
                    shape = {"x": xs, "sample": (xs[0], xs[-1]) if spec.layout == "trailing" else xs[:2]}.get(
                        t.shape, (xs[0], 1, *xs[2:])
                    )
                    v = rng.normal(size=shape).astype(dtype)
                    if t.mask:
                        v = (v > -0.5).astype(dtype)
                        v.reshape(-1)[0] = 1
                    ts.append(v)
                ps = [
                    rng.normal(size=(xs[-1] if spec.layout == "trailing" else xs[1],)).astype(dtype)
                    for _ in spec.params
                ]
                outs, c = k.forward(x, *ts, *ps)
                dy = rng.normal(size=xs).astype(dtype)
                k.backward(dy, c)
                k.backward(dy, c, **{"d" + o.name: np.ones_like(x) for o in spec.outputs})
                multi += 1
# Their channels-last kernels (the extras library), called as derivgen.torch calls them: every
# array of x's shape (x, the tensors of x's shape, dy) laid out (N, *spatial, C), a
# per-(sample, channel) tensor and its gradient (N, C) and a per-position one (N, 1, *spatial)
# in both; the results must be the NCHW kernels' bits
for name, shapes in MULTI_NHWC.items():
    k = derivgen.load(name, backend="c")
    meta, spec = k._META, derivgen.load_spec(name)
    flags = os.environ.get("CFLAGS")
    ext = CKernel(meta, k._kernel.source, cflags=None if flags is None else user_cflags(), extra=["-DDG_EXTRAS_ONLY"])
    nhwc = lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))
    for xs in shapes:
        for dtype, sfx in ((np.float32, "f32"), (np.float64, "f64")):
            x = rng.normal(size=xs).astype(dtype)
            dy = rng.normal(size=xs).astype(dtype)
            # the tensors read at their own shape, and those whose gradients the kernel sums
            native, own = (
                {t.name: t.shape != "x" for t in spec.tensors},
                {t.name: t.shape == "sample" for t in spec.tensors},
            )
            full = []
            for t in spec.tensors:
                if own[t.name]:
                    full.append(rng.normal(size=xs[:2]).astype(dtype))
                    continue
                v = rng.normal(size=xs if t.shape == "x" else (xs[0], 1, *xs[2:])).astype(dtype)
                if t.mask:
                    v = (v > -0.5).astype(dtype)
                    v.reshape(-1)[0] = 1
                full.append(v)
            params = [rng.normal(size=(xs[1],)).astype(dtype) for _ in spec.params]
            L = resolve_layout(meta, x, {p: np.empty(xs[1]) for p in meta["params"]}, None)
            for threads in (1, 2):
                res = []
                for kern, pre, lay in ((k._kernel, "", lambda a: a), (ext, "nhwc_", nhwc)):
                    xl, dyl = lay(x), lay(dy)  # kept alive over the calls
                    fl = [t if native[s.name] else lay(t) for s, t in zip(spec.tensors, full)]
                    y, dx = np.empty_like(xl), np.empty_like(xl)
                    dts = [np.empty(xs[:2], dtype) if own[t.name] else np.empty_like(xl) for t in spec.grad_tensors]
                    st = [np.empty(L.n_groups) for _ in meta["stats"]["train"]]
                    dps = [np.empty_like(p) for p in params]
                    common = {"dims": (L.O, L.G, L.Cg, L.S), "x": (ptr(xl),), "params": [ptr(p) for p in params]}
                    common.update(tensors=[ptr(t) for t in fl], options=[1e-5], nthreads=(threads,))
                    fsig, bsig = kern.signatures[("train", "forward")], kern.signatures[("train", "backward")]
                    fw = fsig.pack({**common, "y": (ptr(y),), "stats": [ptr(a) for a in st]})
                    assert kern.cfunc("train", "forward", pre + sfx)(*fw) == 0
                    bw = {**common, "dy": (ptr(dyl),), "stats": [ptr(a) for a in st], "dparams": [ptr(a) for a in dps]}
                    bw["dx"] = (ptr(dx), *(ptr(a) for a in dts))
                    assert kern.cfunc("train", "backward", pre + sfx)(*bsig.pack(bw)) == 0
                    back = (lambda a: np.moveaxis(a, -1, 1)) if pre else (lambda a: a)
                    tb = [a if own[t.name] else back(a) for t, a in zip(spec.grad_tensors, dts)]
                    res.append([back(y), *st, back(dx), *tb, *dps])
                assert all(np.array_equal(a, b) for a, b in zip(*res)), (name, xs, sfx, threads)
                extras += 1
# Their split kernels (masked_batchnorm: a mask inside the means; spade: tensors of x's shape
# with gradients; conditional_batchnorm: per-(sample, channel) ones), through the C binding's split functions, in parts of 2, 0 and 1 samples
for name in MULTI_NHWC:
    k = derivgen.load(name, backend="c")
    spec = derivgen.load_spec(name)
    for dtype in (np.float32, np.float64):
        xs = (3, 2, 5, 3)
        x, dy = rng.normal(size=xs).astype(dtype), rng.normal(size=xs).astype(dtype)
        tens = {}
        for t in spec.tensors:
            shape = {"x": xs, "sample": xs[:2]}.get(t.shape, (xs[0], 1, *xs[2:]))
            v = rng.normal(size=shape).astype(dtype)
            tens[t.name] = (v > -0.5).astype(dtype) if t.mask else v
        params = [rng.normal(size=(xs[1],)).astype(dtype) for _ in spec.params]
        cuts = [(0, 2), (2, 2), (2, 3)]
        parts = [(x[a:b], dy[a:b], {t: v[a:b] for t, v in tens.items()}) for a, b in cuts]
        total, stats = xs[0] * xs[2] * xs[3], None
        for level in range(k.SPLIT_LEVELS):
            sums = sum(k.split_partial(level, p, params, stats=stats, tensors=t) for p, _, t in parts)
            stats = k.split_finish(level, sums, total, params, stats=stats)
        for p, d, t in parts:
            k.split_apply(p, params, stats, total, tensors=t)
        bsums = sum(k.split_backward_partial(d, p, params, stats, total, tensors=t) for p, d, t in parts)
        for j, (p, d, t) in enumerate(parts):
            k.split_backward_apply(d, p, params, stats, bsums, total, group_terms=j == 0, tensors=t)
        splits += 1
print(
    f"ran {count} forward/backward pairs, {extras} of the extras (bfloat16, channels-last), {splits} split reductions"
    f", {multi} layers with tensor inputs",
    flush=True,
)
sys.exit(0)
