"""``window(e, k)``: a sum over the k neighbouring elements of a group (zero padded, as
torch.nn.LocalResponseNorm). The spec language's checks, the closed forms (the gradient
reaches x through the transposed window), the proof at every element and several window
sizes, and the NumPy and C targets against PyTorch's local_response_norm with autograd,
first and second order (the zoo's lrn checks the channels of a position layout)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import sympy
from conftest import LRN_FEATURES, require_module

import derivgen
from derivgen.derive.first import derive_mode
from derivgen.derive.second import derive_second
from derivgen.prove.proof import prove_mode, prove_second_mode, window_sizes
from derivgen.spec import SpecError, parse_spec
from derivgen.symbolic.window import Window, offsets

LRN = LRN_FEATURES


def test_offsets_of_a_window_and_its_transpose():
    assert list(offsets(5, False)) == [-2, -1, 0, 1, 2] == list(offsets(5, True))
    assert list(offsets(4, False)) == [-2, -1, 0, 1]  # torch pads size//2 before, (size-1)//2 after
    assert list(offsets(4, True)) == [-1, 0, 1, 2]
    assert list(offsets(1, False)) == [0]


def test_the_output_reads_the_window_as_an_element_symbol():
    spec = parse_spec(LRN, "lrn.toml")
    (w,) = spec.windows
    assert isinstance(w.expr, Window) and w.body == sympy.Symbol("x", real=True) ** 2
    assert w.symbol in spec.output.free_symbols and not spec.output.has(Window)


@pytest.mark.parametrize(
    "change, field, words",
    [
        (("integer = true", "integer = false"), "options.size", "integer = true"),
        (('kind = "trailing"', 'kind = "channels"\nreduce = "instance"'), "output", "'trailing' layout"),
        (("window(x**2, size)", "window(x**2, 0)"), "output", "positive integer"),
        (("window(x**2, size)", "window(x**2, alpha2)"), "output", "an option"),
        (("window(x**2, size)", "window(mean(x), size)"), "output", "group reduction"),
        (("window(x**2, size)", "window(alpha, size)"), "output", "function of x"),
        (("window(x**2, size)", "window(window(x, size), size)"), "output", "function of x"),
        (("default = 5, min = 1", "default = 2.5, min = 1"), "options.size.default", "whole number"),
    ],
)
def test_bad_windows_are_refused_naming_the_field(change, field, words):
    text = LRN.replace(*change)
    assert text != LRN
    with pytest.raises(SpecError) as err:
        parse_spec(text, "lrn.toml")
    assert field in str(err.value) and words in str(err.value)


def test_a_window_in_a_statistic_is_refused():
    text = LRN.replace("[output]", '[statistics]\nm = { expr = "mean(window(x, size))" }\n\n[output]')
    with pytest.raises(SpecError, match=r"statistics\.m.*output"):
        parse_spec(text, "lrn.toml")


def test_the_closed_form_is_the_hand_derived_one():
    """dx = dy·D^(-β) - (2αβ/n)·x·windowᵀ(dy·x·D^(-β-1)), D = k + α·W/n: no run-time mean."""
    spec = parse_spec(LRN, "lrn.toml")
    first = derive_mode(spec)
    s = {v.name: v for v in first.dx.free_symbols}
    x, dy, alpha, beta, k, n, w = (s[c] for c in ("x", "dy", "alpha", "beta", "k", "size", "Win1"))
    d = k + alpha * w / n
    want = dy * d**-beta - 2 * alpha * beta / n * x * Window(dy * x * d ** (-beta - 1), n, -1)
    assert sympy.expand(first.dx - want) == 0
    assert first.reductions == ()


def test_the_proof_checks_every_element_and_tells_a_window_from_its_transpose():
    spec = parse_spec(LRN, "lrn.toml")
    assert window_sizes(spec) == (1, 2, 3, 5)
    first = derive_mode(spec)
    assert prove_mode(first, sizes=(2, 4)).status == "proven"
    wrong = first.dx.replace(lambda a: isinstance(a, Window), lambda a: Window(a.body, a.size, 1))
    proof = prove_mode(dataclasses.replace(first, dx=wrong), sizes=(3,))
    assert proof.status == "FAILED" and "window 2" in proof.results[0].detail


def test_second_order_is_proven():
    second = derive_second(derive_mode(parse_spec(LRN, "lrn.toml")))
    assert prove_second_mode(second, sizes=(2,)).ok


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 6])
@pytest.mark.parametrize("d", [1, 4, 7])
def test_backends_match_local_response_norm(tmp_path, backend, size, d):
    """Along a trailing layout's features, sizes odd and even, wider than the group."""
    torch = require_module("torch")
    path = tmp_path / "lrn.toml"
    path.write_text(LRN)
    m = derivgen.load(str(path), backend=backend)
    rng = np.random.default_rng(size * 10 + d)
    x, dy, ddx, tx = (rng.standard_normal((3, d)) for _ in range(4))
    opts = {"alpha": 0.3, "beta": 0.75, "k": 1.5}

    def ref(z):
        return torch.nn.functional.local_response_norm(z.unsqueeze(-1), size, **opts).squeeze(-1)

    y, cache = m.forward(x, size=size, **opts)
    grads = m.backward(dy, cache)
    bb = m.backward_backward(dy, cache, ddx)
    ty = m.jvp(cache, tx)
    xt, dyt = torch.tensor(x, requires_grad=True), torch.tensor(dy, requires_grad=True)
    yt = ref(xt)
    (gx,) = torch.autograd.grad(yt, xt, dyt, create_graph=True)
    bx, bdy = torch.autograd.grad(gx, (xt, dyt), torch.tensor(ddx))
    _, jt = torch.func.jvp(ref, (torch.tensor(x),), (torch.tensor(tx),))
    for got, want in ((y, yt), (grads.dx, gx), (bb.dx, bx), (bb.ddy, bdy), (ty, jt)):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_a_window_size_must_be_a_whole_number_at_call_time(tmp_path):
    path = tmp_path / "lrn.toml"
    path.write_text(LRN)
    m = derivgen.load(str(path), backend="numpy")
    with pytest.raises(ValueError, match="size must be a whole number"):
        m.forward(np.ones((2, 3)), size=2.5)
    with pytest.raises(ValueError, match="size"):
        m.forward(np.ones((2, 3)), size=0)


def test_a_module_takes_an_option_called_size():
    """derivgen.torch.Module(NAME, C, size=...): the module's own size is positional."""
    torch = require_module("torch")
    import derivgen.torch as dt

    m = dt.Module("lrn", 6, size=3, alpha=0.5).double()
    assert m.size == 3.0
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    want = torch.nn.functional.local_response_norm(x, 3, alpha=0.5, beta=0.75, k=1.0)
    assert torch.allclose(m(x), want, rtol=1e-12, atol=1e-14)
    xc = torch.randn(2, 6, 3, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    assert m(xc).is_contiguous(memory_format=torch.channels_last)


def test_a_window_beside_a_leading_mask_goes_through_every_check():
    """The transposed window's body holds leading(p): its C function computes the mask at each
    neighbour from the option and N (derivgen check: proof, finite differences, torch, the
    other backend, first and second order)."""
    from derivgen.tools.check import check_layer

    text = LRN.replace('[output]\ny = "x/(k + alpha*window(x**2, size)/size)**beta"', "").replace(
        "[options]", '[params]\ngamma = { role = "scale" }\n\n[options]\np = { default = 0.5, min = 0, max = 1 }'
    )
    text += """
[statistics]
ms = { expr = "mean(leading(p)*x**2)/mean(leading(p))" }
rms = { expr = "sqrt(ms + k)" }

[output]
y = "gamma*x/rms + alpha*window(x**2, size)*leading(p)"
"""
    rows = check_layer(parse_spec(text, "lead_win.toml"), prove_sizes=(2, 3))
    assert rows and not [r for r in rows if r.failed], [(r.check, r.backend, r.status) for r in rows if r.failed]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_position_windows_are_the_same_bits_whatever_the_threads_and_blocks(dtype):
    """The zoo's LRN (channels of a position layout): the C kernels compute each window the
    element code reads as a tile of the block of positions (its body once per element, then the
    neighbours' values added in offset order), the window function's sum. 70 positions per
    sample (a block of 64 and one of 6), odd and even sizes: the forward and the gradient are the
    same bits with 1 and 2 threads, and agree with the NumPy backend in float64."""
    c = derivgen.load("lrn", backend="c")
    ref = derivgen.load("lrn", backend="numpy")
    rng = np.random.default_rng(41)
    x = rng.standard_normal((3, 9, 7, 10))
    dy = rng.standard_normal(x.shape)
    for size in (2, 5):
        opts = {"size": size, "alpha": 0.3, "beta": 0.75, "k": 1.5}
        runs = []
        for threads in (1, 2):
            c.set_num_threads(threads)
            y, cache = c.forward(x.astype(dtype), **opts)
            runs.append((y, c.backward(dy.astype(dtype), cache).dx))
        c.set_num_threads(0)
        for a, b in zip(*runs):
            assert a.dtype == dtype and a.tobytes() == b.tobytes()
        y64, cache64 = ref.forward(x.astype(dtype).astype(np.float64), **opts)
        dx64 = ref.backward(dy.astype(dtype).astype(np.float64), cache64).dx
        tol = 2e-6 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(runs[0][0], y64, rtol=tol, atol=tol)
        np.testing.assert_allclose(runs[0][1], dx64, rtol=tol, atol=tol)
