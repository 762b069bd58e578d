"""`derivgen bench` runs and reports finite numbers (timings are never asserted)."""

import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT


def test_bench_runs_and_reports_finite_numbers(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "derivgen",
            "bench",
            "layernorm",
            "batchnorm",
            "--shape",
            "16x8x4",
            "--threads",
            "1",
            "--repeat",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "bandwidth probe" in r.stdout and "targets" in r.stdout and r.stdout.startswith("machine: ")
    data = json.loads(out.read_text())
    m = data["machine"]
    assert m["cores"] >= 1 and m["cpu"] and isinstance(m["flags"], list)
    (build,) = data["builds"]
    assert build["label"] == "generated c" and build["isa"] and not build["skipped"]
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
    from derivgen.tools.bench_refs import plain_numpy

    rng = np.random.default_rng(0)
    for name, shape, kw in [
        ("layernorm", (6, 10), {}),
        ("rmsnorm", (6, 10), {}),
        ("batchnorm", (4, 3, 5), {}),
        ("groupnorm", (2, 6, 5), {"num_groups": 3}),
        ("online_layernorm", (5, 7), {"alpha": 0.3, "prev_mean": 0.1, "prev_std": 1.2}),
    ]:
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
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "derivgen",
            "bench",
            "rmsnorm",
            "--shape",
            "8x8",
            "--repeat",
            "3",
            "--threads",
            "1",
            "--plot",
            str(tmp_path / "c.png"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    # checked before the bench runs: a bad invocation, one line, exit 2, nothing written
    assert r.returncode == 2 and "matplotlib" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == "" and not (tmp_path / "c.png").exists()


def test_bench_isa_builds_side_by_side_and_a_user_spec(tmp_path):
    """--isa times one C build per instruction set in the same rounds; --spec benches a user's
    layer against plain NumPy written from its formulas (no torch row: not a catalogue layer)."""
    from derivgen.runtime.machine import machine

    out = tmp_path / "bench.json"
    spec = ROOT / "examples" / "dynamic_tanh.toml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "derivgen",
            "bench",
            "rmsnorm",
            "--spec",
            str(spec),
            "--shape",
            "16x32",
            "--threads",
            "1",
            "--repeat",
            "3",
            "--isa",
            "x86-64,x86-64-v3,x86-64-v4",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    builds = {b["label"]: b for b in data["builds"]}
    assert set(builds) == {"generated c [x86-64]", "generated c [x86-64-v3]", "generated c [x86-64-v4]"}
    assert builds["generated c [x86-64]"]["isa"] == "sse2"
    assert "-march=x86-64-v3" in builds["generated c [x86-64-v3]"]["cflags"]
    flags = set(machine().flags)
    v4 = builds["generated c [x86-64-v4]"]
    assert bool(v4["skipped"]) == ("avx512f" not in flags)
    if not v4["skipped"]:
        assert v4["isa"].startswith("avx512f")
    if "avx2" in flags:
        assert builds["generated c [x86-64-v3]"]["isa"] == "avx2 fma sse2"
    impls = {(row["layer"], row["impl"]) for row in data["results"]}
    ran = [b for b in builds.values() if not b["skipped"]]
    for layer in ("rmsnorm", "dynamic_tanh"):
        assert all((layer, b["label"]) in impls for b in ran)
        assert (layer, "plain numpy") in impls
    assert ("dynamic_tanh", "torch") not in impls
    for label, b in builds.items():
        assert (label in r.stdout) and (("skipped" in r.stdout) or not b["skipped"])


def test_bench_rejects_a_bad_isa_list():
    r = subprocess.run(
        [sys.executable, "-m", "derivgen", "bench", "rmsnorm", "--isa", "native,,native"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--isa" in r.stderr and "Traceback" not in r.stderr


def test_bench_sync_needs_torch_flag():
    r = subprocess.run(
        [sys.executable, "-m", "derivgen", "bench", "--sync", "2"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "--sync" in r.stderr and "Traceback" not in r.stderr


def test_spec_baseline_matches_the_generated_code():
    """The plain NumPy written from a spec's formulas (bench --spec) computes the same values."""
    import numpy as np

    import derivgen
    from derivgen.runtime import resolve_layout
    from derivgen.tools.baseline import PlainNumPy

    rng = np.random.default_rng(1)
    for name, shape, kw in [
        ("layernorm", (6, 10), {}),
        ("groupnorm", (2, 6, 5), {"num_groups": 3}),
        ("batchnorm", (4, 3, 5), {}),
        ("rmsnorm", (4, 9), {}),
        ("online_layernorm", (3, 7), {"alpha": 0.3, "prev_mean": np.full(3, 0.1), "prev_std": np.full(3, 1.2)}),
    ]:
        d = derivgen.derive(name)
        spec = d.spec
        x, dy = rng.normal(size=shape), rng.normal(size=shape)
        ps = (shape[-1],) if spec.layout == "trailing" else (shape[1],)
        params = [rng.normal(1, 0.3, ps) for _ in spec.params]
        meta = {"name": name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"]}
        L = resolve_layout(meta, x, {"p": params[0]}, kw.get("num_groups"))
        opts = {k: v for k, v in kw.items() if k != "num_groups"}
        y, grads = PlainNumPy(d.train, L).step(x, params, dy, opts)
        mod = derivgen.load(name)
        y2, cache = mod.forward(x, *params, **kw)
        g2 = mod.backward(dy, cache)
        np.testing.assert_allclose(y, y2, atol=1e-12)
        for a, b in zip(grads, g2):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-10)


def test_bench_bfloat16_reports_each_pass_per_byte(tmp_path):
    """``--dtype bfloat16``: derivgen.torch's bfloat16 and float32 operators and torch's layers,
    each pass over the streaming-store bound and bfloat16 / float32 per byte (never asserted)."""
    from conftest import require_module

    require_module("torch")
    out = tmp_path / "bf16.json"
    r = subprocess.run(
        [sys.executable, "-m", "derivgen", "bench", "--dtype", "bfloat16", "rmsnorm", "groupnorm"]
        + ["--shape", "4x8x6x6", "--threads", "1", "--repeat", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "per byte" in r.stdout and "target: bfloat16 per byte" in r.stdout
    data = json.loads(out.read_text())
    assert [row["layer"] for row in data["results"]] == ["rmsnorm", "groupnorm"]
    for row in data["results"]:
        assert len(row["ms"]) == 8  # derivgen and torch, float32 and bfloat16, fwd and bwd
        assert all(math.isfinite(v) and v > 0 for v in (*row["ms"].values(), *row["ratios"].values()))
    bad = subprocess.run(
        [sys.executable, "-m", "derivgen", "bench", "--dtype", "bfloat16", "frn"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "no bfloat16 bench for frn" in bad.stderr and "Traceback" not in bad.stderr


def test_a_target_below_the_memory_floor_says_so():
    """A C / torch target smaller than the memory floor (the bytes at the faster copy
    probe, over torch's time) is marked as asking more than the memory gives; one above it
    is not."""
    from derivgen.tools.bench_targets import evaluate_targets, target_lines

    c_ratios = {"step_vs_torch": 0.9, "fwd_vs_stream_bound": 1.1, "bwd_vs_stream_bound": 1.0}

    def report(floor: float) -> dict:
        rows = [
            {"layer": "layernorm", "shape": [8192, 1024], "impl": "generated c", "ratios": c_ratios},
            {"layer": "layernorm", "shape": [8192, 1024], "impl": "torch", "ratios": {"floor_vs_torch": floor}},
        ]
        return {"results": rows, "dtype": "float32", "threads": 2, "builds": [{"label": "generated c", "skipped": ""}]}

    low, high = report(0.6), report(0.82)
    t = evaluate_targets(high)[0]
    assert t["what"].endswith("fwd+bwd / torch") and t["limit"] == 0.75 and not t["met"] and t["floor"] == 0.82
    text = "\n".join(target_lines(high))
    assert "below this machine's memory floor, 0.82 of torch" in text and "1 missed below the memory floor" in text
    assert max(map(len, text.splitlines())) <= 100  # a table, never folded
    text = "\n".join(target_lines(low))
    assert "MISSED" in text and "memory floor" not in text
    c_ratios["step_vs_torch"] = 0.7  # met: no word of the floor
    assert "memory floor" not in "\n".join(target_lines(high))


@pytest.mark.full  # torch.compile compiles the same function twice: a minute on a 2-core machine
def test_bench_times_a_fused_layer_against_eager_and_compiled_pytorch():
    """add_rmsnorm: the C and NumPy modules, eager PyTorch (x + residual, then F.rms_norm) and
    torch.compile of it, each phase in the same rounds, against the bytes the layer moves."""
    pytest.importorskip("torch")
    from derivgen.tools.bench import run_bench
    from derivgen.tools.bench_report import format_report

    rep = run_bench(["add_rmsnorm"], shapes=[(16, 64)], threads=1, repeat=2)
    impls = {r["impl"]: r for r in rep["results"]}
    assert {"generated c", "generated numpy", "torch", "torch.compile"} <= set(impls)
    c = impls["generated c"]["ratios"]
    for k in ("fwd_vs_eager", "bwd_vs_eager", "fwd_vs_compile", "bwd_vs_compile", "fwd_vs_floor", "bwd_vs_floor"):
        assert math.isfinite(c[k]) and c[k] > 0, k
    assert c["fwd_vs_eager"] == pytest.approx(c["same_round_fwd_ms"] / impls["torch"]["ratios"]["same_round_fwd_ms"])
    assert "fwd x compile" in format_report(rep)


# ---- derivgen bench --zoo: every layer against an independent PyTorch forward (and --jax)

ZOO_COLUMNS = ("layer", "shape", "eager", "compile", "derivgen", "/compile", "/eager", "fwd/eager", "/floor")


def test_bench_zoo_runs_three_layers_and_reports_finite_ratios(tmp_path):
    """Three layers (a catalogue one, a zoo one with block statistics, one with a tensor beside
    x) at tiny sizes, torch.compile left out: the table's columns, and every ratio finite."""
    pytest.importorskip("torch")
    from click.testing import CliRunner

    from derivgen.cli import cli

    out = tmp_path / "zoo.json"
    names = ["rmsnorm", "frn", "add_rmsnorm"]
    r = CliRunner().invoke(
        cli,
        ["bench", "--zoo", "--small", "--no-compile", "--repeat", "3", "--threads", "1", "--json", str(out), *names],
    )
    assert r.exit_code == 0, r.output
    header = next(line for line in r.output.splitlines() if line.startswith("layer "))
    assert header.split() == list(ZOO_COLUMNS) + ["fwd/comp"] or all(c in header for c in ZOO_COLUMNS)
    machine = next(line for line in r.output.splitlines() if line.startswith("machine: "))  # after any build notes
    assert "ISA" in machine
    data = json.loads(out.read_text())
    assert [row["layer"] for row in data["rows"]] == names
    for row in data["rows"]:
        assert "error" not in row, row
        assert set(row["agreement"]) == {"derivgen", "eager"} and max(row["agreement"].values()) < data["tolerance"]
        for k in ("derivgen_step", "eager_step", "step_vs_eager", "fwd_vs_eager", "floor_ms", "step_vs_floor"):
            assert math.isfinite(row[k]) and row[k] > 0, (row["layer"], k)
        assert row["layer"] in r.output


def test_bench_zoo_catches_a_wrong_reference_and_lists_the_untimed(monkeypatch):
    """A reference 1% off is caught by the float64 check before anything is timed; a layer
    without a reference is listed with its reason, never dropped."""
    pytest.importorskip("torch")
    from derivgen.tools import bench_zoo, bench_zoo_refs

    good = bench_zoo_refs.SINGLE["softmax"]
    monkeypatch.setitem(bench_zoo_refs.SINGLE, "softmax", lambda x, *a: good(x, *a) * 1.01)
    real = bench_zoo.reference
    monkeypatch.setattr(bench_zoo, "reference", lambda n: None if n == "pixelnorm" else real(n))
    rep = bench_zoo.run_zoo_bench(
        ["softmax", "pixelnorm"], bench_zoo.SMALL_TRAILING, bench_zoo.SMALL_CHANNELS, 1, 3, compiled=False, floor=False
    )
    soft, pix = rep["rows"]
    assert "disagrees with the float64 reference" in soft["error"] and "derivgen_step" not in soft
    assert pix["error"] == "no independent PyTorch reference"
    text = bench_zoo.format_zoo_report(rep)
    assert "not timed:" in text and "softmax: " in text and "pixelnorm: no independent" in text


def test_bench_zoo_compiles_each_layer_afresh(monkeypatch):
    """Every layer's compiled reference is one lambda's code, and Dynamo runs a code object
    eagerly once it has compiled it 8 times (2 per layer: the forward and the step), so the bench
    starts Dynamo afresh for each layer: without it, the compile column of a run of 5 layers or
    more would time eager PyTorch from the fifth on."""
    torch = pytest.importorskip("torch")
    from derivgen.tools import bench_zoo
    from derivgen.tools.bench_zoo_refs import reference

    resets = []
    real = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1) or real())
    for name in ("rmsnorm", "softmax"):
        prob = bench_zoo.problem(name, bench_zoo.SMALL_TRAILING, bench_zoo.SMALL_CHANNELS)
        vs = bench_zoo.variants(prob, reference(name), compiled=True)
        assert "compile" in vs
    assert len(resets) == 2


def test_bench_zoo_block_compiles_derivgen_with_its_neighbours(monkeypatch):
    """--block: every variant is the layer inside gelu(y) + x, checked against the float64
    reference of that block (a variant without the neighbours would disagree), and derivgen's
    module runs under torch.compile with them (the reference's compiled variant left out here)."""
    torch = pytest.importorskip("torch")
    from derivgen.tools import bench_zoo

    compiled = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or real(fn, **kw))
    rep = bench_zoo.run_zoo_bench(
        ["dynamic_tanh"],
        bench_zoo.SMALL_TRAILING,
        bench_zoo.SMALL_CHANNELS,
        1,
        1,
        compiled=False,
        floor=False,
        block=True,
    )
    (row,) = rep["rows"]
    assert "error" not in row, row
    assert len(compiled) == 1  # derivgen's block, with its gelu and add
    assert set(row["agreement"]) == {"derivgen", "eager"}
    assert max(row["agreement"].values()) < rep["tolerance"]
    assert math.isfinite(row["step_vs_eager"]) and row["step_vs_eager"] > 0
    assert "inside a block, gelu(y) + x" in bench_zoo.format_zoo_report(rep)
    x = torch.randn(3, 4)
    (y,) = bench_zoo.in_block(lambda a: (2 * a["x"],))({"x": x})
    assert torch.equal(y, torch.nn.functional.gelu(2 * x) + x)


def test_bench_zoo_options_are_checked():
    from click.testing import CliRunner

    from derivgen.cli import cli

    for args, want in (
        (["--zoo", "nosuchlayer"], "unknown layer"),
        (["--zoo", "--shape", "8x4x2"], "2-D (rows x features) or 4-D"),
        (["--small"], "go with --zoo"),
        (["--zoo", "--torch"], "--zoo takes"),
        (["--block"], "go with --zoo"),
        (["--zoo", "--block", "--no-compile"], "--block compares"),
    ):
        r = CliRunner().invoke(cli, ["bench", *args])
        assert r.exit_code != 0 and want in r.output, (args, r.output)


def test_bench_zoo_jax_runs_and_reports_finite_ratios(monkeypatch):
    """--zoo --jax at tiny sizes: both rules and the plain forward's autodiff agree with the
    float64 reference, for layers with tensors beside x too (a residual and an output beside y;
    a mask); a layer without a reference is listed with its reason."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    from derivgen.tools import bench_zoo, bench_zoo_jax
    from derivgen.tools.bench_zoo_jax import format_zoo_jax_report, run_zoo_jax_bench

    real = bench_zoo_jax.reference
    monkeypatch.setattr(bench_zoo_jax, "reference", lambda name: None if name == "layernorm" else real(name))
    rep = run_zoo_jax_bench(
        ["rmsnorm", "evonorm_s0", "add_rmsnorm", "masked_layernorm", "layernorm"],
        bench_zoo.SMALL_TRAILING,
        bench_zoo.SMALL_CHANNELS,
        3,
    )
    *timed, missing = rep["rows"]
    for row in timed:
        assert "error" not in row, row
        assert set(row["agreement"]) == {"derivgen", "derivgen_vjp", "autodiff"}
        assert all(e < bench_zoo.TOL for e in row["agreement"].values()), row
        for k in ("derivgen_step_vs_autodiff", "derivgen_vjp_step_vs_autodiff", "derivgen_fwd_vs_autodiff"):
            assert math.isfinite(row[k]) and row[k] > 0, (row["layer"], k)
    assert "no independent PyTorch reference" in missing["error"]
    text = format_zoo_jax_report(rep)
    assert "jvp/ad" in text and "vjp/ad" in text and "add_rmsnorm " in text and "layernorm: " in text
