"""The zoo: every published layer shipped as a spec (derivgen/spec/zoo/) against an independent
PyTorch implementation of its paper's forward, written here from the paper, never from the
spec. PyTorch's autograd of that forward gives the reference gradients: first order (dx, the
parameter and input gradients), the double backward (the VJP of the backward, with random
cotangents) and the JVP, in both backends (NumPy and C) and both dtypes (float64 to 1e-10,
float32 to 1e-4, relative to the largest reference value)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from conftest import QUICK_CFLAGS, block_layer

import derivgen
from derivgen.tools.bench_zoo_refs import (  # the papers' forwards, shared with derivgen bench --zoo
    absmax_scale,
    adain,
    adanorm,
    batch_renorm,
    derf,
    dynamic_tanh,
    edm2_normalize,
    evonorm_b0,
    evonorm_s0,
    frn,
    gemma_rmsnorm,
    l1_batchnorm,
    l2_normalize,
    layernorm2d,
    layernorm_annotated,
    layernorm_simple,
    log_softmax,
    lrn,
    mean_only_bn,
    pixelnorm,
    polynorm,
    prmsnorm,
    scaled_ws,
    scalenorm,
    softmax,
    softmax_temperature,
    squash,
    switchnorm,
    weight_norm,
    weight_standardization,
)

F64, F32 = 1e-10, 1e-4


def single_tensor_zoo() -> list[str]:
    """The zoo's layers with x alone and y alone (those with tensor inputs or outputs beside y
    are test_zoo_multi.py's)."""
    return [n for n in derivgen.zoo() if not derivgen.load_spec(n).multi]


@dataclass
class Case:
    """How to exercise one zoo layer: its reference forward, the shape of x, values of the
    inputs and buffers (per group), options to pass, and the modes to check."""

    forward: Callable
    shape: tuple[int, ...]
    inputs: Callable[[np.random.Generator, tuple], dict] = lambda rng, shape: {}
    buffers: Callable[[tuple], dict] = lambda shape: {}
    options: dict = field(default_factory=dict)
    scale: float = 1.0  # of x
    positive: bool = False  # x > 0 (no sign changes near a kink)


def _per_row(name, low=0.5, high=2.0):
    return lambda rng, shape: {name: rng.uniform(low, high, size=shape[:-1])}


CASES: dict[str, Case] = {
    "frn": Case(frn, (2, 3, 4, 5)),
    "batch_renorm": Case(
        batch_renorm,
        (6, 3, 2, 3),
        # channel 0: r clipped up and d clipped; channel 1: inside; channel 2: r clipped down
        buffers=lambda shape: {"running_mean": np.array([3.0, 0.1, -0.5]), "running_std": np.array([0.2, 1.1, 5.0])},
    ),
    "adanorm": Case(adanorm, (4, 7)),
    "derf": Case(derf, (3, 6)),
    "l2_normalize": Case(l2_normalize, (4, 9)),
    "evonorm_s0": Case(evonorm_s0, (2, 4, 3, 3), options={"num_groups": 2}),
    # both sides of the maximum taken: channel-wise batch std near v*x + instance std
    "evonorm_b0": Case(evonorm_b0, (3, 4, 2, 3), buffers=lambda shape: {"running_var": np.array([0.5, 1.0, 2.0, 4.0])}),
    "weight_norm": Case(weight_norm, (5, 6), inputs=_per_row("gain")),
    "polynorm": Case(polynorm, (3, 8)),
    "scalenorm": Case(scalenorm, (4, 9)),
    "dynamic_tanh": Case(dynamic_tanh, (3, 6)),
    "gemma_rmsnorm": Case(gemma_rmsnorm, (3, 8)),
    "layernorm_simple": Case(layernorm_simple, (3, 8)),
    "pixelnorm": Case(pixelnorm, (2, 3, 8)),
    "squash": Case(squash, (4, 6)),
    "weight_standardization": Case(weight_standardization, (4, 9)),
    "scaled_ws": Case(scaled_ws, (4, 9), inputs=_per_row("gain")),
    "mean_only_bn": Case(mean_only_bn, (5, 3, 4), buffers=lambda shape: {"running_mean": np.array([0.5, -1.0, 2.0])}),
    "layernorm_annotated": Case(layernorm_annotated, (3, 8)),
    "l1_batchnorm": Case(
        l1_batchnorm,
        (6, 3, 2, 2),
        buffers=lambda shape: {"running_mean": np.array([0.3, -0.2, 0.0]), "running_scale": np.array([0.9, 1.2, 2.0])},
    ),
    "adain": Case(
        adain,
        (2, 3, 3, 4),
        inputs=lambda rng, shape: {
            "style_mean": rng.normal(size=shape[:2]),
            "style_std": rng.uniform(0.5, 2.0, size=shape[:2]),
        },
    ),
    "edm2_normalize": Case(edm2_normalize, (4, 9)),
    "softmax": Case(softmax, (4, 9), scale=3.0),
    "log_softmax": Case(log_softmax, (4, 9), scale=3.0),
    "absmax_scale": Case(absmax_scale, (4, 9)),
    "prmsnorm": Case(prmsnorm, (3, 40)),
    "softmax_temperature": Case(softmax_temperature, (4, 9), scale=3.0),
    "layernorm2d": Case(layernorm2d, (2, 5, 3, 7)),
    "switchnorm": Case(switchnorm, (3, 4, 2, 3)),
    # options away from the defaults, where the window's share of the gradient is not small
    "lrn": Case(lrn, (2, 7, 3, 5), options={"alpha": 0.5, "k": 1.5, "size": 4}),
}


def test_the_readme_lists_every_zoo_layer_with_its_reductions():
    """README's zoo table: one row per zoo layer, its reductions per group as derived."""
    from conftest import ROOT

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`") and cells[1].strip("`") in CASES:
            rows[cells[1].strip("`")] = cells
    assert sorted(rows) == single_tensor_zoo()
    for name, cells in rows.items():
        d = derivgen.derive(name)
        want = "; ".join(f"{mode}: {m.reduction_summary}" for mode, m in d.modes.items())
        assert cells[3] == want, name
        assert "proven" in cells[4] or "checked numerically" in cells[4]


def test_every_zoo_layer_has_a_reference_case():
    assert sorted(CASES) == single_tensor_zoo()
    assert len(single_tensor_zoo()) >= 25
    assert not set(derivgen.zoo()) & set(derivgen.names())


def _rel(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = want.detach().double().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


class Problem:
    """One draw of a layer's arguments, as NumPy arrays (float64) by name."""

    def __init__(self, name: str, seed: int = 0):
        self.spec = derivgen.load_spec(name)
        self.case = case = CASES[name]
        rng = np.random.default_rng(seed)
        shape = case.shape
        self.x = rng.normal(size=shape) * case.scale
        channels = shape[1] if self.spec.layout == "channels" else shape[-1]
        self.params = {
            p.name: (rng.normal() * 0.3 + p.init) * np.ones(())
            if p.scalar
            else rng.normal(size=channels) * 0.3 + p.init
            for p in self.spec.params
        }
        if "tau" in self.params:  # a threshold inside the range of gamma*x̂ + beta
            self.params["tau"] = rng.normal(size=channels) * 0.5
        self.inputs = case.inputs(rng, shape)
        self.buffers = case.buffers(shape)
        self.options = {o.name: o.default for o in self.spec.options}
        self.layout_options = dict(case.options)
        self.dy = rng.normal(size=shape)
        self.rng = rng

    def torch_forward(self, x, params, inputs, training=True, buffers=None):
        opts = {**self.options, **self.layout_options}
        bufs = {k: torch.tensor(v) for k, v in self.buffers.items()} if buffers is None else buffers
        return self.case.forward(x, params, inputs, opts, bufs, training)


def _tensors(d: dict, grad: bool = True) -> dict:
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=grad) for k, v in d.items()}


def _modes(spec) -> list[bool]:
    return [m.name == "train" for m in spec.modes]


def _call_forward(k, prob: Problem, dt, training: bool):
    kw = {**{n: v.astype(dt) for n, v in prob.inputs.items()}, **prob.layout_options}
    bufs = {n: v.astype(dt).copy() for n, v in prob.buffers.items()}
    if bufs:
        kw.update(bufs, training=training)
    y, cache = k.forward(
        prob.x.astype(dt), *(np.asarray(prob.params[p.name], dtype=dt) for p in prob.spec.params), **kw
    )
    return y, cache, bufs


@pytest.fixture(autouse=True)
def _compile_at_o1(monkeypatch):
    """The zoo's C modules are compiled at -O1 here, as the spec fuzzer compiles its specs:
    these tests check values, not speed, and switchnorm's 22,000 lines (its double backward
    and JVP kernels for every layout and dtype) took 63 s at the default -O3 and 18 s at -O1
    on the AMD EPYC guest. The catalogue's tests and the bench build with the defaults (the
    sanitizers with their own flags)."""
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_layer_matches_its_paper(name):
    """Forward, backward, double backward and JVP against autograd of the paper's forward,
    in every mode, both backends and both dtypes; running buffers as the paper updates them."""
    prob = Problem(name)
    spec = prob.spec
    for training in _modes(spec):
        # the reference: autograd through the paper's forward, float64
        x = torch.tensor(prob.x, requires_grad=True)
        params, inputs = _tensors(prob.params), _tensors(prob.inputs)
        ref_buffers = {k: torch.tensor(v) for k, v in prob.buffers.items()}
        y = prob.torch_forward(x, params, inputs, training, ref_buffers)
        dy = torch.tensor(prob.dy, requires_grad=True)
        wrt = [x, *params.values(), *inputs.values()]
        grads = torch.autograd.grad((y * dy).sum(), wrt, create_graph=True)
        # double backward: random cotangents of every first-order gradient
        cots = [torch.tensor(prob.rng.normal(size=tuple(t.shape))) for t in grads]
        l2 = sum((c * g).sum() for c, g in zip(cots, grads))
        second = torch.autograd.grad(l2, [x, dy, *params.values(), *inputs.values()], allow_unused=True)
        # JVP along random tangents of x, the parameters and the inputs
        tangents = [torch.tensor(prob.rng.normal(size=tuple(t.shape))) for t in wrt]

        def fwd(x_, *rest, params=params, inputs=inputs, training=training):
            ps = dict(zip(params, rest[: len(params)]))
            ins = dict(zip(inputs, rest[len(params) :]))
            bufs = {k: torch.tensor(v) for k, v in prob.buffers.items()}
            return prob.torch_forward(x_, ps, ins, training, bufs)

        primals = [t.detach() for t in wrt]
        _, ty = torch.func.jvp(fwd, tuple(primals), tuple(tangents))

        n_p = len(params)
        for backend in ("numpy", "c"):
            k = derivgen.load(name, backend=backend)
            for dt, tol in ((np.float64, F64), (np.float32, F32)):
                where = f"{name} {'train' if training else 'eval'} {backend} {dt.__name__}"
                yk, cache, bufs = _call_forward(k, prob, dt, training)
                assert _rel(yk, y) < tol, where + " y"
                for bname, v in bufs.items():
                    assert _rel(v, ref_buffers[bname]) < tol, f"{where} buffer {bname}"
                g = k.backward(prob.dy.astype(dt), cache)
                assert _rel(g.dx, grads[0]) < tol, where + " dx"
                for j, pname in enumerate(params):
                    assert _rel(getattr(g, "d" + pname), grads[1 + j]) < tol, f"{where} d{pname}"
                for j, iname in enumerate(inputs):
                    assert _rel(getattr(g, "d" + iname), grads[1 + n_p + j]) < tol, f"{where} d{iname}"
                c = [t.numpy().astype(dt) for t in cots]
                s = k.backward_backward(
                    prob.dy.astype(dt),
                    cache,
                    c[0],
                    dict(zip(params, c[1 : 1 + n_p])),
                    ddinputs=dict(zip(inputs, c[1 + n_p :])),
                )
                want = ["dx", "ddy", *("d" + p for p in params), *("d" + i for i in inputs)]
                for field_name, ref in zip(want, second):
                    ref = torch.zeros(()) if ref is None else ref
                    got = getattr(s, field_name)
                    if ref.dim() == 0 and np.ndim(got) and not np.any(got):
                        continue  # an exactly zero gradient, as an array
                    if ref.dim() == 0 and np.ndim(got) == 0 and float(ref) == 0.0:
                        assert abs(float(got)) < 1e-9, f"{where} double backward {field_name}"
                        continue
                    assert _rel(got, ref) < tol * 10, f"{where} double backward {field_name}"
                t = [tt.numpy().astype(dt) for tt in tangents]
                tyk = k.jvp(cache, t[0], dict(zip(params, t[1 : 1 + n_p])), tinputs=dict(zip(inputs, t[1 + n_p :])))
                assert _rel(tyk, ty) < tol * 10, where + " JVP"


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_layer_is_proven(name):
    """Every zoo layer's first-order closed forms are proven (or checked in 80-digit
    arithmetic where the symbolic reduction runs out of time) against brute force: at N = 2
    and 3, and at N = 2 where the group is a grid of blocks (2x2xN elements for switchnorm;
    its N = 3, 35 s here, is `derivgen prove switchnorm --prove-sizes 2-3`)."""
    grid = block_layer(derivgen.load_spec(name))
    d = derivgen.derive(name, prove=(2,) if grid else (2, 3))
    for mode, proof in d.proofs.items():
        assert proof.ok, f"{name} {mode}: {[r.detail for r in proof.results]}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_layer_as_a_torch_module(name):
    """derivgen.torch.Module(NAME) against the paper's forward: y, the gradients of x, the
    parameters and the inputs, and the running buffers, float64, in every mode; a layer with
    block statistics (no channels-last kernels) gives a channels-last x the NCHW results'
    bits, channels last."""
    import derivgen.torch as dt

    prob = Problem(name, seed=3)
    spec = prob.spec
    features = prob.x.shape[1] if spec.layout == "channels" else prob.x.shape[-1]
    module = dt.Module(name, features, **prob.layout_options).double()
    with torch.no_grad():
        for pname, v in prob.params.items():
            getattr(module, pname).copy_(torch.as_tensor(v))
        for bname, v in prob.buffers.items():
            getattr(module, bname).copy_(torch.as_tensor(v))
    for training in _modes(spec):
        module.train(training)
        x = torch.tensor(prob.x, requires_grad=True)
        inputs = _tensors(prob.inputs)
        ref_x = torch.tensor(prob.x, requires_grad=True)
        ref_params, ref_inputs = _tensors(prob.params), _tensors(prob.inputs)
        ref_buffers = {b: getattr(module, b).detach().clone() for b in prob.buffers}
        want = prob.torch_forward(ref_x, ref_params, ref_inputs, training, ref_buffers)
        got = module(x, **inputs)
        assert _rel(got.detach().numpy(), want) < F64, f"{name} y"
        dy = torch.tensor(prob.dy)
        (want * dy).sum().backward()
        module.zero_grad()
        (got * dy).sum().backward()
        assert _rel(x.grad.numpy(), ref_x.grad) < F64, f"{name} dx"
        for pname, ref in ref_params.items():
            assert _rel(getattr(module, pname).grad.numpy(), ref.grad) < F64, f"{name} d{pname}"
        for iname, ref in ref_inputs.items():
            assert _rel(inputs[iname].grad.numpy(), ref.grad) < F64, f"{name} d{iname}"
        for bname, ref in ref_buffers.items():
            assert _rel(getattr(module, bname).numpy(), ref) < F64, f"{name} {bname}"
        if block_layer(spec) and x.dim() == 4:  # no channels-last kernels: an NCHW copy is run
            xl = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
            with torch.no_grad():
                before = {b: getattr(module, b).clone() for b in prob.buffers}
            yl = module(xl, **inputs)
            assert yl.is_contiguous(memory_format=torch.channels_last), f"{name} channels-last y"
            assert torch.equal(yl, got), f"{name} channels-last y"
            (yl * dy).sum().backward()
            assert torch.equal(xl.grad, x.grad), f"{name} channels-last dx"
            with torch.no_grad():  # the running buffers as the next mode's reference has them
                for b, v in before.items():
                    getattr(module, b).copy_(v)


BATCH_NHWC = sorted(
    n
    for n in CASES
    if (sp := derivgen.load_spec(n)).layout == "channels" and sp.reduce == "batch" and not block_layer(sp)
)


@pytest.mark.parametrize("name", BATCH_NHWC)
def test_zoo_batch_layer_channels_last_is_the_contiguous_result(name):
    """A batch-reduced zoo layer's channels-last kernels (their sums lane by lane over whole
    chunks of 256 positions, the rest row by row) give the NCHW kernels' bits, float32, in
    every mode: 70 channels (a block of 64 and 6), 272 positions (a chunk and a rest)."""
    import derivgen.torch as dt

    prob = Problem(name, seed=3)
    assert not prob.inputs  # none of them takes inputs; a layer that does needs them here
    for shape in ((2, 70, 16, 17),):
        rng = np.random.default_rng(4)
        module = dt.Module(name, shape[1], **prob.layout_options)
        with torch.no_grad():
            for pname in prob.params:
                par = getattr(module, pname)
                par.copy_(torch.as_tensor(rng.normal(size=par.shape) * 0.3 + 1.0))
        twin = copy.deepcopy(module)
        x = torch.as_tensor(rng.normal(size=shape) * prob.case.scale + 0.5, dtype=torch.float32)
        dy = torch.as_tensor(rng.normal(size=shape), dtype=torch.float32)
        for training in _modes(prob.spec):
            module.train(training), twin.train(training)
            xl = x.contiguous(memory_format=torch.channels_last).requires_grad_()
            xn = x.clone().requires_grad_()
            yl, yn = module(xl), twin(xn)
            assert yl.is_contiguous(memory_format=torch.channels_last) and torch.equal(yl, yn), f"{name} y"
            gl = torch.autograd.grad(yl, [xl, *module.parameters()], dy)
            gn = torch.autograd.grad(yn, [xn, *twin.parameters()], dy)
            for a, b in zip(gl, gn):
                assert torch.equal(a, b), f"{name} gradients"
            for a, b in zip(module.buffers(), twin.buffers()):
                assert torch.equal(a, b), f"{name} buffers"


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_layer_through_the_pytorch_target(name):
    """derivgen.load(NAME, backend="torch") -- the generated PyTorch closed forms, which run
    on every device without C kernels -- against autograd of the paper's forward: y, the
    running buffers and the first-order gradients, float64, in every mode."""
    prob = Problem(name, seed=5)
    k = derivgen.load(name, backend="torch")
    for training in _modes(prob.spec):
        x = torch.tensor(prob.x, requires_grad=True)
        params, inputs = _tensors(prob.params), _tensors(prob.inputs)
        ref_buffers = {b: torch.tensor(v) for b, v in prob.buffers.items()}
        y = prob.torch_forward(x, params, inputs, training, ref_buffers)
        grads = torch.autograd.grad((y * torch.tensor(prob.dy)).sum(), [x, *params.values(), *inputs.values()])
        kw = {**{n: torch.tensor(v) for n, v in prob.inputs.items()}, **prob.layout_options}
        bufs = {b: torch.tensor(v) for b, v in prob.buffers.items()}
        if bufs:
            kw.update(bufs, training=training)
        where = f"{name} {'train' if training else 'eval'} torch"
        yk, cache = k.forward(
            torch.tensor(prob.x), *(torch.tensor(prob.params[p.name]) for p in prob.spec.params), **kw
        )
        assert _rel(yk.numpy(), y) < F64, where + " y"
        for b, v in bufs.items():
            assert _rel(v.numpy(), ref_buffers[b]) < F64, f"{where} buffer {b}"
        g = k.backward(torch.tensor(prob.dy), cache)
        names = ["dx", *("d" + p for p in params), *("d" + i for i in inputs)]
        for field_name, ref in zip(names, grads):
            assert _rel(getattr(g, field_name).numpy(), ref) < F64, f"{where} {field_name}"
