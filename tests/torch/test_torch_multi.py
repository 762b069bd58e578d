"""derivgen.torch for the zoo's layers with tensor inputs beside x and outputs beside y
(fused residual adds, gates, modulation, masks, several outputs): every one through
``derivgen.torch.Module`` on the CPU's C kernels against autograd of the independent
references of tests/zoo/multi_reference.py (outputs and every gradient, float64 and
float32), bfloat16 against float32, the generated PyTorch closed forms (``portable()``, the
generated module's own API, its backward_backward and jvp against double backward and
forward mode of the references, tests/zoo/test_zoo_multi_second.py), torch.func, torch.compile, ``torch.library.opcheck``, bad
arguments, and the drop-in modules ``FusedAddRMSNorm`` and ``RMSNormGated`` against the
references' module forms (vLLM/Liger, Mamba-2)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from conftest import TESTS, require_module

torch = require_module("torch")
if str(TESTS / "zoo") not in sys.path:
    sys.path.insert(0, str(TESTS / "zoo"))
import multi_reference as R
import numpy as np
import test_zoo_multi_second as Z2

import derivgen
import derivgen.torch as dt

F64, F32 = 1e-10, 1e-4


@dataclass(frozen=True)
class Case:
    """One layer: its reference (tensors by the spec's names, options -> outputs in the
    spec's order), x's shape, the tensor inputs' and parameters' shapes, options."""

    reference: Callable
    x: tuple[int, ...]
    tensors: dict[str, tuple[int, ...]]
    params: dict[str, tuple[int, ...]]
    options: dict[str, float] = field(default_factory=dict)


T3 = (3, 5, 8)  # (batch, tokens, features)
C3 = (4, 3, 6)  # (N, C, T)

CASES = {
    "add_rmsnorm": Case(
        lambda a, o: R.add_rmsnorm(a["x"], a["residual"], a["weight"], o["eps"]),
        T3,
        {"residual": T3},
        {"weight": (8,)},
        {"eps": 1e-6},
    ),
    "add_layernorm": Case(
        lambda a, o: R.add_layernorm(a["x"], a["residual"], a["weight"], a["bias"], o["eps"]),
        T3,
        {"residual": T3},
        {"weight": (8,), "bias": (8,)},
        {"eps": 1e-5},
    ),
    "rmsnorm_gated": Case(
        lambda a, o: R.rmsnorm_gated(a["x"], a["z"], a["weight"], o["eps"]),
        T3,
        {"z": T3},
        {"weight": (8,)},
        {"eps": 1e-5},
    ),
    "rmsnorm_gated_before": Case(
        lambda a, o: R.rmsnorm_gated(a["x"], a["z"], a["weight"], o["eps"], norm_before_gate=False),
        T3,
        {"z": T3},
        {"weight": (8,)},
        {"eps": 1e-5},
    ),
    "adaln": Case(
        lambda a, o: R.adaln(a["x"], a["shift"], a["scale"], o["eps"]),
        T3,
        {"shift": (3, 8), "scale": (3, 8)},
        {},
        {"eps": 1e-6},
    ),
    "ada_rmsnorm": Case(
        lambda a, o: R.ada_rmsnorm(a["x"], a["shift"], a["scale"], o["eps"]),
        T3,
        {"shift": (3, 8), "scale": (3, 8)},
        {},
        {"eps": 1e-6},
    ),
    "conditional_batchnorm": Case(
        lambda a, o: R.conditional_batchnorm(a["x"], a["gamma"], a["beta"], o["eps"]),
        C3,
        {"gamma": (4, 3), "beta": (4, 3)},
        {},
        {"eps": 1e-5},
    ),
    "spade": Case(
        lambda a, o: R.spade(a["x"], a["gamma"], a["beta"], o["eps"]), C3, {"gamma": C3, "beta": C3}, {}, {"eps": 1e-5}
    ),
    "masked_batchnorm": Case(
        lambda a, o: R.masked_batchnorm(a["x"], a["mask"], a["weight"], a["bias"], o["eps"]),
        C3,
        {"mask": (4, 1, 6)},
        {"weight": (3,), "bias": (3,)},
        {"eps": 1e-5},
    ),
    "masked_layernorm": Case(
        lambda a, o: R.masked_layernorm(a["x"], a["mask"], a["weight"], a["bias"], o["eps"]),
        T3,
        {"mask": T3},
        {"weight": (8,), "bias": (8,)},
        {"eps": 1e-5},
    ),
    "flash_layernorm_parallel": Case(
        lambda a, o: R.flash_layernorm_parallel(
            a["x"], a["residual"], a["x1"], a["weight"], a["bias"], a["weight1"], a["bias1"], None, o["eps"]
        ),
        T3,
        {"x1": T3, "residual": T3},
        {"weight": (8,), "bias": (8,), "weight1": (8,), "bias1": (8,)},
        {"eps": 1e-6},
    ),
}


def multi_zoo() -> list[str]:
    return [n for n in derivgen.zoo() if derivgen.load_spec(n).multi]


def test_every_multi_tensor_zoo_layer_has_a_case():
    assert sorted(CASES) == multi_zoo()


def draw(name: str, dtype=torch.float64, seed: int = 0) -> dict:
    """Arguments by name (float64 drawn, then cast): masks 0/1 with a valid value per group."""
    case, spec = CASES[name], derivgen.load_spec(name)
    g = torch.Generator().manual_seed(seed)
    a = {"x": torch.randn(case.x, generator=g, dtype=torch.float64) * 1.5 + 0.3}
    for t in spec.tensors:
        shape = case.tensors[t.name]
        if t.mask:
            m = (torch.rand(shape, generator=g, dtype=torch.float64) < 0.7).to(torch.float64)
            if name == "masked_batchnorm":
                m[0, 0, 0] = 1.0
            else:
                m[..., 0] = 1.0
            a[t.name] = m
        else:
            a[t.name] = torch.randn(shape, generator=g, dtype=torch.float64) * 0.7
    for p, shape in case.params.items():
        a[p] = torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 + 1.0
    return {k: v.to(dtype) for k, v in a.items()}


def cotangents(name: str, dtype=torch.float64, seed: int = 1) -> list:
    """A random cotangent for y and for each output beside it."""
    g = torch.Generator().manual_seed(seed)
    n = 1 + len(derivgen.load_spec(name).outputs)
    return [torch.randn(CASES[name].x, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]


def grads_of(name: str) -> list[str]:
    spec = derivgen.load_spec(name)
    return ["x", *(t.name for t in spec.grad_tensors), *CASES[name].params]


def reference(name: str, args: dict, cots: list) -> tuple[list, dict]:
    """The reference's outputs and the gradients of sum(cot * output) by name (autograd)."""
    wrt = grads_of(name)
    ts = {k: v.detach().clone().requires_grad_(k in wrt) for k, v in args.items()}
    outs = CASES[name].reference(ts, CASES[name].options)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    loss = sum((o * c).sum() for o, c in zip(outs, cots))
    got = torch.autograd.grad(loss, [ts[k] for k in wrt])
    return [o.detach() for o in outs], dict(zip(wrt, got))


def module_for(name: str, args: dict) -> torch.nn.Module:
    """``dt.Module`` of a zoo layer, its parameters set to the drawn values."""
    case, spec = CASES[name], derivgen.load_spec(name)
    size = case.x[1] if spec.layout == "channels" else case.x[-1]
    m = dt.Module(name, size, dtype=args["x"].dtype, **case.options)
    with torch.no_grad():
        for p in case.params:
            getattr(m, p).copy_(args[p])
    return m


def through_module(m: torch.nn.Module, name: str, args: dict, cots: list) -> tuple[list, dict]:
    """The module's outputs and gradients (by the reference's names) for the same arguments."""
    spec = derivgen.load_spec(name)
    wrt = grads_of(name)
    ts = {k: v.detach().clone().requires_grad_(k in wrt) for k, v in args.items() if k not in CASES[name].params}
    outs = m(ts["x"], *(ts[t.name] for t in spec.tensors))
    outs = list(outs) if spec.outputs else [outs]
    loss = sum((o * c).sum() for o, c in zip(outs, cots))
    leaves = [ts[k] if k in ts else getattr(m, k) for k in wrt]
    got = torch.autograd.grad(loss, leaves)
    return [o.detach() for o in outs], dict(zip(wrt, got))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def assert_close(name: str, got: tuple, want: tuple, tol: float) -> None:
    (go, gg), (wo, wg) = got, want
    assert len(go) == len(wo)
    for k, (a, b) in enumerate(zip(go, wo)):
        assert rel(a, b) < tol, (name, "output", k, rel(a, b))
    assert sorted(gg) == sorted(wg)
    for k in wg:
        assert rel(gg[k], wg[k]) < tol, (name, "d" + k, rel(gg[k], wg[k]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_module_against_the_reference(name, dtype):
    """Every output and every gradient (x, the tensor inputs with one, the parameters) of
    the module on the C kernels, against autograd of the reference in the same dtype."""
    args, cots = draw(name, dtype), cotangents(name, dtype)
    want = reference(name, {k: v.double() for k, v in args.items()}, [c.double() for c in cots])
    want = ([o.to(dtype) for o in want[0]], {k: v.to(dtype) for k, v in want[1].items()})
    m = module_for(name, args)
    assert_close(name, through_module(m, name, args, cots), want, F64 if dtype == torch.float64 else F32)


def test_bfloat16_add_rmsnorm_is_float32_rounded():
    """bfloat16 on the C kernels (the extras library): outputs and gradients within bfloat16
    rounding of the float32 ones on the same (rounded) arguments."""
    name = "add_rmsnorm"
    args = {k: v.to(torch.bfloat16) for k, v in draw(name).items()}
    cots = [c.to(torch.bfloat16) for c in cotangents(name)]
    m16 = module_for(name, args)
    got = through_module(m16, name, args, cots)
    a32 = {k: v.float() for k, v in args.items()}
    want = through_module(module_for(name, a32), name, a32, [c.float() for c in cots])
    assert all(o.dtype == torch.bfloat16 for o in got[0]) and all(g.dtype == torch.bfloat16 for g in got[1].values())
    for a, b in zip(got[0], want[0]):
        assert rel(a.float(), b) < 2**-7, rel(a.float(), b)
    for k in want[1]:  # dweight sums 15 rows of bfloat16 products
        assert rel(got[1][k].float(), want[1][k]) < 2**-6, (k, rel(got[1][k].float(), want[1][k]))


# the generated PyTorch closed forms: outputs beside y, tensors of x's shape, broadcast per
# sample and a position mask, a core value, both layouts
PORTABLE = [
    "add_rmsnorm",
    "adaln",
    "conditional_batchnorm",
    "flash_layernorm_parallel",
    "masked_batchnorm",
    "rmsnorm_gated_before",
]


@pytest.mark.parametrize("name", PORTABLE)
def test_the_generated_pytorch_closed_forms(name):
    """Within ``portable()`` the module runs the generated PyTorch forward and its
    closed-form backward (what other devices run): float64 against the reference."""
    args, cots = draw(name), cotangents(name)
    want = reference(name, args, cots)
    with dt.portable():
        got = through_module(module_for(name, args), name, args, cots)
    assert_close(name, got, want, F64)


@pytest.mark.parametrize("name", ["add_rmsnorm", "adaln", "masked_batchnorm"])
def test_the_generated_pytorch_module(name):
    """``derivgen.load(name, "torch")``: the NumPy module's calling convention on tensors,
    d<output> cotangents (None: zeros), d<tensor> gradients summed over broadcast axes; the
    second order below."""
    spec = derivgen.load_spec(name)
    mod = derivgen.load(name, backend="torch")
    args, cots = draw(name), cotangents(name)
    want = reference(name, args, cots)
    pos = [args["x"], *(args[t.name] for t in spec.tensors), *(args[p] for p in CASES[name].params)]
    outs, cache = mod.forward(*pos, **CASES[name].options)
    outs = list(outs) if spec.outputs else [outs]
    g = mod.backward(cots[0], cache, **{"d" + o.name: c for o, c in zip(spec.outputs, cots[1:])})
    got = {"x": g.dx, **{t.name: getattr(g, "d" + t.name) for t in spec.grad_tensors}}
    got.update({p: getattr(g, "d" + p) for p in CASES[name].params})
    assert_close(name, (outs, got), want, F64)


class OnTensors:
    """A generated PyTorch module called with NumPy arrays (tensors of their dtype) and giving
    NumPy arrays back: test_zoo_multi_second's ``_generated_second`` runs it as it runs the
    NumPy and C modules, at the same point and with the same seeds."""

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


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_generated_second_order(name):
    """``backward_backward`` (every gradient of L2 = sum(ddx*dx) + sum(ddt*dt) + sum(ddp*dp):
    x, dy, each output's first-order cotangent, each tensor with a gradient in its declared
    shape, each parameter) and ``jvp`` (the tangent of y and of every output beside it) of
    ``derivgen.load(name, "torch")``, float64, against double backward and torch.func.jvp of
    the independent reference (tests/zoo/test_zoo_multi_second.py)."""
    want, want_t = Z2._reference_second(name)
    got, got_t = Z2._generated_second(name, OnTensors(derivgen.load(name, backend="torch")), np.float64)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == np.float64, (name, k)
        assert Z2._rel(got[k], want[k]) < Z2.F64, (name, k, Z2._rel(got[k], want[k]))
    assert len(got_t) == len(want_t)
    for k, (g, w) in enumerate(zip(got_t, want_t)):
        assert Z2._rel(g, w) < Z2.F64, (name, "tangent", k, Z2._rel(g, w))


def test_the_second_order_float32_and_preallocated():
    """float32 (computed in float32) within the zoo's float32 bound; ``out`` and ``outs``
    written where given; a float16 forward's second order in float16."""
    name = "flash_layernorm_parallel"
    mod = derivgen.load(name, backend="torch")
    want, want_t = Z2._reference_second(name)
    got, got_t = Z2._generated_second(name, OnTensors(mod), np.float32)
    for k in want:
        assert got[k].dtype == np.float32 and Z2._rel(got[k], want[k]) < Z2.F32, k
    for g, w in zip(got_t, want_t):
        assert Z2._rel(g, w) < Z2.F32
    spec = derivgen.load_spec(name)
    a = draw(name)
    pos = [a["x"], *(a[t.name] for t in spec.tensors), *(a[p] for p in CASES[name].params)]
    _, cache = mod.forward(*pos, **CASES[name].options)
    tx = torch.ones_like(a["x"])
    ty, ty1, th = mod.jvp(cache, tx)
    buf = [torch.empty_like(a["x"]) for _ in range(3)]
    r = mod.jvp(cache, tx, out=buf[0], outs={"h": buf[2]})
    assert r[0] is buf[0] and r[2] is buf[2] and torch.equal(r[1], ty1)
    assert torch.equal(buf[0], ty) and torch.equal(buf[2], th) and torch.equal(th, tx)  # h = x + residual
    r = mod.jvp(cache, tx, outs=[buf[1], None])  # y1, h
    assert r[1] is buf[1] and torch.equal(buf[1], ty1)
    dy = torch.ones_like(a["x"])
    dres = torch.empty_like(a["residual"])
    g = mod.backward_backward(dy, cache, tx, out={"dresidual": dres})
    assert g.dresidual is dres
    a16 = {k: v.half() for k, v in draw("adaln").items()}
    m16 = derivgen.load("adaln", backend="torch")
    _, c16 = m16.forward(a16["x"], a16["shift"], a16["scale"])
    g16 = m16.backward_backward(torch.ones_like(a16["x"]), c16, torch.ones_like(a16["x"]))
    assert all(v.dtype == torch.float16 for v in g16) and g16.dscale.shape == (3, 8)
    assert m16.jvp(c16, ttensors={"scale": torch.ones_like(a16["scale"])}).dtype == torch.float16


def test_the_second_orders_arguments_are_named():
    """Seeds of a broadcast tensor in its declared shape, a known name, x's dtype; outputs'
    cotangents of x's shape; no seed at all: every gradient zero (L2 = 0)."""
    m = derivgen.load("adaln", backend="torch")
    a = draw("adaln")
    _, cache = m.forward(a["x"], a["shift"], a["scale"])
    dy = torch.ones_like(a["x"])
    with pytest.raises(ValueError, match=r"ddtensors.scale must have the shape of scale \(3, 8\)"):
        m.backward_backward(dy, cache, ddtensors={"scale": a["x"]})
    with pytest.raises(ValueError, match="ddtensors has nope, which is not a tensor input with a gradient"):
        m.backward_backward(dy, cache, ddtensors={"nope": a["scale"]})
    with pytest.raises(TypeError, match="ttensors.shift has dtype torch.float32"):
        m.jvp(cache, ttensors={"shift": a["shift"].float()})
    with pytest.raises(TypeError, match="ttensors must be a dict by tensor name"):
        m.jvp(cache, ttensors=[a["shift"]])
    g = m.backward_backward(dy, cache)
    assert g._fields == ("dx", "ddy", "dshift", "dscale") and all(not v.any() for v in g)
    mr = derivgen.load("add_rmsnorm", backend="torch")
    b = draw("add_rmsnorm")
    _, rc = mr.forward(b["x"], b["residual"], b["weight"])
    with pytest.raises(ValueError, match="dh must have the shape and dtype of x"):
        mr.backward_backward(torch.ones_like(b["x"]), rc, dh=b["x"][:1])
    mm = derivgen.load("masked_layernorm", backend="torch")
    c = draw("masked_layernorm")
    _, mc = mm.forward(c["x"], c["mask"], c["weight"], c["bias"])
    with pytest.raises(ValueError, match="ddtensors has mask, which is not a tensor input with a gradient"):
        mm.backward_backward(torch.ones_like(c["x"]), mc, ddtensors={"mask": c["mask"]})


def test_a_cotangent_left_out_is_zero():
    """A loss that reads y alone: h's cotangent is zero, on the C kernels and the closed forms."""
    name = "add_rmsnorm"
    args, cots = draw(name), cotangents(name)
    cots[1] = torch.zeros_like(cots[1])
    want = reference(name, args, cots)
    for portable in (False, True):
        with dt.portable(portable):
            m = module_for(name, args)
            x, r = (args[k].clone().requires_grad_() for k in ("x", "residual"))
            y, _ = m(x, r)
            got = torch.autograd.grad((y * cots[0]).sum(), (x, r, m.weight))
        for k, v in zip(("x", "residual", "weight"), got):
            assert rel(v, want[1][k]) < F64, (portable, k)


@pytest.mark.parametrize("name", ["add_rmsnorm", "adaln", "masked_layernorm"])
def test_torch_func_grad_and_vjp(name):
    """torch.func.grad and vjp (first order) run the generated PyTorch forward: the same
    gradients as autograd on the C kernels."""
    spec = derivgen.load_spec(name)
    args, cots = draw(name), cotangents(name)
    m = module_for(name, args)
    want = through_module(m, name, args, cots)
    wrt = [k for k in grads_of(name) if k not in CASES[name].params]
    params = {p: getattr(m, p).detach() for p in CASES[name].params}

    def loss(vals: dict, ps: dict) -> torch.Tensor:
        a = {**args, **vals}
        outs = torch.func.functional_call(m, ps, (a["x"], *(a[t.name] for t in spec.tensors)))
        outs = outs if spec.outputs else (outs,)
        return sum((o * c).sum() for o, c in zip(outs, cots))

    g_vals, g_params = torch.func.grad(loss, argnums=(0, 1))({k: args[k] for k in wrt}, params)
    for k in wrt:
        assert rel(g_vals[k], want[1][k]) < F64, k
    for p in params:
        assert rel(g_params[p], want[1][p]) < F64, p

    def outputs(x):
        outs = m(x, *(args[t.name] for t in spec.tensors))
        return outs if spec.outputs else (outs,)

    outs, vjp = torch.func.vjp(outputs, args["x"])
    for a, b in zip(outs, want[0]):
        assert rel(a, b) < F64
    (dx,) = vjp(tuple(cots))
    assert rel(dx, want[1]["x"]) < F64


def test_gradcheck_and_gradgradcheck():
    """First derivatives through the C kernels, second (the backward operator's autograd:
    torch.func over the generated PyTorch backward) against finite differences."""
    g = torch.Generator().manual_seed(7)
    x, x1, r = (torch.randn(2, 4, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    ps = [(torch.randn(4, dtype=torch.float64, generator=g) + 1).requires_grad_() for _ in range(4)]
    f = dt.function("flash_layernorm_parallel")
    assert torch.autograd.gradcheck(lambda *a: f(*a, eps=1e-6), (x, x1, r, *ps))
    assert torch.autograd.gradgradcheck(lambda *a: f(*a, eps=1e-6), (x, x1, r, *ps))


def test_torch_compile_matches_eager():
    """torch.compile (fullgraph: no graph breaks) of a module of add_rmsnorm traces its
    operators through their fake kernels; outputs and gradients equal eager's."""
    name = "add_rmsnorm"
    args, cots = draw(name), cotangents(name)
    m = module_for(name, args)
    want = through_module(m, name, args, cots)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    got = through_module(compiled, name, args, cots)
    assert_close(name, got, want, 0.0 + 1e-15)


def test_opcheck():
    """Schema, fake kernels, autograd registration and AOT dispatch (dynamic shapes) of
    add_rmsnorm's forward and backward operators."""
    from derivgen.torch.ops import layer

    lay = layer("add_rmsnorm")
    ops = lay.modes["train"]
    args = draw("add_rmsnorm")
    fargs = [args["x"].requires_grad_(), args["residual"].requires_grad_(), args["weight"].requires_grad_()]
    res = torch.library.opcheck(ops.forward, (*fargs, 1e-6, 0))
    assert all(v == "SUCCESS" for v in res.values()), res
    _, _, *stats = ops.forward(*fargs, 1e-6, 0)
    dy, dh = cotangents("add_rmsnorm")
    res = torch.library.opcheck(ops.backward, (dy, dh, *fargs, *stats, 1e-6, 0))
    assert all(v == "SUCCESS" for v in res.values()), res


# ------------------------------------------------------------------ the drop-in modules


def _pair_grads(mine, ref, inputs: list, cots: list) -> None:
    """The two modules' outputs and gradients (inputs and weight) agree to 1e-10 (float64)."""
    a = [t.detach().clone().requires_grad_() for t in inputs]
    b = [t.detach().clone().requires_grad_() for t in inputs]
    out_a, out_b = mine(*a), ref(*b)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    assert len(out_a) == len(out_b)
    for u, v in zip(out_a, out_b):
        assert rel(u, v) < F64
    ga = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out_a, cots)), [*a, mine.weight])
    gb = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out_b, cots)), [*b, ref.weight])
    for k, (u, v) in enumerate(zip(ga, gb)):
        assert rel(u, v) < F64, k


def _random_weight(*mods) -> None:
    w = torch.randn(mods[0].weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) + 1.0
    with torch.no_grad():
        for m in mods:
            m.weight.copy_(w)


def test_fused_add_rmsnorm_is_vllm_and_liger():
    """FusedAddRMSNorm(hidden_size, eps) with forward(x, residual) -> (y, h), weight
    initialized to ones, equals the reference module (vLLM/Liger semantics); residual=None
    is plain RMSNorm."""
    g = torch.Generator().manual_seed(3)
    mine = dt.FusedAddRMSNorm(16, eps=1e-6, dtype=torch.float64)
    ref = R.FusedAddRMSNormRef(16, eps=1e-6, dtype=torch.float64)
    assert torch.equal(mine.weight, torch.ones(16, dtype=torch.float64))
    assert list(mine.state_dict()) == ["weight"] and mine.variance_epsilon == 1e-6
    _random_weight(mine, ref)
    x, r = (torch.randn(2, 7, 16, dtype=torch.float64, generator=g) for _ in range(2))
    cots = [torch.randn(2, 7, 16, dtype=torch.float64, generator=g) for _ in range(2)]
    _pair_grads(mine, ref, [x, r], cots)
    y = mine(x)
    assert rel(y, torch.nn.functional.rms_norm(x, (16,), mine.weight, 1e-6)) < F64


@pytest.mark.parametrize("gated", [True, False], ids=["z", "no-z"])
@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_rmsnorm_gated_is_mamba2s(norm_before_gate, group_size, gated):
    """RMSNormGated(hidden_size, eps, group_size, norm_before_gate) with forward(x, z=None)
    equals the reference of Mamba-2's class: both gate positions, one group and groups of 4,
    with a gate and without."""
    g = torch.Generator().manual_seed(4)
    kw = {"eps": 1e-5, "group_size": group_size, "norm_before_gate": norm_before_gate, "dtype": torch.float64}
    mine, ref = dt.RMSNormGated(16, **kw), R.RMSNormGatedRef(16, **kw)
    assert mine.bias is None and torch.equal(mine.weight, torch.ones(16, dtype=torch.float64))
    _random_weight(mine, ref)
    x, z = (torch.randn(3, 5, 16, dtype=torch.float64, generator=g) for _ in range(2))
    cots = [torch.randn(3, 5, 16, dtype=torch.float64, generator=g)]
    _pair_grads(mine, ref, [x, z] if gated else [x], cots)


# ------------------------------------------------------------------ errors and layouts


def test_bad_tensor_inputs_are_named():
    """Errors name the tensor input: its shape, dtype, a mask's values, a missing one."""
    args = draw("adaln")
    m = dt.Module("adaln", 8)
    with pytest.raises(ValueError, match=r"shift must have shape \(3, 8\)"):
        m(args["x"], args["shift"][:2], args["scale"])
    with pytest.raises(TypeError, match="scale has dtype torch.float32 but x has torch.float64"):
        m(args["x"], args["shift"], args["scale"].float())
    with pytest.raises(TypeError, match=r"missing \['scale'\]"):
        m(args["x"], args["shift"])
    a = draw("masked_layernorm")
    mm = module_for("masked_layernorm", a)
    mm(a["x"], a["mask"])  # a valid call first: the plan of this signature exists
    for portable in (False, True):
        with dt.portable(portable), pytest.raises(ValueError, match="mask is a mask: every value must be 0 or 1"):
            mm(a["x"], a["mask"] * 0.5)


X4 = (4, 3, 48, 64)  # (N, C, H, W): over SERIAL_BELOW values (threads), whole chunks of lanes
CHANNEL_MULTI = [n for n in sorted(CASES) if derivgen.load_spec(n).layout == "channels"]


def _as_4d(case: Case) -> Case:
    """A channel-layout case with x of shape X4, its tensors' shapes to match."""
    four = {C3: X4, (C3[0], 1, C3[2]): (X4[0], 1, *X4[2:]), C3[:2]: X4[:2]}
    return dataclasses.replace(case, x=X4, tensors={t: four[s] for t, s in case.tensors.items()})


@pytest.mark.parametrize("name", CHANNEL_MULTI)
def test_channels_last_runs_its_own_kernels_with_the_nchw_bits(name, monkeypatch):
    """A channels-last x runs the channels-last kernels (tensors of x's shape channels last
    too, broadcast ones as given): outputs and gradients channels last, the same bits as the
    NCHW call in float64, float32 and bfloat16 on 1 and 2 threads, and the reference's values."""
    monkeypatch.setitem(CASES, name, _as_4d(CASES[name]))
    args64, cots64 = draw(name), cotangents(name)
    want = reference(name, args64, cots64)
    cl = torch.channels_last
    threads = torch.get_num_threads()
    try:
        for dtype, tol in ((torch.float64, F64), (torch.float32, F32), (torch.bfloat16, None)):
            args = {k: v.to(dtype) for k, v in args64.items()}
            cots = [c.to(dtype) for c in cots64]
            m = module_for(name, args)
            got = {}
            for nth in (1, 2):
                torch.set_num_threads(nth)
                got[(nth, "nchw")] = through_module(m, name, args, cots)
                last = {k: v.contiguous(memory_format=cl) if v.shape == X4 else v for k, v in args.items()}
                got[(nth, "nhwc")] = outs, grads = through_module(
                    m, name, last, [c.contiguous(memory_format=cl) for c in cots]
                )
                assert all(o.is_contiguous(memory_format=cl) for o in outs), name
                assert grads["x"].is_contiguous(memory_format=cl), name
            assert any(p.nhwc for p in m._layer.plans._plans.values()), name
            (o0, g0) = got[(1, "nchw")]
            for key, (o, g) in got.items():
                assert all(torch.equal(a, b) for a, b in zip(o, o0)), (name, dtype, key, "outputs")
                assert sorted(g) == sorted(g0) and all(torch.equal(g[k], g0[k]) for k in g0), (name, dtype, key)
            if tol is not None:
                typed = ([o.to(dtype) for o in want[0]], {k: v.to(dtype) for k, v in want[1].items()})
                assert_close(name, got[(2, "nhwc")], typed, tol)
    finally:
        torch.set_num_threads(threads)
    if not derivgen.load_spec(name).params:  # the C binding's positional call: tensors only
        _c_binding_bits(name, args64, cots64)


T4 = (3, 300, 40)  # (batch, tokens, features): over SERIAL_BELOW values; 300 rows per sample
# are several units of DG_SAMPLE_ROWS (128) rows, the last not a whole number of DG_ROWS
TRAILING_PER_SAMPLE = [
    n
    for n in sorted(CASES)
    if any(t.shape == "sample" for t in derivgen.load_spec(n).tensors) and derivgen.load_spec(n).layout == "trailing"
]


@pytest.mark.parametrize("name", TRAILING_PER_SAMPLE)
def test_per_sample_tensor_gradients_are_the_kernels_sums_with_the_same_bits_on_any_thread_count(name, monkeypatch):
    """A trailing layout's per-sample tensors (shift and scale of DiT's modulate) go to the C
    kernels at their own shape and the backward kernel sums their gradients: against
    autograd of the reference in float64 and float32, and the same bits (outputs and every
    gradient) on 1 and 2 threads; the NumPy C binding's gradients too."""
    case = CASES[name]
    per_sample = {t: (T4[0], T4[-1]) for t in case.tensors}
    monkeypatch.setitem(CASES, name, dataclasses.replace(case, x=T4, tensors=per_sample))
    args64, cots64 = draw(name), cotangents(name)
    want = reference(name, args64, cots64)
    threads = torch.get_num_threads()
    try:
        for dtype, tol in ((torch.float64, F64), (torch.float32, F32)):
            args = {k: v.to(dtype) for k, v in args64.items()}
            cots = [c.to(dtype) for c in cots64]
            m = module_for(name, args)
            got = {}
            for nth in (1, 2):
                torch.set_num_threads(nth)
                got[nth] = through_module(m, name, args, cots)
            (o1, g1), (o2, g2) = got[1], got[2]
            assert all(torch.equal(a, b) for a, b in zip(o1, o2)), (name, dtype, "outputs")
            assert sorted(g1) == sorted(g2) and all(torch.equal(g1[k], g2[k]) for k in g1), (name, dtype)
            typed = ([o.to(dtype) for o in want[0]], {k: v.to(dtype) for k, v in want[1].items()})
            assert_close(name, got[2], typed, tol)
    finally:
        torch.set_num_threads(threads)
    _c_binding_bits(name, args64, cots64)


def _c_binding_bits(name: str, args64: dict, cots64: list) -> None:
    """The NumPy C binding's gradients of a layer without outputs beside y: the same bits on
    1 and 2 threads, and the NumPy target's values."""
    spec = derivgen.load_spec(name)
    a = {k: v.numpy() for k, v in args64.items()}
    dy = cots64[0].numpy()
    ref = derivgen.load(name, backend="numpy")
    _, c = ref.forward(a["x"], *(a[t.name] for t in spec.tensors))
    want_np = ref.backward(dy, c)
    mod = derivgen.load(name, backend="c")
    out = []
    for nth in (1, 2):
        mod.set_num_threads(nth)
        _, c = mod.forward(a["x"], *(a[t.name] for t in spec.tensors))
        out.append(mod.backward(dy, c))
    mod.set_num_threads(0)
    for f, p, q, r in zip(want_np._fields, out[0], out[1], want_np):
        np.testing.assert_array_equal(p, q, err_msg=f"{name} {f}")
        np.testing.assert_allclose(p, r, rtol=1e-11, atol=1e-11, err_msg=f"{name} {f}")


def test_tensor_inputs_by_keyword_and_as_a_function():
    """Tensor inputs by name as well as by position; ``dt.function`` takes them before the
    parameters; a layer without them refuses a second positional tensor, naming itself."""
    args = draw("adaln")
    m = dt.Module("adaln", 8)
    y = m(args["x"], args["shift"], args["scale"])
    assert torch.equal(m(args["x"], scale=args["scale"], shift=args["shift"]), y)
    assert torch.equal(m(args["x"], args["shift"], scale=args["scale"]), y)
    assert torch.equal(dt.function("adaln")(args["x"], args["shift"], args["scale"], eps=1e-6), y)
    a = draw("add_layernorm")
    f = dt.function("add_layernorm")
    y1, h1 = f(a["x"], a["residual"], a["weight"], a["bias"])
    y2, h2 = f(a["x"], residual=a["residual"], weight=a["weight"], bias=a["bias"])
    assert torch.equal(y1, y2) and torch.equal(h1, h2) and torch.equal(h1, a["x"] + a["residual"])
    with pytest.raises(TypeError, match="layernorm: forward takes x positionally, got 2 tensors"):
        dt.Module("layernorm", 8, dtype=torch.float64)(a["x"], a["residual"])


@pytest.mark.full  # torch.compile compiles three functions: a minute on a 2-core machine
def test_the_fused_bench_rows():
    """``derivgen bench --torch``'s fused rows: derivgen.torch's module, the same function in eager
    PyTorch and through torch.compile, each phase, and the floor of the bytes they must move
    (timings are not asserted: the ratios and the floor's arithmetic)."""
    from derivgen.tools.bench_torch import FUSED, _fused_lines, _fused_row
    from derivgen.tools.timing import Bandwidth

    label, make, fn, _, sweeps = FUSED[0]
    assert label == "FusedAddRMSNorm" and sweeps == 8
    gen = torch.Generator().manual_seed(0)
    row = _fused_row(label, make, fn, (16, 64), sweeps, torch.float32, gen, 2, Bandwidth(1, mib=8))
    best = max(row["bandwidth"]["copy_GBps"], row["bandwidth"]["stream_copy_GBps"])
    assert row["floor_fwd_ms"] == pytest.approx(4 * 16 * 64 * 4 / (best * 1e6))
    assert row["fwd_vs_eager"] == pytest.approx(row["derivgen_fwd"] / row["eager_fwd"])
    assert row["bwd_vs_compile"] == pytest.approx(row["derivgen_bwd"] / row["compile_bwd"])
    text = "\n".join(_fused_lines([row]))
    assert "FusedAddRMSNorm" in text and max(map(len, text.splitlines())) <= 100
