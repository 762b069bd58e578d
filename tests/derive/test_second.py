"""Second order, derived (derivgen.derive.second): the double backward and the JVP as closed forms,
proven against brute force, generated in NumPy and C, and checked against finite
differences of the first-order code, the other backend and PyTorch."""

import dataclasses

import numpy as np
import pytest
import sympy
from conftest import ROOT

import derivgen
from derivgen.derive.second import derive_second
from derivgen.prove.proof import prove_second_mode
from derivgen.symbolic.naming import code_text
from derivgen.symbolic.reduce import Mean
from derivgen.tools.check import check_layer

EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
LAYERS = [(n, m) for n in derivgen.names() for m in derivgen.derive(n).modes]


def test_layernorm_double_backward_is_the_compact_closed_form():
    so = derivgen.derive("layernorm").second("train")
    text = code_text(so.ddy, so.spec)
    # d(dx)/d(dy) seen through dx's cotangent: gamma*rstd*(δx - mean(δx) - x̂·mean(δx·x̂)) + δγ·x̂ + δβ
    assert text == (
        "gamma_Dd*xhat + X_Dd*gamma*rstd + beta_Dd - gamma*rstd*mean(X_Dd) - gamma*rstd*xhat*mean(X_Dd*xhat)"
    )
    assert len(so.reductions) == 7 and len(so.jvp_reductions) == 2
    # only means of element monomials: one reduction sweep, no mean inside a mean
    for r in so.reductions + so.jvp_reductions:
        assert not r.arg.has(Mean)


@pytest.mark.parametrize("name,mode", LAYERS)
def test_catalogue_second_order_is_proven(name, mode):
    so = derivgen.derive(name).second(mode)
    if name == "online_layernorm":
        # its proof at N = 3 multiplies out 2.8 million term pairs (about a minute): a budget of
        # half a million proves N = 2 and checks N = 3 numerically, the same way on every machine
        proof = prove_second_mode(so, (2, 3), work=500_000)
        assert [r.status for r in proof.results] == ["proven", "checked numerically"], proof.results
        return
    proof = prove_second_mode(so, (2, 3))
    assert proof.status == "proven", [(r.n, r.status, r.detail) for r in proof.results]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_second_order_is_proven(path):
    md = derivgen.derive(path).train
    proof = prove_second_mode(derive_second(md), (2, 3))
    assert proof.ok, [(r.n, r.status, r.detail) for r in proof.results]


def test_proof_catches_a_wrong_double_backward():
    """The brute-force check is not vacuous: a sign flipped in one term fails it."""
    so = derivgen.derive("rmsnorm").second("train")
    bad = sympy.Symbol("X_Dd", real=True)
    so_bad = dataclasses.replace(so, ddy=so.ddy + sympy.Symbol("rstd", positive=True) * bad)
    proof = prove_second_mode(so_bad, (2,))
    assert not proof.ok and "ddy" in proof.results[0].detail
    so_bad = dataclasses.replace(so, ty=-so.ty)
    assert not prove_second_mode(so_bad, (2,)).ok


@pytest.mark.parametrize("name", ["layernorm", "batchnorm", "groupnorm", "online_layernorm", "rmsnorm", "instancenorm"])
def test_check_rows_second_order(name):
    rows = check_layer(derivgen.load_spec(name), prove_sizes=(2,))
    second = [r for r in rows if "second" in r.check or any(k.startswith(("bb.", "jvp.")) for k in r.errors)]
    kinds = {r.check for r in second}
    assert {"second order: finite differences", "other backend"} <= kinds
    assert not [r for r in second if r.failed], [(r.check, r.backend, r.dtype, r.errors) for r in second if r.failed]
    for r in second:
        if r.check == "second order: finite differences":
            assert {"bb.dx", "bb.ddy", "jvp.ty"} <= set(r.errors)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_calling_conventions_and_bad_input(backend):
    k = derivgen.load("layernorm", backend)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    g, b = np.ones(8, np.float32), np.zeros(8, np.float32)
    _, cache = k.forward(x, g, b)
    dy = rng.normal(size=x.shape).astype(np.float32)
    full = k.backward_backward(dy, cache, dy, {"gamma": g, "beta": b})
    seq = k.backward_backward(dy, cache, dy, [g, b])
    for a, c in zip(full, seq):
        np.testing.assert_array_equal(a, c)
    assert full._fields == ("dx", "ddy", "dgamma", "dbeta")
    # missing seeds are zeros: only ddx given -> no dgamma-cotangent terms
    only = k.backward_backward(dy, cache, dy)
    assert only.dx.dtype == np.float32 and only.dgamma.shape == (8,)
    out = {f: np.empty_like(v) for f, v in zip(full._fields, full)}
    got = k.backward_backward(dy, cache, dy, [g, b], out=out)
    assert got.dx is out["dx"]
    ty = k.jvp(cache, dy, {"gamma": g})
    assert ty.shape == x.shape and ty.dtype == np.float32
    with pytest.raises(ValueError, match="ddx must have the shape of x"):
        k.backward_backward(dy, cache, dy[:2])
    with pytest.raises(TypeError, match="ddx has dtype float64"):
        k.backward_backward(dy, cache, dy.astype(np.float64))
    with pytest.raises(TypeError, match="unknown ddparams"):
        k.backward_backward(dy, cache, dy, {"weight": g})
    with pytest.raises(ValueError, match="tparams.gamma must have the shape of gamma"):
        k.jvp(cache, dy, {"gamma": g[:3]})
    with pytest.raises(TypeError, match="cache must be the second value"):
        k.jvp(None, dy)
    with pytest.raises(ValueError, match="overlaps"):
        k.jvp(cache, dy, out=dy)


def test_inputs_and_scalar_seeds_reach_the_kernels():
    """online_layernorm (per-group inputs): a cotangent of d(prev_std) changes dx; a tangent of
    prev_mean changes ty -- both backends the same."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 6))
    g, b = rng.normal(size=6), rng.normal(size=6)
    kw = {"alpha": 0.7, "prev_mean": rng.normal(size=3), "prev_std": rng.uniform(0.5, 1.5, 3)}
    res = {}
    for backend in ("numpy", "c"):
        k = derivgen.load("online_layernorm", backend)
        _, cache = k.forward(x, g, b, **kw)
        dy = np.ones_like(x)
        a = k.backward_backward(dy, cache, None, None, ddinputs={"prev_std": np.ones(3)})
        c = k.backward_backward(dy, cache, None, None)
        assert np.abs(a.dx - c.dx).max() > 1e-3 and np.abs(c.dx).max() == 0
        t = k.jvp(cache, None, None, tinputs={"prev_mean": np.ones(3)})
        res[backend] = (a, t)
    for u, v in zip(res["numpy"][0], res["c"][0]):
        np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res["numpy"][1], res["c"][1], rtol=1e-12, atol=1e-12)


TORCH_MODULES = [
    ("LayerNorm", lambda nn: nn.LayerNorm(6), (3, 6)),
    ("RMSNorm", lambda nn: nn.RMSNorm(6), (3, 6)),
    ("BatchNorm2d", lambda nn: nn.BatchNorm2d(3, track_running_stats=False), (4, 3, 2, 2)),
    ("BatchNorm2d eval", lambda nn: nn.BatchNorm2d(3).eval(), (4, 3, 2, 2)),
    ("GroupNorm", lambda nn: nn.GroupNorm(2, 4), (2, 4, 3)),
    ("InstanceNorm1d", lambda nn: nn.InstanceNorm1d(3, affine=True), (2, 3, 5)),
]


@pytest.mark.parametrize("label,make,shape", TORCH_MODULES, ids=[t[0] for t in TORCH_MODULES])
def test_torch_second_order_through_derived_kernels(label, make, shape, monkeypatch):
    """gradgradcheck, the double backward against torch.nn's, torch.func.jvp and
    torch.autograd.forward_ad against torch.nn's -- with the generic (torch.func over the
    PyTorch target) paths disabled, so the derived kernels do the work."""
    torch = __import__("conftest").require_module("torch")
    import torch.autograd.forward_ad as fwad

    import derivgen.torch as dt
    from derivgen.torch.ops import TorchLayer

    def refuse(*a, **k):
        raise AssertionError("the generic second-order path ran")

    monkeypatch.setattr(TorchLayer, "_generic_bb", refuse)
    monkeypatch.setattr(TorchLayer, "_generic_jvp", refuse)
    torch.manual_seed(0)
    ref = make(torch.nn).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
        for name, b in ref.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.rand_like(b) + 0.5)
    m = dt.convert(__import__("copy").deepcopy(ref))
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda z: m(z), (x,))
    dy, v = torch.randn_like(x), torch.randn_like(x)
    out = []
    for mod in (m, ref):
        g = torch.autograd.grad(mod(x), [x, *mod.parameters()], dy, create_graph=True)
        loss = (g[0] * v).sum() + sum((t * t).sum() for t in g[1:])
        wrt = [x, *mod.parameters()]
        out.append(
            [
                torch.zeros_like(w) if d is None else d
                for d, w in zip(torch.autograd.grad(loss, wrt, allow_unused=True), wrt)
            ]
        )
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    tx = torch.randn_like(x)
    _, t_ref = torch.func.jvp(lambda z: ref(z), (x.detach(),), (tx,))
    _, t_fn = torch.func.jvp(lambda z: m(z), (x.detach(),), (tx,))
    with fwad.dual_level():
        t_ad = fwad.unpack_dual(m(fwad.make_dual(x.detach(), tx))).tangent
    torch.testing.assert_close(t_fn, t_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t_ad, t_ref, rtol=1e-10, atol=1e-12)


def test_torch_float32_double_backward_matches_float64():
    torch = __import__("conftest").require_module("torch")
    import derivgen.torch as dt

    torch.manual_seed(1)
    x64 = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    res = []
    for dtype in (torch.float64, torch.float32):
        m = dt.LayerNorm(32).to(dtype)
        x = x64.detach().to(dtype).requires_grad_(True)
        (g,) = torch.autograd.grad(m(x), x, torch.ones_like(x) * 0.5 + x.detach(), create_graph=True)
        (h,) = torch.autograd.grad((g * g).sum(), x)
        res.append(h.double())
    torch.testing.assert_close(res[1], res[0], rtol=2e-4, atol=2e-4)


def test_second_order_bench_machinery():
    """``derivgen bench --torch``'s second-order rows (timings are not asserted)."""
    torch = __import__("conftest").require_module("torch")
    from derivgen.tools.bench_torch import _second_rows, format_torch_report

    rows = _second_rows(torch.float32, torch.Generator().manual_seed(0), 3, (16, 32))
    assert [r["case"] for r in rows] == ["LayerNorm double backward", "LayerNorm JVP (torch.func.jvp)"]
    assert all(r["torch"] > 0 and r["derivgen"] > 0 and r["ratio"] > 0 for r in rows)
    text = format_torch_report(
        {
            "machine": {"cpu": "cpu", "cores": 1, "torch": torch.__version__},
            "dtype": "float32",
            "repeat": 3,
            "threads": 1,
            "cases": [],
            "second": rows,
            "block": None,
        }
    )
    assert "LayerNorm double backward" in text and "<= 0.5" in text


def test_cli_derive_order_2(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "derivgen",
            "derive",
            "rmsnorm",
            "--format",
            "markdown",
            "--order",
            "2",
            "--prove-sizes",
            "2-3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "## Second order" in r.stdout and "N = 3: proven" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "derivgen", "derive", "rmsnorm", "--order", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 2 and "--order" in r.stderr and "Traceback" not in r.stderr


def test_torch_second_order_channels_last_and_bfloat16():
    """Tensors the derived kernels do not take (channels last, bfloat16) get the same
    second derivatives from the generated PyTorch closed form."""
    torch = __import__("conftest").require_module("torch")
    import derivgen.torch as dt

    torch.manual_seed(2)
    m = dt.BatchNorm2d(3, track_running_stats=False).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    res = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        xi = x.contiguous(memory_format=fmt).requires_grad_(True)
        (g,) = torch.autograd.grad(m(xi), xi, torch.ones_like(xi) + xi.detach(), create_graph=True)
        (h,) = torch.autograd.grad((g * g).sum(), xi)
        _, t = torch.func.jvp(m, (xi.detach(),), (torch.ones_like(xi) * 0.5 + xi.detach() ** 2,))
        res.append((h, t))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-10, atol=1e-12)
    ln = dt.LayerNorm(16)
    xb = torch.randn(4, 16)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        mm = ln.to(dtype)
        xi = xb.to(dtype).requires_grad_(True)
        (g,) = torch.autograd.grad(mm(xi), xi, torch.ones_like(xi) + xi.detach(), create_graph=True)
        (h,) = torch.autograd.grad((g.float() ** 2).sum(), xi)
        out.append(h.float())
    torch.testing.assert_close(out[1], out[0], rtol=0.1, atol=0.15)


def test_torch_third_order_matches_finite_differences():
    """The derived double backward is itself differentiable (third order through the
    generated PyTorch closed form, statistics recomputed from x): the gradient of a loss on
    a Hessian-vector product matches central differences of the second order. (PyTorch
    2.13's own third derivative of layer_norm does not: its double backward treats the
    saved mean and rstd as constants.)"""
    torch = __import__("conftest").require_module("torch")
    import derivgen.torch as dt

    torch.manual_seed(0)
    m = dt.LayerNorm(5).double()
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w, v = torch.randn_like(x), torch.randn_like(x)

    def second(z, create_graph):
        (g,) = torch.autograd.grad((m(z) * w).sum(), z, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), z, create_graph=create_graph)
        return h

    (k,) = torch.autograd.grad((second(x, True) ** 2).sum(), x)
    fd = torch.zeros_like(x)
    for i in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[i] = 1e-6
        e = e.view_as(x)
        hp = second((x + e).detach().requires_grad_(True), False)
        hm = second((x - e).detach().requires_grad_(True), False)
        fd.view(-1)[i] = ((hp**2).sum() - (hm**2).sum()) / 2e-6
    torch.testing.assert_close(k, fd, rtol=1e-6, atol=1e-6)
