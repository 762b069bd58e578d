"""derivgen.torch's operators: gradcheck, gradgradcheck and opcheck for every mode of every
catalogue layer and example spec, and the operators' bad-input errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import specfuzz
from conftest import QUICK_CFLAGS, ROOT, fuzz_corpus, require_module

torch = require_module("torch")
from torch_cases import arguments

import derivgen
import derivgen.torch as dt
from derivgen.tools.check import _stops_gradient
from derivgen.torch.ops import layer

EXAMPLES = sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
LAYERS = derivgen.names() + EXAMPLES


def _cases():
    for name in LAYERS:
        for mode in derivgen.load_spec(name).modes:
            yield pytest.param(name, mode.name, id=f"{Path(name).stem}-{mode.name}")


def _fn(lay, mode, params, inputs, options, buffers, groups):
    pnames, inames = list(params), list(inputs)

    def f(x, *rest):
        ps = dict(zip(pnames, rest[: len(pnames)]))
        ins = dict(zip(inames, rest[len(pnames) :]))
        y, _ = lay.forward(x, ps, ins, options, training=mode == "train", buffers=buffers, num_groups=groups)
        return y

    return f


@pytest.mark.parametrize("name,mode", list(_cases()))
def test_gradcheck_and_gradgradcheck(name, mode):
    """First derivatives through the C kernels, second through the generated PyTorch target
    (the backward operator's own autograd), against finite differences in float64."""
    lay = layer(name)
    x, params, inputs, options, buffers, groups = arguments(lay, mode)
    f = _fn(lay, mode, params, inputs, options, buffers, groups)
    args = (x, *params.values(), *inputs.values())
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6, rtol=1e-5)
    assert torch.autograd.gradgradcheck(f, args, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name,mode", list(_cases()))
def test_opcheck(name, mode):
    """Schema, autograd registration, fake tensors and AOT dispatch (dynamic shapes) of both
    operators of each mode."""
    lay = layer(name)
    x, params, inputs, options, buffers, groups = arguments(lay, mode)
    ops = lay.modes[mode]
    fargs = [x, *params.values(), *inputs.values()]
    if mode == "eval":
        fargs += list(buffers.values())
    scalars = [float(options[o]) for o in lay.meta.options] + [groups]
    res = torch.library.opcheck(ops.forward, (*fargs, *scalars))
    assert all(v == "SUCCESS" for v in res.values()), res
    out = ops.forward(*fargs, *scalars)
    y, *stats = (out,) if isinstance(out, torch.Tensor) else out
    dy = torch.randn_like(y)
    res = torch.library.opcheck(ops.backward, (dy, *fargs, *stats, *scalars))
    assert all(v == "SUCCESS" for v in res.values()), res
    # the second-order operators (derived kernels): double backward and JVP
    seeds = [torch.randn_like(t) for t in (x, *params.values(), *inputs.values())]
    res = torch.library.opcheck(ops.bb, (dy, *fargs, *stats, *seeds, *scalars))
    assert all(v == "SUCCESS" for v in res.values()), res
    res = torch.library.opcheck(ops.jvp, (*fargs, *stats, *seeds, *scalars))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_statistics_are_not_differentiable():
    """A loss that uses a statistic output gets an error, never a silent zero gradient."""
    lay = layer("layernorm")
    x, params, inputs, options, _, _ = arguments(lay, "train")
    _, stats = lay.forward(x, params, inputs, options)
    assert not stats["rstd"].requires_grad
    with pytest.raises(RuntimeError):
        stats["rstd"].sum().backward()


def test_float32_matches_float64_and_torch():
    lay = layer("layernorm")
    x = torch.randn(64, 256) * 3 + 1e3  # a large offset: the kernels centre exactly
    w, b = torch.rand(256) + 0.5, torch.randn(256)
    y, _ = lay.forward(x, {"gamma": w, "beta": b}, {}, {"eps": 1e-5})
    ref = torch.nn.functional.layer_norm(x.double(), (256,), w.double(), b.double(), 1e-5)
    assert (y.double() - ref).abs().max() < 5e-6


def test_noncontiguous_input_and_dy():
    x = torch.randn(8, 32, dtype=torch.float64).t().contiguous().t()  # strided view (column-major)
    assert not x.is_contiguous()
    x.requires_grad_(True)
    w, b = torch.rand(32, dtype=torch.float64, requires_grad=True), torch.randn(32, dtype=torch.float64)
    y = dt.function("layernorm")(x, gamma=w, beta=b)
    dy = torch.randn(32, 8, dtype=torch.float64).t()
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    xr = x.detach().clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    yr = torch.nn.functional.layer_norm(xr, (32,), wr, b, 1e-5)
    rx, rw = torch.autograd.grad(yr, (xr, wr), dy)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, rx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "bad,err,match",
    [
        (
            lambda x, w, b: (x.to(torch.float16), w, b),
            TypeError,
            "gamma has dtype torch.float64 but x has torch.float16",
        ),
        (lambda x, w, b: (x.to(torch.bfloat16), w, b), TypeError, "gamma has dtype torch.float64 but x has torch.bfl"),
        (lambda x, w, b: (x.to(torch.complex128), w, b), TypeError, "x has dtype torch.complex128"),
        (lambda x, w, b: (x.to(torch.int32), w, b), TypeError, "x has dtype torch.int32"),
        (lambda x, w, b: (x, w.float(), b), TypeError, "gamma has dtype float32 but x has float64"),
        (lambda x, w, b: (x, w[:3], b), ValueError, "gamma"),
        (lambda x, w, b: (x[:, :3], w, b), ValueError, "trailing axes of x"),
    ],
)
def test_bad_input_names_the_argument(bad, err, match):
    f = dt.function("layernorm")
    x, w, b = (
        torch.randn(4, 6, dtype=torch.float64),
        torch.ones(6, dtype=torch.float64),
        torch.zeros(6, dtype=torch.float64),
    )
    x, w, b = bad(x, w, b)
    with pytest.raises(err, match=match):
        f(x, gamma=w, beta=b)


def test_function_argument_errors():
    f = dt.function("online_layernorm")
    x = torch.randn(3, 5, dtype=torch.float64)
    w, b = torch.ones(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    with pytest.raises(TypeError, match="option alpha is required"):
        f(x, gamma=w, beta=b, prev_mean=0.0, prev_std=1.0)
    with pytest.raises(TypeError, match="input prev_std is required"):
        f(x, gamma=w, beta=b, prev_mean=0.0, alpha=0.5)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['gama'\]"):
        f(x, gama=w, beta=b, prev_mean=0.0, prev_std=1.0, alpha=0.5)
    with pytest.raises(ValueError, match="num_groups=4 must be positive and divide"):
        dt.function("groupnorm")(torch.randn(2, 6, 3), gamma=torch.ones(6), beta=torch.zeros(6), num_groups=4)


def test_import_without_torch_names_the_extra():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import derivgen.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "pip install torch ninja" in r.stdout and "derivgen[torch]" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys; sys.modules['torch'] = None; import derivgen; "
                "print(derivgen.load('layernorm', 'c').forward)"
            ),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr  # the rest of derivgen does not need torch


def test_user_spec_operators_do_not_collide_with_the_catalogue(tmp_path):
    """A spec file named like a catalogue layer but different gets operators of its own."""
    text = (
        (ROOT / "derivgen" / "spec" / "catalogue" / "layernorm.toml")
        .read_text()
        .replace('y = "gamma*xhat + beta"', 'y = "gamma*xhat + 2*beta"')
    )
    p = tmp_path / "layernorm.toml"
    p.write_text(text)
    mine, cat = layer(str(p)), layer("layernorm")
    assert mine.base != cat.base and mine.base.startswith("layernorm_")
    x = torch.randn(3, 4, dtype=torch.float64)
    w, b = torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    y1, _ = mine.forward(x, {"gamma": w, "beta": b}, {}, {"eps": 1e-5})
    y2, _ = cat.forward(x, {"gamma": w, "beta": b}, {}, {"eps": 1e-5})
    torch.testing.assert_close(y1 - y2, torch.ones_like(y1), rtol=0, atol=1e-12)


def test_fast_path_keeps_validating_and_matches_the_operator():
    """After a signature has been validated, calls go straight to the kernel; a bad option,
    a non-contiguous tensor or another dtype must still take the checked path, and the eager
    path must give the operator's bits."""
    lay = layer("layernorm")
    f = dt.function("layernorm")
    x, w, b = torch.randn(6, 16), torch.rand(16) + 0.5, torch.randn(16)
    for _ in range(3):
        y = f(x, w, b, eps=1e-5)
    op = lay.modes["train"].forward(x, w, b, 1e-5, 0)[0]
    assert torch.equal(y, op)
    with pytest.raises(ValueError, match=r"eps must lie in \[0.0, inf\], got -1.0"):
        f(x, w, b, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be finite"):
        f(x, w, b, eps=float("nan"))
    with pytest.raises(TypeError, match="gamma has dtype float64 but x has float32"):
        f(x, w.double(), b)
    xt = torch.randn(16, 6).t()
    torch.testing.assert_close(f(xt, w, b), torch.nn.functional.layer_norm(xt, (16,), w, b), rtol=1e-5, atol=1e-6)


def test_eager_path_detects_in_place_changes_and_keeps_statistics():
    """The eager path saves its inputs through autograd (a tensor changed in place before
    the backward is an error, as for torch's own operators), returns the same statistics
    with and without autograd, and plans one signature per shape."""
    lay = layer("batchnorm")
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    w, b = torch.rand(3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64)
    opts = {"eps": 1e-5, "momentum": 0.1}
    y, st = lay.forward(x, {"gamma": w, "beta": b}, {}, opts)
    with torch.no_grad():
        y0, st0 = lay.forward(x, {"gamma": w, "beta": b}, {}, opts)
    assert torch.equal(y, y0) and st.keys() == st0.keys()
    assert all(torch.equal(st[k], st0[k]) and st[k].dtype == torch.float64 and not st[k].requires_grad for k in st)
    with torch.no_grad():
        w.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    for n in (2, 7, 2):  # another shape, then the first again
        xn = torch.randn(n, 3, 5, dtype=torch.float64, requires_grad=True)
        wn = torch.rand(3, dtype=torch.float64, requires_grad=True)
        yn, _ = lay.forward(xn, {"gamma": wn, "beta": b}, {}, opts)
        g = torch.autograd.grad(yn, (xn, wn), torch.ones_like(yn) + xn.detach())
        xr, wr = xn.detach().clone().requires_grad_(True), wn.detach().clone().requires_grad_(True)
        yr = torch.nn.functional.batch_norm(xr, None, None, wr, b, training=True, eps=1e-5)
        gr = torch.autograd.grad(yr, (xr, wr), torch.ones_like(yr) + xn.detach())
        torch.testing.assert_close(yn, yr, rtol=1e-12, atol=1e-12)
        for a, c in zip(g, gr):
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_torch_bench_report_runs():
    """``derivgen bench --torch``'s machinery on its per-call case (timings are not asserted:
    a report with both sides and a ratio)."""
    from derivgen.tools.bench_torch import format_torch_report, run_torch_bench

    rep = run_torch_bench(threads=1, repeat=2, cases=["LayerNorm per call"])
    (row,) = rep["cases"]
    assert row["torch_step"] > 0 and row["derivgen_step"] > 0 and row["ratio"] > 0
    text = format_torch_report(rep)
    assert "LayerNorm per call" in text and " us " in text and rep["block"] is None
    assert max(map(len, text.splitlines())) <= 100  # fits a 100-column terminal


def test_torch_bench_memory_floor():
    """A case with tensor sweeps gets its memory floor from copy probes timed beside it: the
    sweeps' bytes at the faster probe, over torch.nn's time; a target under it is flagged."""
    from derivgen.tools.bench_torch import CASES, _case_row, below_floor, format_torch_report
    from derivgen.tools.timing import Bandwidth

    sweeps = {c[0]: c[5] for c in CASES}
    assert sweeps["BatchNorm2d channels_last"] == 8 and sweeps["LayerNorm"] == 5
    assert sweeps["LayerNorm per call"] is None  # fits in the caches: no floor
    gen = torch.Generator().manual_seed(0)
    bw = Bandwidth(1, mib=8)
    row = _case_row("LayerNorm", lambda: torch.nn.LayerNorm(256), (512, 256), None, 0.0, torch.float32, gen, 3, 5, bw)
    best = max(row["bandwidth"]["copy_GBps"], row["bandwidth"]["stream_copy_GBps"])
    assert row["floor_ms"] == pytest.approx(5 * 512 * 256 * 4 / (best * 1e6))
    assert row["floor"] == pytest.approx(row["floor_ms"] / row["torch_step"])
    assert below_floor(row) and not below_floor(dict(row, target=None)) and not below_floor(dict(row, ratio=0.0))
    rep = {"machine": {"cpu": "cpu", "cores": 1, "torch": "t"}, "dtype": "float32", "repeat": 3, "threads": 1}
    text = format_torch_report(rep | {"cases": [row], "block": None})
    assert "5 sweeps" in text and "target 0.0 is below it" in text and "(8 MiB arrays" in text
    assert max(map(len, text.splitlines())) <= 100
    plain = _case_row("LayerNorm", lambda: torch.nn.LayerNorm(8), (4, 8), None, None, torch.float32, gen, 3)
    assert "floor" not in plain and "memory floor" not in format_torch_report(rep | {"cases": [plain], "block": None})


FUZZ_SEEDS = range(16)


def _against_the_specs_forward(lay, mode, f, args, params, inputs, options, buffers, groups):
    """First and second derivatives of the operators against autograd through the spec's own
    forward in torch operations (stop_gradient as .detach()), float64."""
    from derivgen import runtime as rt
    from derivgen.tools.torch_ref import SpecForward

    x = args[0]
    L = rt.resolve_layout(
        lay.meta,
        x.detach().numpy(),
        {k: v.detach().numpy() for k, v in params.items()},
        groups if lay.meta.reduce == "group" else None,
    )
    ref_forward = SpecForward(lay.spec, mode, L)
    pnames, inames = list(params), list(inputs)

    def g(xx, *rest):
        kw = {**{k: float(v) for k, v in options.items()}, **{k: v for k, v in buffers.items()}}
        y, _ = ref_forward(xx, dict(zip(pnames, rest[: len(pnames)])), dict(zip(inames, rest[len(pnames) :])), kw)
        return y.reshape(x.shape)

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    got, want = (torch.autograd.grad((h(*args) * w).sum(), args, create_graph=True) for h in (f, g))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10)
    v = [torch.randn(a.shape, generator=gen, dtype=torch.float64) for a in got]
    got2 = torch.autograd.grad(sum((a * c).sum() for a, c in zip(got, v)), args, allow_unused=True)
    want2 = torch.autograd.grad(sum((a * c).sum() for a, c in zip(want, v)), args, allow_unused=True)
    for a, b in zip(got2, want2):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros(()) if b is None else b
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("seed", fuzz_corpus(FUZZ_SEEDS))
def test_fuzzed_specs_as_torch_operators(seed, tmp_path, monkeypatch):
    """Any spec a user could write (the spec fuzzer's), as operators: opcheck, gradcheck and
    gradgradcheck in float64 for each of its modes."""
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)  # built as the fuzzer builds its specs
    p = tmp_path / f"fuzz{seed}.toml"
    p.write_text(specfuzz.generate(seed))
    lay = layer(str(p))
    for mode in lay.meta.modes:
        x, params, inputs, options, buffers, groups = arguments(lay, mode, seed=seed)
        f = _fn(lay, mode, params, inputs, options, buffers, groups)
        args = (x, *params.values(), *inputs.values())
        if _stops_gradient(lay.spec):  # finite differences see through stop_gradient
            _against_the_specs_forward(lay, mode, f, args, params, inputs, options, buffers, groups)
        else:
            assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-5, rtol=1e-4)
            assert torch.autograd.gradgradcheck(f, args, eps=1e-6, atol=1e-4, rtol=1e-3)
        fargs = [x, *params.values(), *inputs.values(), *(buffers.values() if mode == "eval" else ())]
        res = torch.library.opcheck(
            lay.modes[mode].forward, (*fargs, *[float(options[o]) for o in lay.meta.options], groups)
        )
        assert all(v == "SUCCESS" for v in res.values()), res
        # the bfloat16 kernels of the spec: compiled under -Werror (the tests' build) and run
        b = {k: v.detach().to(torch.bfloat16) for k, v in {"x": x, **params, **inputs, **buffers}.items()}
        yb, _ = lay.forward(
            b["x"],
            {k: b[k] for k in params},
            {k: b[k] for k in inputs},
            options,
            training=mode == "train",
            buffers={k: b[k] for k in buffers},
            num_groups=groups,
        )
        y64 = f(b["x"].double(), *(b[k].double() for k in params), *(b[k].double() for k in inputs)).detach()
        assert yb.dtype == torch.bfloat16
        assert float((yb.double() - y64).abs().max()) <= 2**-6 * (float(y64.abs().max()) or 1.0)
        if lay.meta.layout == "channels":  # channels last: the NCHW kernels' bits
            x4 = x.detach().reshape(*x.shape, 1)
            outs = []
            for xx in (x4.contiguous(memory_format=torch.channels_last), x4.clone()):
                xx.requires_grad_(True)
                y = f(xx, *params.values(), *inputs.values())
                outs.append([y, *torch.autograd.grad(y, [xx, *params.values(), *inputs.values()], torch.ones_like(y))])
            assert outs[0][0].is_contiguous(memory_format=torch.channels_last)
            for a, b in zip(*outs):
                assert torch.equal(a, b)


@pytest.mark.parametrize("name,mode", list(_cases()))
def test_bfloat16_kernels_every_layer(name, mode):
    """Every catalogue and example layer's bfloat16 kernels (read and written as bfloat16,
    computed in float): output and gradients within bfloat16 rounding of float64 on the
    same bfloat16-rounded inputs."""
    lay = layer(name)
    x, params, inputs, options, buffers, groups = arguments(lay, mode, requires_grad=False)
    rnd = {k: v.to(torch.bfloat16) for k, v in {"x": x, **params, **inputs, **buffers}.items()}
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    outs = {}
    for dtype in (torch.bfloat16, torch.float64):
        t = {k: v.to(dtype).requires_grad_(k not in buffers) for k, v in rnd.items()}
        y, _ = lay.forward(
            t["x"],
            {p: t[p] for p in params},
            {i: t[i] for i in inputs},
            options,
            training=mode == "train",
            buffers={b: t[b] for b in buffers},
            num_groups=groups,
        )
        wrt = [t["x"], *(t[p] for p in params), *(t[i] for i in inputs)]
        outs[dtype] = [y, *torch.autograd.grad(y, wrt, dy.to(dtype))]
    for a, e in zip(outs[torch.bfloat16], outs[torch.float64]):
        a, e = a.detach(), e.detach()
        assert a.dtype == torch.bfloat16
        scale = float(e.abs().max()) or 1.0
        assert float((a.double() - e).abs().max()) <= 2**-6 * scale
    fargs = [rnd["x"], *(rnd[p] for p in params), *(rnd[i] for i in inputs), *(rnd[b] for b in buffers)]
    res = torch.library.opcheck(
        lay.modes[mode].forward, (*fargs, *[float(options[o]) for o in lay.meta.options], groups)
    )
    assert all(v == "SUCCESS" for v in res.values()), res
