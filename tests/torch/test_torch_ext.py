"""The per-call path through the C++ extension (derivgen.torch.ext): the same bits as the
Python path (forward, statistics, backward, double backward), the same errors for bad
calls and misuse of the graph, saved-tensor hooks and checkpointing, large outputs advised
to take huge pages, and the fallback where the extension cannot be built."""

from __future__ import annotations

import contextlib
import sys

import pytest
from conftest import HAS_THP, huge_page_advised, require_module, require_torch_extension

torch = require_module("torch")
from torch import nn

import derivgen.torch as dt
from derivgen.torch import ext
from derivgen.torch.ops import layer
from derivgen.torch.tensors import HUGE_MIN, HUGE_PAGE, advise_huge_pages, fresh_like


@contextlib.contextmanager
def python_path(*names):
    """Within: the layers ``names`` make plans without the extension (today's Python path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ext, "module", lambda: None)
        for n in names:
            lay = layer(n)
            mp.setattr(lay.plans, "_plans", {})
            mp.setattr(lay.plans, "last_ext", {})
        yield


CASES = [
    ("LayerNorm", "layernorm", lambda: nn.LayerNorm(64), (6, 64)),
    ("LayerNorm-large", "layernorm", lambda: nn.LayerNorm(1024), (40, 1024)),  # over SERIAL_BELOW: threads
    ("RMSNorm", "rmsnorm", lambda: nn.RMSNorm(48), (3, 5, 48)),
    ("BatchNorm2d", "batchnorm", lambda: nn.BatchNorm2d(4), (3, 4, 5, 6)),
    ("GroupNorm", "groupnorm", lambda: nn.GroupNorm(3, 6), (4, 6, 5, 2)),
    ("InstanceNorm2d", "instancenorm", lambda: nn.InstanceNorm2d(4, affine=True), (3, 4, 5, 6)),
]


def _run(m, x, dy, v):
    """y, the gradients of a backward, and those of a double backward (create_graph)."""
    params = list(m.parameters())
    y = m(x)
    g = torch.autograd.grad(y, [x, *params], dy)
    y2 = m(x)
    g2 = torch.autograd.grad(y2, [x, *params], dy, create_graph=True)
    gg = torch.autograd.grad((g2[0] * v).sum() + sum((p * p).sum() for p in g2[1:]), [x, *params])
    with torch.no_grad():
        y0 = m(x)
    return [y, y0, *g, *gg]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("label,name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_same_bits_as_the_python_path(label, name, make, shape, dtype, threads):
    """Each module's outputs, gradients and second-order gradients through the extension
    equal the Python path's bit for bit (the same kernels on the same arguments), and the
    eager calls do go through the extension."""
    require_torch_extension()
    g = torch.Generator().manual_seed(3)
    ref = make().to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_(True)
    dy, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = dt.convert(ref)
        lay = layer(name)
        got = _run(ours, x, dy, v)
        assert lay.plans.last_ext.get("train") is not None  # the extension served these calls
        assert got[0].grad_fn.name() == "DerivgenBackward"
        with python_path(name):
            want = _run(ours, x, dy, v)
            assert not lay.plans.last_ext
    finally:
        torch.set_num_threads(before)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def test_statistics_and_the_functional_face():
    """lay.forward's statistics (BatchNorm's running buffers use them) and function(...)
    through the extension equal the Python path's."""
    require_torch_extension()
    lay = layer("batchnorm")
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    w, b = torch.rand(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    opts = {"eps": 1e-5, "momentum": 0.1}
    got = [lay.forward(x, {"gamma": w, "beta": b}, {}, opts) for _ in range(2)]
    assert lay.plans.last_ext.get("train") is not None
    with python_path("batchnorm"):
        want = lay.forward(x, {"gamma": w, "beta": b}, {}, opts)
    for y, st in got:
        assert torch.equal(y, want[0]) and st.keys() == want[1].keys()
        assert all(torch.equal(st[k], want[1][k]) for k in st)
    f = dt.function("rmsnorm")
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.rand(7, requires_grad=True)
    y = f(x, w, eps=1e-6)
    with python_path("rmsnorm"):
        y0 = f(x, w, eps=1e-6)
    assert torch.equal(y, y0)
    assert torch.equal(torch.autograd.grad(y, x, y)[0], torch.autograd.grad(y0, x, y0)[0])


BAD = [
    (lambda x, w, b: (x.double(), w, b), TypeError, "gamma has dtype float32 but x has float64"),
    (lambda x, w, b: (x, w.double(), b), TypeError, "gamma has dtype float64 but x has float32"),
    (lambda x, w, b: (x.to(torch.int32), w, b), TypeError, "x has dtype torch.int32"),
    (lambda x, w, b: (x, w[:3], b), ValueError, "gamma"),
    (lambda x, w, b: (x[:, :3], w, b), ValueError, "trailing axes of x"),
    (lambda x, w, b: (x, w, b.reshape(2, 3)), ValueError, "beta"),
    (lambda x, w, b: (x.tolist(), w, b), TypeError, "x must be a torch.Tensor"),
]


@pytest.mark.parametrize("bad,err,match", BAD)
def test_bad_calls_after_fast_calls_give_the_same_errors(bad, err, match):
    """A bad call after many good ones (the extension's plan warm) raises what it raises on
    the Python path, and the good calls keep working after it."""
    f = dt.function("layernorm")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 6, generator=g), torch.rand(6, generator=g), torch.randn(6, generator=g)
    for _ in range(3):
        y = f(x, w, b)
    messages = []
    for path in (contextlib.nullcontext, lambda: python_path("layernorm")):
        with path(), pytest.raises(err, match=match) as e:
            f(*bad(x, w, b))
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    for bad_eps, msg in ((-1.0, r"eps must lie in \[0.0, inf\], got -1.0"), (float("nan"), "eps must be finite")):
        with pytest.raises(ValueError, match=msg):
            f(x, w, b, eps=bad_eps)
    assert torch.equal(f(x, w, b), y)


def _graph_errors():
    """The errors of two misuses of a graph: a second backward, an input changed in place."""
    out = []
    m = dt.LayerNorm(8)
    x = torch.randn(3, 8, requires_grad=True)
    y = m(x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as e:
        y.sum().backward()
    out.append(str(e.value))
    y = m(x)
    with torch.no_grad():
        m.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
        y.sum().backward()
    out.append(str(e.value).split("; is at version")[0].split(", which is output")[0])
    return out


def test_graph_misuse_errors_match_the_python_path():
    require_torch_extension()
    got = _graph_errors()
    with python_path("layernorm"):
        want = _graph_errors()
    assert got == want


def _hooked(m, x, dy):
    """Gradients under saved-tensor hooks that count what is packed, and through a
    non-reentrant checkpoint (which recomputes the forward under its own hooks)."""
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    g = torch.autograd.grad(y, [x, *m.parameters()], dy)
    yc = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
    gc = torch.autograd.grad(yc, [x, *m.parameters()], dy)
    return sorted(packed), [*g, *gc]


def test_saved_tensor_hooks_and_checkpoint_as_the_python_path():
    require_torch_extension()
    m = dt.LayerNorm(16)
    x = torch.randn(5, 16, requires_grad=True)
    dy = torch.randn(5, 16)
    packed, got = _hooked(m, x, dy)
    assert packed == [(5, 16), (16,), (16,)]  # x, weight, bias
    with python_path("layernorm"):
        packed0, want = _hooked(m, x, dy)
    assert packed0 == packed
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_without_the_extension_the_python_path_serves_with_a_note(monkeypatch, capsys):
    """Where the extension cannot be built, module() is None after a one-line note on stderr
    (once), and calls run the Python path."""

    def fail():
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(ext, "_STATE", {})
    monkeypatch.setattr(ext, "_build_and_import", fail)
    assert ext.module() is None and ext.module() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "C++ extension unavailable (Ninja is required to load C++ extensions)" in err
    lay = layer("layernorm")
    monkeypatch.setattr(lay.plans, "_plans", {})
    monkeypatch.setattr(lay.plans, "last_ext", {})
    x = torch.randn(3, 8, requires_grad=True)
    m = dt.LayerNorm(8)
    y = m(x)
    y.sum().backward()
    assert not lay.plans.last_ext and type(y.grad_fn).__name__ == "_EagerBackward"
    torch.testing.assert_close(y, nn.functional.layer_norm(x, (8,), m.weight, m.bias), rtol=1e-5, atol=1e-6)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(ext, "_STATE", {})
    monkeypatch.setenv("DERIVGEN_TORCH_EXT", "0")
    assert not ext.enabled() and ext.module() is None
    monkeypatch.setenv("DERIVGEN_TORCH_EXT", "1")
    assert ext.enabled()


def test_compiled_autograd_takes_the_python_path():
    """Under compiled autograd (its context, or torch._dynamo.config.compiled_autograd) a call
    records a Python autograd node, which compiled autograd can trace; the gradients are the
    eager ones."""
    require_torch_extension()
    from torch._dynamo import compiled_autograd

    m = dt.LayerNorm(16).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(m(x).square().sum(), x)  # the C++ path, warm
    x.grad = None
    with compiled_autograd._enable(torch.compile(backend="eager")):
        m(x).square().sum().backward()
    assert torch.equal(x.grad, want)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps and madvise are Linux's")
@pytest.mark.parametrize("path", ["extension", "python"])
def test_large_outputs_are_advised_to_take_huge_pages(path, monkeypatch):
    """y and dx (32 MiB here) are advised to take transparent huge pages before the kernels
    touch them, on both per-call paths: glibc maps them fresh on every call, and the first
    touch of each 4 KiB page is a page fault. Where THP is missing the advice is not taken."""
    monkeypatch.delenv("DERIVGEN_HUGE_PAGES", raising=False)
    if path == "extension":
        require_torch_extension()
    m = dt.LayerNorm(4096)
    x = torch.randn(2048, 4096, requires_grad=True)
    with python_path("layernorm") if path == "python" else contextlib.nullcontext():
        for _ in range(2):  # the first call makes the plan; the second takes the extension
            x.grad = None
            y = m(x)
            y.backward(torch.ones_like(y))
    for t in (y, x.grad):
        assert huge_page_advised(t.data_ptr() + HUGE_PAGE) == HAS_THP
    ref = nn.LayerNorm(4096)
    assert torch.allclose(y, ref(x), atol=1e-5)  # advised memory is ordinary memory


def test_huge_page_advice_needs_a_large_region_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("DERIVGEN_HUGE_PAGES", raising=False)
    t = torch.empty(HUGE_MIN // 4)
    assert advise_huge_pages(t.data_ptr(), HUGE_MIN - 1) is False
    assert advise_huge_pages(t.data_ptr(), HUGE_MIN + HUGE_PAGE) == HAS_THP
    monkeypatch.setenv("DERIVGEN_HUGE_PAGES", "0")
    assert advise_huge_pages(t.data_ptr(), HUGE_MIN + HUGE_PAGE) is False
    assert fresh_like(t).shape == t.shape
