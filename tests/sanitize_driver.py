"""Runs every C kernel over the shape and edge-case matrix; executed in a
subprocess whose C is built with -fsanitize=address,undefined (see
test_sanitizers.py), so any memory or UB fault aborts that process."""

import sys

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
    lib.rmsnorm_train_forward_f32(ctypes.c_int64(4), ctypes.c_int64(1), ctypes.c_int64(8), ctypes.c_int64(1),
                                  p[0], p[1], ctypes.c_double(1e-6), p[2], p[3], p[4], ctypes.c_int(1))
    print("no fault detected")
    sys.exit(0)

SHAPES = {
    "layernorm": [((1, 1), (1,)), ((3, 7), (7,)), ((2, 3, 5), (3, 5)), ((17,), (17,)), ((5, 1, 33), (33,))],
    "rmsnorm": [((1, 1), (1,)), ((4, 9), (9,)), ((2, 2, 3), (2, 3))],
    "online_layernorm": [((1, 2), (2,)), ((4, 9), (9,)), ((2, 3, 5), (5,))],
    "batchnorm": [((2, 1), (1,)), ((3, 4), (4,)), ((2, 3, 5), (3,)), ((1, 2, 3, 3), (2,)), ((5, 3, 1, 1), (3,))],
    "instancenorm": [((1, 1, 2), (1,)), ((2, 3, 5), (3,)), ((2, 2, 3, 3), (2,)), ((3, 4, 2), (4,))],
    "groupnorm": [((1, 2, 2), (2,)), ((2, 6, 5), (6,)), ((2, 4, 3, 3), (4,)), ((3, 6), (6,))],
}

for name, shapes in SHAPES.items():
    k = derivgen.load(name, backend="c")
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
                    params = [rng.normal(size=ps).astype(dtype) for _ in range(1 if name == "rmsnorm" else 2)]
                    kw = {}
                    if name == "groupnorm":
                        kw["num_groups"] = 2 if xs[1] % 2 == 0 else 1
                    if name == "online_layernorm":
                        lead = xs[:-1]
                        kw.update(alpha=0.4, prev_mean=rng.normal(size=lead).astype(dtype),
                                  prev_std=np.abs(rng.normal(size=lead)).astype(dtype) + 1)
                    if variant == "eps0" and name != "online_layernorm":
                        kw["eps"] = 0.0
                    modes = [True, False] if name == "batchnorm" else [None]
                    for training in modes:
                        kk = dict(kw)
                        if training is not None:
                            kk.update(training=training, running_mean=np.zeros(ps, dtype), running_var=np.ones(ps, dtype))
                        y, c = k.forward(x, *params, **kk)
                        g = k.backward(rng.normal(size=xs).astype(dtype), c)
                        count += 1
print(f"ran {count} forward/backward pairs", flush=True)
sys.exit(0)
