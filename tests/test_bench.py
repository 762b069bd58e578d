"""`derivgen bench` runs and reports finite numbers (timings are never asserted)."""

import json
import math
import subprocess
import sys

import pytest


def test_bench_runs_and_reports_finite_numbers(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "derivgen", "bench", "layernorm", "batchnorm", "--shape", "16x8x4",
                        "--threads", "1", "--repeat", "3", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "bandwidth probe" in r.stdout and "targets" in r.stdout
    data = json.loads(out.read_text())
    bw = data["bandwidth"]
    assert bw["copy_GBps"] > 0 and math.isfinite(bw["stream_copy_GBps"]) and bw["stream_copy_GBps"] > 0
    assert bw["cases"] == 2 and bw["copy_GBps_range"][0] <= bw["copy_GBps"] <= bw["copy_GBps_range"][1]
    impls = {(row["layer"], row["impl"]) for row in data["results"]}
    for layer in ("layernorm", "batchnorm"):
        for impl in ("generated c", "generated numpy", "plain numpy"):
            assert (layer, impl) in impls
    for row in data["results"]:
        for key in ("fwd_ms", "bwd_ms", "step_ms", "step_alloc_ms"):
            v = row[key]
            assert v is None or (math.isfinite(v) and v > 0), (row, key)
        assert all(math.isfinite(v) and v > 0 for v in row["ratios"].values())


def test_plain_numpy_baseline_is_correct():
    """The baseline is a fair one: it computes the same gradients."""
    import numpy as np
    import derivgen
    from derivgen.bench import plain_numpy
    rng = np.random.default_rng(0)
    for name, shape, kw in [("layernorm", (6, 10), {}), ("rmsnorm", (6, 10), {}),
                            ("batchnorm", (4, 3, 5), {}), ("groupnorm", (2, 6, 5), {"num_groups": 3}),
                            ("online_layernorm", (5, 7), {"alpha": 0.3, "prev_mean": 0.1, "prev_std": 1.2})]:
        x, dy = rng.normal(size=shape), rng.normal(size=shape)
        spec = derivgen.load_spec(name)
        p = [rng.normal(size=shape[-1] if spec.layout == "trailing" else shape[1]) for _ in spec.params]
        y, grads = plain_numpy(name, x, p, dy, kw)
        k = derivgen.load(name)
        y2, c = k.forward(x, *p, **kw)
        g2 = k.backward(dy, c)
        np.testing.assert_allclose(np.asarray(y).reshape(x.shape), y2, atol=1e-10)
        np.testing.assert_allclose(np.asarray(grads[0]).reshape(x.shape), g2.dx, atol=1e-9)
        for a, b in zip(grads[1:], list(g2)[1:]):
            np.testing.assert_allclose(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1), atol=1e-9)


def test_plot_without_matplotlib_is_one_line(tmp_path):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    r = subprocess.run([sys.executable, "-m", "derivgen", "bench", "rmsnorm", "--shape", "8x8", "--repeat", "3",
                        "--threads", "1", "--plot", str(tmp_path / "c.png")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1 and "matplotlib" in r.stderr and "Traceback" not in r.stderr
