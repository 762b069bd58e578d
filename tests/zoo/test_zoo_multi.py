"""The zoo's layers with tensor inputs beside x and outputs beside y (fused residual adds,
gates, modulation, masks, several outputs), generated and run, against the independent
PyTorch references of multi_reference.py (written from the libraries' code): the forward's
outputs and every gradient -- x, each tensor input with a gradient, each parameter -- against
autograd of the reference, float64 to 1e-10 and float32 to 1e-4 relative to the largest
reference value, with a random cotangent for every output.

The targets that generate these layers are ``codegen.emit.MULTI_TARGETS``; the others refuse
them with one line naming the spec (checked here too)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import multi_reference as R
import numpy as np
import pytest
import torch
from conftest import QUICK_CFLAGS, corpus, grid

import derivgen
from derivgen.codegen.emit import MULTI_TARGETS

F64, F32 = 1e-10, 1e-4


@dataclass(frozen=True)
class Case:
    """One layer: its reference (tensors by the spec's names -> outputs in the spec's order),
    x's shape, the shapes of its tensor inputs and parameters, and its options."""

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
        lambda a, o: R.rmsnorm_gated(a["x"], a["z"], a["weight"], o["eps"], norm_before_gate=True),
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
        lambda a, o: R.spade(a["x"], a["gamma"], a["beta"], o["eps"]),
        C3,
        {"gamma": C3, "beta": C3},
        {},
        {"eps": 1e-5},
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
    """The zoo's layers with tensor inputs, values or outputs beside y."""
    return [n for n in derivgen.zoo() if derivgen.load_spec(n).multi]


def test_every_multi_tensor_zoo_layer_has_a_case():
    assert sorted(CASES) == multi_zoo()


def test_the_readme_lists_every_fused_layer_with_its_reductions():
    """README's fused-layer table: one row per layer, its reductions per group as derived."""
    from conftest import ROOT

    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].strip("`") in CASES:
            rows[cells[1].strip("`")] = cells
    assert sorted(rows) == multi_zoo()
    for name, cells in rows.items():
        d = derivgen.derive(name)
        assert cells[4] == "; ".join(f"{mode}: {m.reduction_summary}" for mode, m in d.modes.items()), name
        tensors = [t.name for t in d.spec.tensors]
        assert all(t in cells[3] for t in tensors), name
        assert cells[5].startswith("proven"), name  # the 80-digit check at N = 6 where the budget ran out


@functools.cache
def _draw(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Float64 arguments by name: masks 0/1 with at least one valid value per group."""
    case, spec = CASES[name], derivgen.load_spec(name)
    rng = np.random.default_rng(seed)
    args = {"x": rng.standard_normal(case.x) * 1.5 + 0.3}
    for t in spec.tensors:
        shape = case.tensors[t.name]
        if t.mask:
            m = (rng.random(shape) < 0.7).astype(np.float64)
            m.reshape(-1)[:: max(1, m.size // 4)] = 1.0
            if name == "masked_batchnorm":  # every channel's group spans all samples: one valid value is enough
                m[0, 0, 0] = 1.0
            else:  # every row a group: one valid feature in each
                m[..., 0] = 1.0
            args[t.name] = m
        else:
            args[t.name] = rng.standard_normal(shape) * 0.7
    for p, shape in case.params.items():
        args[p] = rng.standard_normal(shape) * 0.5 + 1.0
    return args


def _reference(name: str, args: dict[str, np.ndarray], cots: list[np.ndarray]) -> tuple[list, dict]:
    """The reference's outputs and the gradients of Σ cot·output by name (float64 autograd)."""
    spec = derivgen.load_spec(name)
    grads_of = {"x", *(t.name for t in spec.grad_tensors), *CASES[name].params}
    ts = {k: torch.tensor(v, requires_grad=k in grads_of) for k, v in args.items()}
    outs = CASES[name].reference(ts, CASES[name].options)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    loss = sum((o * torch.tensor(c)).sum() for o, c in zip(outs, cots))
    loss.backward()
    return [o.detach().numpy() for o in outs], {k: t.grad.numpy() for k, t in ts.items() if k in grads_of}


def _rel(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def _call(module, name: str, args: dict[str, np.ndarray], cots: list[np.ndarray], dtype) -> tuple[list, dict]:
    """derivgen's outputs and gradients (by the reference's names) for the same arguments."""
    spec = derivgen.load_spec(name)
    a = {k: v.astype(dtype) for k, v in args.items()}
    pos = [a["x"], *(a[t.name] for t in spec.tensors), *(a[p.name] for p in spec.params)]
    outs, cache = module.forward(*pos, **CASES[name].options)
    outs = list(outs) if spec.outputs else [outs]
    extra = {"d" + o.name: c.astype(dtype) for o, c in zip(spec.outputs, cots[1:])}
    grads = module.backward(cots[0].astype(dtype), cache, **extra)
    by_name = {"x": grads.dx}
    by_name.update({t.name: getattr(grads, "d" + t.name) for t in spec.grad_tensors})
    by_name.update({p.name: getattr(grads, "d" + p.name) for p in spec.params})
    return outs, by_name


def _module(name: str, backend: str):
    """The layer's NumPy module, or its C one built with the tests' quick flags (-O1)."""
    if backend == "c":
        return derivgen.load(name, backend="c", cflags=QUICK_CFLAGS.split())
    return derivgen.load(name, backend=backend)


# make test: every pair of (layer, backend, dtype) values
@pytest.mark.parametrize(
    "name,backend,dtype", grid(sorted(CASES), sorted(MULTI_TARGETS & {"numpy", "c"}), ["float64", "float32"])
)
def test_multi_tensor_layer_against_its_library(name, backend, dtype):
    spec = derivgen.load_spec(name)
    args = _draw(name)
    rng = np.random.default_rng(1)
    cots = [rng.standard_normal(CASES[name].x) for _ in range(1 + len(spec.outputs))]
    want_out, want_grad = _reference(name, args, cots)
    got_out, got_grad = _call(_module(name, backend), name, args, cots, np.dtype(dtype))
    tol = F64 if dtype == "float64" else F32
    for k, (g, w) in enumerate(zip(got_out, want_out)):
        assert _rel(g, w) < tol, (name, "output", k)
    assert sorted(got_grad) == sorted(want_grad)
    for k in want_grad:
        assert _rel(got_grad[k], want_grad[k]) < tol, (name, "d" + k)


@pytest.mark.parametrize("name", ["add_layernorm", "add_rmsnorm", "flash_layernorm_parallel"])
def test_a_missing_cotangent_is_zero(name):
    """A cotangent left out (None) is zero, as autograd passes for an output no loss reads."""
    spec = derivgen.load_spec(name)
    assert spec.outputs
    args = _draw(name)
    rng = np.random.default_rng(2)
    cots = [rng.standard_normal(CASES[name].x)] + [np.zeros(CASES[name].x) for _ in spec.outputs]
    _, want = _reference(name, args, cots)
    m = derivgen.load(name, backend="numpy")
    pos = [args["x"], *(args[t.name] for t in spec.tensors), *(args[p.name] for p in spec.params)]
    _, cache = m.forward(*pos, **CASES[name].options)
    grads = m.backward(cots[0], cache)
    assert _rel(grads.dx, want["x"]) < F64


def test_add_rmsnorm_writes_dresidual_as_the_same_values_as_dx():
    """∂h/∂x = ∂h/∂residual = 1: the backward computes ∂L/∂h once and writes it to both."""
    from derivgen.codegen.emit import emit

    text = emit(derivgen.derive("add_rmsnorm"), ("numpy",)).files["numpy/add_rmsnorm.py"]
    assert "h_Adj = " in text and "DX[_s] = h_Adj" in text and "DT_residual.reshape(L.view4)[_s] = h_Adj" in text
    args = _draw("add_rmsnorm")
    m = derivgen.load("add_rmsnorm", backend="numpy")
    (_, h), cache = m.forward(args["x"], args["residual"], args["weight"])
    g = m.backward(np.ones_like(h), cache, dh=np.full_like(h, 0.5))
    assert np.array_equal(g.dx, g.dresidual)


def test_bad_tensor_arguments_are_named():
    m = derivgen.load("adaln", backend="numpy")
    args = _draw("adaln")
    with pytest.raises(ValueError, match=r"shift must have shape \(3, 8\)"):
        m.forward(args["x"], args["shift"][:2], args["scale"])
    with pytest.raises(TypeError, match="scale has dtype float32"):
        m.forward(args["x"], args["shift"], args["scale"].astype(np.float32))
    mm = derivgen.load("masked_layernorm", backend="numpy")
    a = _draw("masked_layernorm")
    with pytest.raises(ValueError, match="mask is a mask: every value must be 0 or 1"):
        mm.forward(a["x"], a["mask"] * 0.5, a["weight"], a["bias"])
    mr = derivgen.load("add_rmsnorm", backend="numpy")
    b = _draw("add_rmsnorm")
    (_, h), cache = mr.forward(b["x"], b["residual"], b["weight"])
    with pytest.raises(ValueError, match="dh must have the shape of x"):
        mr.backward(h, cache, dh=h[:1])


def test_what_the_c_target_does_not_take_is_refused_in_one_line(tmp_path):
    """Every target generates these layers; the C kernels refuse tensor inputs in a position
    layout (one line naming the spec), and the NumPy target runs it."""
    path = tmp_path / "pos.toml"
    path.write_text(
        'name = "pos_gate"\ntitle = "t"\n[layout]\nkind = "channels"\nreduce = "position"\n'
        "[tensors]\nz = {}\n[options]\neps = { default = 1e-5, min = 0 }\n"
        '[statistics]\nms = "mean(x**2)"\n[output]\ny = "x/sqrt(ms + eps)*z"\n'
    )
    assert {"numpy", "c", "torch", "triton", "jax"} <= MULTI_TARGETS
    with pytest.raises(NotImplementedError, match="pos.toml: the C kernels take tensor inputs") as info:
        derivgen.load(path, backend="c")
    assert "\n" not in str(info.value)
    x, z = np.ones((2, 3, 4)), np.ones((2, 3, 4))
    y, _ = derivgen.load(path, backend="numpy").forward(x, z)
    assert y.shape == x.shape


# every feature of these layers' C: outputs beside y, tensors of x's shape, broadcast and masks,
# a core value with a chain factor, batch and trailing layouts, channels-last kernels with a
# mask inside the means and with tensors the backward does not read (spade's beta)
STRICT = ["add_rmsnorm", "adaln", "flash_layernorm_parallel", "masked_batchnorm", "rmsnorm_gated_before", "spade"]


# make test: every kernel (-DDG_WITH_EXTRAS -DDG_WITH_SECOND) of the five layers that have every feature of the
# six but add_rmsnorm's; the serial extras-only builds in the full tier
ALL_KERNELS = "-DDG_WITH_EXTRAS -DDG_WITH_SECOND"
_BUILDS = [(n, k) for n in STRICT for k in (ALL_KERNELS, "-DDG_EXTRAS_ONLY")]


@pytest.mark.parametrize(
    "name,kernels",
    corpus(
        _BUILDS,
        [(n, ALL_KERNELS) for n in STRICT if n != "add_rmsnorm"],
        ids=lambda b: "-".join(b).replace(" ", ""),
        unpack=True,
    ),
)
def test_their_c_is_strict_c99(name, kernels, tmp_path):
    """float, double and bfloat16 kernels under -std=c99 -Wall -Wextra -pedantic -Werror."""
    import subprocess

    from conftest import require_tool

    from derivgen.codegen.emit import emit

    cc = require_tool("gcc")
    files = emit(derivgen.derive(name), ("c",)).files
    for rel, text in files.items():
        (tmp_path / rel.split("/")[-1]).write_text(text)
    argv = [cc, "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-O1", "-fPIC", "-c", *kernels.split()]
    r = subprocess.run(
        [*argv, str(tmp_path / f"{name}.c"), "-o", str(tmp_path / "k.o")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
