"""The Triton kernels of the zoo's layers with tensor inputs beside x and outputs beside y
(fused residual adds, gates, modulation, masks, several outputs), under Triton's interpreter:
every output and every gradient (x, each tensor input with a gradient, each parameter) in
float32 against the NumPy backend in float64 (which tests/zoo/test_zoo_multi.py holds to the
libraries' own code), with one tile per group and swept in 16-value tiles; channels last;
float16 and bfloat16; cotangents left out; preallocated outputs; empty batches; errors; the
second order (backward_backward and jvp, by the PyTorch closed forms) against double backward
and forward mode of the references of tests/zoo/test_zoo_multi_second.py.

Shapes are off every block multiple: rows of 37 features, 3 samples of 4 channels of 5 x 7."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
from conftest import TESTS, corpus, require_module

torch = require_module("torch")
require_module("triton")
import triton_cases as tc

if str(TESTS / "zoo") not in sys.path:
    sys.path.insert(0, str(TESTS / "zoo"))
import test_zoo_multi_second as Z2

import derivgen
from derivgen.triton.launch import tile_limit

emit_module = importlib.import_module("derivgen.codegen.emit")  # derivgen.codegen.emit is also a function's name

# the kernels run padding rows of a block (GOk false) too, where a masked layer's mean(mask) is
# 0 and its mean 0/0: never stored, but NumPy (the interpreter) warns
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}
ROWS, SAMPLES = (3, 5, 37), (3, 4, 5, 7)  # trailing: (batch, tokens, features); channels: (N, C, H, W)


def multi_zoo() -> list[str]:
    """The zoo's layers with tensor inputs, values or outputs beside y."""
    return [n for n in derivgen.zoo() if derivgen.load_spec(n).multi]


LAYERS = multi_zoo()


def _tensor_shape(spec, kind: str, x: tuple) -> tuple:
    if kind == "x":
        return x
    if spec.layout == "trailing":  # (batch, *features)
        return (x[0], x[-1])
    return x[:2] if kind == "sample" else (x[0], 1, *x[2:])


def draw(name: str, seed: int = 0) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Float64 arguments by name (masks 0/1, at least one valid value per group) and a
    cotangent for y and for every output beside it."""
    spec = derivgen.load_spec(name)
    xs = ROWS if spec.layout == "trailing" else SAMPLES
    rng = np.random.default_rng(seed)
    args = {"x": rng.normal(0.3, 1.3, xs)}
    for t in spec.tensors:
        shape = _tensor_shape(spec, t.shape, xs)
        if t.mask:
            m = (rng.random(shape) < 0.7).astype(np.float64)
            if spec.layout == "trailing":
                m[..., 0] = 1.0  # every row is a group
            else:
                m.reshape(-1)[0] = 1.0  # every channel's group spans the whole batch
            args[t.name] = m
        else:
            args[t.name] = rng.normal(0.0, 0.7, shape)
    for p in spec.params:
        args[p.name] = rng.normal(1.0, 0.4, () if p.scalar else (xs[-1] if spec.layout == "trailing" else xs[1],))
    cots = [rng.normal(size=xs) for _ in range(1 + len(spec.outputs))]
    return args, cots


def f32(v) -> torch.Tensor:
    """A float32 CPU tensor of ``v``."""
    return torch.tensor(np.asarray(v), dtype=torch.float32)


def _positional(spec, args: dict, convert) -> list:
    return [
        convert(args["x"]),
        *(convert(args[t.name]) for t in spec.tensors),
        *(convert(args[p.name]) for p in spec.params),
    ]


def reference(name: str, args: dict, cots: list) -> tuple[list, tuple]:
    """The NumPy backend in float64: the outputs (y first) and the Grads."""
    spec = derivgen.load_spec(name)
    m = derivgen.load(name, backend="numpy")
    outs, cache = m.forward(*_positional(spec, args, np.asarray))
    outs = list(outs) if spec.outputs else [outs]
    grads = m.backward(cots[0], cache, **{o.cotangent.name: c for o, c in zip(spec.outputs, cots[1:])})
    return outs, grads


def run(name: str, args: dict, cots: list, dtype=torch.float32, channels_last: bool = False) -> tuple[list, tuple]:
    """The Triton module's outputs (y first) and Grads, on CPU tensors of ``dtype``; with
    ``channels_last``, x and the cotangents channels last (the tensor inputs as they come)."""
    spec = derivgen.load_spec(name)

    def t(v):
        return torch.tensor(np.asarray(v), dtype=dtype)

    def t_x(v):
        v = t(v)
        return v.contiguous(memory_format=torch.channels_last) if channels_last and v.dim() == 4 else v

    m = derivgen.load(name, backend="triton")
    pos = [t_x(args["x"]), *_positional(spec, args, t)[1:]]
    outs, cache = m.forward(*pos)
    outs = list(outs) if spec.outputs else [outs]
    assert all(o.dtype == dtype and o.stride() == pos[0].stride() for o in outs)
    grads = m.backward(t_x(cots[0]), cache, **{o.cotangent.name: t_x(c) for o, c in zip(spec.outputs, cots[1:])})
    assert grads.dx.stride() == pos[0].stride()
    return outs, grads


def check(name: str, args: dict, cots: list, dtype=torch.float32, channels_last: bool = False) -> None:
    want_outs, want = reference(name, args, cots)
    got_outs, got = run(name, args, cots, dtype, channels_last)
    tol = TOL[dtype]
    where = f"{name} {dtype}{' channels last' if channels_last else ''}"
    assert len(got_outs) == len(want_outs)
    for k, (g, w) in enumerate(zip(got_outs, want_outs)):
        assert tc.relerr(g, w) < tol, f"{where}: output {k} off by {tc.relerr(g, w)}"
    assert got._fields == want._fields
    for f, g, w in zip(got._fields, got, want):
        assert g.dtype == dtype, (where, f)
        assert tc.relerr(g, w) < tol * 4, f"{where}: {f} off by {tc.relerr(g, w)}"


# swept in tiles (the interpreter's slow path): in `make test`, layers that together have every
# feature of the eleven -- a core value read by two outputs beside y and two tensors of x's
# shape, tensors per sample, a per-position mask in batch statistics, a gate in the core value
SWEPT = ["flash_layernorm_parallel", "adaln", "masked_batchnorm", "rmsnorm_gated_before"]


@pytest.mark.parametrize("name", LAYERS)
def test_layer_against_numpy(name):
    """Each group in one tile, held in registers."""
    args, cots = draw(name)
    check(name, args, cots)


@pytest.mark.parametrize("name", corpus(LAYERS, SWEPT))
def test_layer_swept_in_tiles(name):
    """16-value tiles: every group swept, once per sum and for the outputs."""
    args, cots = draw(name, seed=3)
    with tile_limit(16):
        check(name, args, cots)


def test_every_layer_with_tensors_runs_here():
    assert len(LAYERS) == 11 and "add_rmsnorm" in LAYERS and "masked_batchnorm" in LAYERS


@pytest.mark.parametrize("name", ["conditional_batchnorm", "spade", "masked_batchnorm"])
def test_channels_last(name):
    """x channels last, its tensors channels first (of x's shape, per (sample, channel), per
    position): they are written out at x's strides, and y and dx keep x's memory format."""
    args, cots = draw(name, seed=1)
    check(name, args, cots, channels_last=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["flash_layernorm_parallel", "conditional_batchnorm", "adaln"])
def test_half_precision(name, dtype):
    """Computed in float32 on the rounded inputs; a broadcast tensor's gradient summed in float32."""
    args, cots = draw(name, seed=2)
    args = {k: tc.rounded(v, dtype) for k, v in args.items()}
    cots = [tc.rounded(c, dtype) for c in cots]
    check(name, args, cots, dtype)


def test_a_missing_cotangent_is_zero():
    args, cots = draw("flash_layernorm_parallel")
    cots = [cots[0], *(np.zeros_like(c) for c in cots[1:])]
    _, want = reference("flash_layernorm_parallel", args, cots)
    m = derivgen.load("flash_layernorm_parallel", backend="triton")
    spec = derivgen.load_spec("flash_layernorm_parallel")
    _, cache = m.forward(*_positional(spec, args, f32))
    got = m.backward(f32(cots[0]), cache, dy1=None)  # dh not given, dy1 None
    for f, g, w in zip(got._fields, got, want):
        assert tc.relerr(g, w) < 4e-5, f


def test_the_core_value_is_computed_once_and_its_gradient_stored_twice():
    """add_rmsnorm: h = x + residual once per sweep in registers; dL/dh once per element, stored
    as dx and as dresidual (the same float32 values)."""
    from derivgen.codegen.emit import emit

    text = emit(derivgen.derive("add_rmsnorm"), ("triton",)).files["triton/add_rmsnorm.py"]
    one_pass = text.split("if ONE_PASS:")[1].split("else:  # swept in tiles")[0]
    assert one_pass.count("h = x + residual") == 1
    assert "h_Adj = " in text and "tl.store(residual_Dt + Offs, tl.where(Mask, h_Adj, 0.0)" in text
    args, cots = draw("add_rmsnorm")
    (_, h), grads = run("add_rmsnorm", args, cots)
    assert torch.equal(grads.dx, grads.dresidual)
    assert torch.equal(
        h, torch.tensor(args["x"], dtype=torch.float32) + torch.tensor(args["residual"], dtype=torch.float32)
    )


def test_preallocated_outputs():
    name = "flash_layernorm_parallel"
    spec = derivgen.load_spec(name)
    args, _ = draw(name)
    m = derivgen.load(name, backend="triton")
    pos = _positional(spec, args, f32)
    out, y1, h = (torch.empty(ROWS) for _ in range(3))
    (ry, ry1, rh), cache = m.forward(*pos, out=out, outs={"y1": y1, "h": h})
    assert ry is out and ry1 is y1 and rh is h
    (sy, sy1, sh), _ = m.forward(*pos, outs=[None, torch.empty(ROWS)])
    assert torch.equal(sy, out) and torch.equal(sy1, y1) and torch.equal(sh, h)
    dres = torch.empty(ROWS)
    g = m.backward(torch.ones(ROWS), cache, out={"dresidual": dres})
    assert g.dresidual is dres
    with pytest.raises(ValueError, match="outs must have 2 tensors"):
        m.forward(*pos, outs=[h])
    with pytest.raises(ValueError, match="unknown output"):
        m.forward(*pos, outs={"z": h})


@pytest.mark.parametrize("name", ["adaln", "add_rmsnorm", "masked_batchnorm"])
def test_empty_batch(name):
    spec = derivgen.load_spec(name)
    args, _ = draw(name)
    empty = {k: (v[:0] if k == "x" or (v.ndim and v.shape[0] == args["x"].shape[0]) else v) for k, v in args.items()}
    m = derivgen.load(name, backend="triton")
    outs, cache = m.forward(*_positional(spec, empty, f32))
    outs = list(outs) if spec.outputs else [outs]
    assert all(o.shape == empty["x"].shape for o in outs)
    grads = m.backward(torch.zeros(empty["x"].shape), cache)
    for f, g in zip(grads._fields, grads):
        want = empty["x"].shape if f == "dx" else empty[f[1:]].shape
        assert tuple(g.shape) == tuple(want) and not g.any(), f


def test_errors_name_the_argument():
    m = derivgen.load("adaln", backend="triton")
    a, _ = draw("adaln")
    with pytest.raises(ValueError, match=r"shift must have shape \(3, 37\)"):
        m.forward(f32(a["x"]), f32(a["shift"][:2]), f32(a["scale"]))
    with pytest.raises(TypeError, match="scale has dtype torch.float16 but x has torch.float32"):
        m.forward(f32(a["x"]), f32(a["shift"]), f32(a["scale"]).half())
    with pytest.raises(TypeError, match="shift is required"):
        m.forward(f32(a["x"]), None, f32(a["scale"]))
    mm = derivgen.load("masked_layernorm", backend="triton")
    b, _ = draw("masked_layernorm")
    with pytest.raises(ValueError, match="mask is a mask: every value must be 0 or 1"):
        mm.forward(f32(b["x"]), f32(b["mask"] * 0.5), f32(b["weight"]), f32(b["bias"]))
    mr = derivgen.load("add_rmsnorm", backend="triton")
    c, _ = draw("add_rmsnorm")
    (_, h), cache = mr.forward(f32(c["x"]), f32(c["residual"]), f32(c["weight"]))
    with pytest.raises(ValueError, match="dh must have the shape and dtype of x"):
        mr.backward(h, cache, dh=h[:1])


class OnTensors:
    """The Triton module called with NumPy arrays (CPU tensors of their dtype) and giving NumPy
    arrays back: test_zoo_multi_second's ``_generated_second`` runs it as it runs the NumPy
    and C modules, at the same point and with the same seeds."""

    def __init__(self, module) -> None:
        self.m = module

    @staticmethod
    def _in(v):
        if isinstance(v, dict):
            return {k: OnTensors._in(u) for k, u in v.items()}
        return torch.from_numpy(v) if isinstance(v, np.ndarray) else v

    @staticmethod
    def _out(v):
        return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v

    def forward(self, *pos, **kw):
        return self.m.forward(*map(self._in, pos), **kw)

    def backward_backward(self, *a, **kw):
        g = self.m.backward_backward(*map(self._in, a), **{k: self._in(v) for k, v in kw.items()})
        return type(g)(*map(self._out, g))

    def jvp(self, *a, **kw):
        t = self.m.jvp(*map(self._in, a), **{k: self._in(v) for k, v in kw.items()})
        return tuple(map(self._out, t)) if isinstance(t, tuple) else self._out(t)


# an output beside y and a core value, tensors broadcast per sample, a mask
@pytest.mark.parametrize("name", ["add_rmsnorm", "adaln", "masked_layernorm"])
def test_the_second_order(name):
    """``backward_backward`` (every gradient of L2: x, dy, each output's first-order cotangent,
    each tensor with a gradient in its declared shape, each parameter) and ``jvp`` (the tangents
    of y and of the outputs beside it), by the PyTorch closed forms on the tensors' device,
    float32 against double backward and torch.func.jvp of the references
    (tests/zoo/test_zoo_multi_second.py) within its float32 bound."""
    want, want_t = Z2._reference_second(name)
    got, got_t = Z2._generated_second(name, OnTensors(derivgen.load(name, backend="triton")), np.float32)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == np.float32, (name, k)
        assert Z2._rel(got[k], want[k]) < Z2.F32, (name, k, Z2._rel(got[k], want[k]))
    assert len(got_t) == len(want_t)
    for k, (g, w) in enumerate(zip(got_t, want_t)):
        assert Z2._rel(g, w) < Z2.F32, (name, "tangent", k, Z2._rel(g, w))


def test_the_second_orders_arguments():
    """Errors name the argument (ddtensors.<t>, ttensors.<t>, d<output>); ``outs`` takes the
    tangents of the outputs beside y; no seed at all: every gradient zero."""
    m = derivgen.load("adaln", backend="triton")
    a, _ = draw("adaln")
    _, cache = m.forward(f32(a["x"]), f32(a["shift"]), f32(a["scale"]))
    dy = torch.ones(ROWS)
    with pytest.raises(ValueError, match=r"ddtensors.scale must have the shape of scale \(3, 37\)"):
        m.backward_backward(dy, cache, ddtensors={"scale": f32(a["x"])})
    with pytest.raises(ValueError, match="ddtensors has nope, which is not a tensor input with a gradient"):
        m.backward_backward(dy, cache, ddtensors={"nope": f32(a["scale"])})
    with pytest.raises(TypeError, match="ttensors.shift has dtype torch.float16"):
        m.jvp(cache, ttensors={"shift": f32(a["shift"]).half()})
    g = m.backward_backward(dy, cache)
    assert g._fields == ("dx", "ddy", "dshift", "dscale") and all(not v.any() for v in g)
    assert g.dscale.shape == (3, 37)
    mr = derivgen.load("add_rmsnorm", backend="triton")
    c, _ = draw("add_rmsnorm")
    (_, h), rc = mr.forward(f32(c["x"]), f32(c["residual"]), f32(c["weight"]))
    with pytest.raises(ValueError, match="dh must have the shape and dtype of x"):
        mr.backward_backward(dy, rc, dh=h[:1])
    tx = f32(c["x"])
    buf = torch.empty(ROWS)
    ty, th = mr.jvp(rc, tx, ttensors={"residual": tx})
    r = mr.jvp(rc, tx, ttensors={"residual": tx}, outs={"h": buf})
    assert r[1] is buf and torch.equal(buf, th) and torch.equal(th, 2 * tx) and torch.equal(r[0], ty)


# tests/triton_compile_driver.py with the kernel arguments of these layers: the outputs beside
# y (<o>_Out), the cotangents of them (d<o>_Ptr) and the tensors' element gradients (<t>_Dt)
COMPILE = """
import importlib, importlib.util, sys
spec = importlib.util.spec_from_file_location("driver", sys.argv[1])
driver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(driver)  # sets TRITON_INTERPRET=0 before Triton is imported
NAMES = {"output": "{}_Out", "cotangent": "d{}_Ptr", "dtensor": "{}_Dt"}
plain = driver.signature


def signature(roles):
    sig = plain([(r, n) for r, n in roles if r not in NAMES])
    sig.update({NAMES[r].format(n): "*fp32" for r, n in roles if r in NAMES})
    return sig


driver.signature = signature
sys.exit(driver.main(sys.argv[2:]))
"""


def test_the_kernels_compile_for_a_gpu():
    """Two outputs beside y with their cotangents, tensors with element gradients, a mask per
    position in batch statistics: compiled for sm_90 in a process without Triton's interpreter
    (no GPU needed), one tile per group and swept in tiles."""
    import subprocess
    import sys

    from conftest import TESTS

    names = ["flash_layernorm_parallel", "masked_batchnorm"]
    driver = str(TESTS / "triton_compile_driver.py")
    r = subprocess.run(
        [sys.executable, "-c", COMPILE, driver, *names], capture_output=True, text=True, timeout=600, check=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": compiled") == 4 * len(names), r.stdout
