"""``derivgen bench --jax``: jitted forward + backward of derivgen.jax against Flax's own layers
on the CPU, side by side (a tool: it uses derivgen.jax, it is not part of it).

Each case times one jitted function returning y and the gradients of x and the parameters
for a cotangent dy: derivgen.jax's function (a ``custom_jvp`` over the derived JVP, reverse
mode by JAX's transposition), the same with ``rule="vjp"`` (a ``custom_vjp`` over the
derived closed-form backward), and ``flax.nnx``'s layer (JAX's autodiff of Flax's forward),
all on the same arrays (BatchNorm channels last, as Flax takes it). Medians of repeated runs
after warm-up; the ratio is derivgen / Flax.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from derivgen.runtime.machine import machine

CASES = [
    ("LayerNorm", "layernorm", (8192, 1024)),
    ("BatchNorm", "batchnorm", (32, 56, 56, 64)),  # 32x64x56x56 in Flax's channels-last order
]


def _round_robin_ms(fns: dict[str, Callable[[], object]], repeat: int, warmup: int = 2) -> dict[str, float]:
    """Median milliseconds of each function, timed in turn (one run of each per round, the order
    rotating), so that a busy machine's drift reaches every implementation alike."""
    import jax  # optional dependency

    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for k in range(repeat):
        for n in names[k % len(names) :] + names[: k % len(names)]:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[n]())
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def _steps(cls: str, layer: str, shape: tuple, dtype: str) -> tuple[dict, tuple]:
    """The jitted fwd+bwd steps of one case by implementation, and their arguments."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import derivgen.jax as dj

    rng = np.random.default_rng(0)
    c = shape[-1]
    x = jnp.asarray(rng.normal(0.3, 1.2, shape), dtype)
    dy = jnp.asarray(rng.normal(size=shape), dtype)
    scale = jnp.asarray(rng.normal(1.0, 0.2, c), dtype)
    bias = jnp.asarray(rng.normal(0.0, 0.2, c), dtype)
    eps = 1e-5
    kw = {"channels_last": True} if layer == "batchnorm" else {}
    module = getattr(nnx, cls)(c, epsilon=eps, param_dtype=dtype, rngs=nnx.Rngs(0))
    module.scale[...], module.bias[...] = scale, bias
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def step(forward):
        def run(x, scale, bias, dy):
            y, back = jax.vjp(forward, x, scale, bias)
            return y, back(dy)

        return jax.jit(run)

    def flax_step(x, scale, bias, dy):
        del scale, bias

        def forward(x, params, rest):  # the running averages are updated, on a copy, as in training
            return nnx.merge(graphdef, params, rest)(x)

        y, back = jax.vjp(forward, x, params, rest)
        return y, back(dy)[:2]

    steps = {
        "derivgen.jax (transposed JVP)": step(lambda x, s, b: dj.function(layer)(x, s, b, eps=eps, **kw)),
        "derivgen.jax rule=vjp (derived VJP)": step(
            lambda x, s, b: dj.function(layer, rule="vjp")(x, s, b, eps=eps, **kw)
        ),
        "flax.nnx": jax.jit(flax_step),
    }
    return steps, (x, scale, bias, dy)


def run_jax_bench(repeat: int = 15, dtype: str = "float32", progress: Callable[[str], None] | None = None) -> dict:
    """Every case's implementations timed in one process; results and the machine, as data."""
    import jax

    results = []
    for cls, layer, shape in CASES:
        steps, args = _steps(cls, layer, shape, dtype)
        got = _round_robin_ms({impl: (lambda fn=fn, args=args: fn(*args)) for impl, fn in steps.items()}, repeat)
        if progress:
            for impl in steps:
                progress(f"{cls} {impl}")
        flax_ms = got["flax.nnx"]
        for impl, ms in got.items():
            results.append({"layer": cls, "shape": list(shape), "impl": impl, "step_ms": ms, "vs_flax": ms / flax_ms})
    return {
        "machine": machine().as_dict(),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "dtype": dtype,
        "repeat": repeat,
        "results": results,
    }


def format_jax_report(report: dict) -> str:
    """The report as text: the machine, then one row per case and implementation."""
    m = report["machine"]
    head = (
        f"machine: {m['cpu']}; {m['cores']} core(s); JAX {report['jax']} on {', '.join(report['devices'])}; "
        f"{report['dtype']}; jitted y and the gradients of x, scale and bias (median of {report['repeat']})"
    )
    lines = [head, ""]
    rows = [
        (r["layer"], "x".join(map(str, r["shape"])), r["impl"], f"{r['step_ms']:.2f}", f"{r['vs_flax']:.2f}")
        for r in report["results"]
    ]
    cols = ("layer", "shape", "impl", "fwd+bwd ms", "x flax")
    widths = [max(len(x[i]) for x in [cols, *rows]) for i in range(len(cols))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(cols, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)
