"""Every bug the spec fuzzer (or a user) ever found, as a named spec in tests/regressions/:
each derives, proves symbolically, generates, compiles without a warning and checks both
backends in float32 and float64 against finite differences and each other."""

import numpy as np
import pytest
from conftest import QUICK_CFLAGS, ROOT, corpus

import derivgen
from derivgen.spec import SpecError, parse_spec
from derivgen.tools.check import check_layer

REGRESSIONS = sorted((ROOT / "tests" / "regressions").glob("*.toml"))


def _has_group_selection(spec) -> bool:
    from derivgen.symbolic.reduce import SELECTIONS

    return any(st.expr.has(*SELECTIONS) for m in spec.modes for st in m.statistics)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_regression_spec_goes_through_the_pipeline(path, monkeypatch):
    # compiled as the spec fuzzer compiles the specs it finds (fast; still -Werror): these
    # check the engine and the templates, the catalogue's tests the -O3 builds
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)
    spec = derivgen.load_spec(path)
    numeric_ok = _has_group_selection(spec) or bool(spec.windows)
    rows = check_layer(spec, prove_sizes=(2, 3))
    bad = [(r.mode, r.check, r.backend, r.dtype, r.status, r.errors) for r in rows if r.failed]
    assert not bad, bad
    proofs = [r for r in rows if r.check.startswith("proof")]
    # symbolic; a group maximum's brute force is nested maxima whose sign regions can outgrow
    # the symbolic budget, and so can a window's, which is checked at every element of the
    # group (each sees other neighbours): exact 80-digit evaluation then, and said so
    allowed = {"ok", "ok (checked numerically)"} if numeric_ok else {"ok"}
    assert proofs and all(r.status in allowed for r in proofs), [r.status for r in proofs]


# make test proves the second order of the specs named second_order_* (the bugs found in its
# derivation), make test-full every spec's; the emitted second-order code of every spec is
# checked above either way
@pytest.mark.parametrize(
    "path",
    corpus(REGRESSIONS, [p for p in REGRESSIONS if p.stem.startswith("second_order_")], ids=lambda p: p.stem),
)
def test_regression_spec_second_order_is_proven(path):
    from derivgen.prove.proof import prove_second_mode

    d = derivgen.derive(path)
    for mode in d.modes:
        second = prove_second_mode(d.second(mode), (2,))
        assert second.ok, (mode, [(r.n, r.status, r.detail) for r in second.results])


def test_numeric_check_redraws_points_where_the_layer_is_undefined():
    import random

    import sympy

    from derivgen.prove.proof import _Sampler, _zero_numeric

    a, b = sympy.symbols("a b", real=True)

    class Scripted(random.Random):
        """Draws a = b first (where the expression is 0/0), then distinct values."""

        def __init__(self):
            super().__init__(0)
            self.script = [5, 5, 1, 2, 3, 7, 11, 13]

        def randint(self, lo, hi):
            return self.script.pop(0) if self.script else super().randint(lo, hi)

    diff = sympy.Mul(a - b, sympy.Pow(a - b, -1, evaluate=False), evaluate=False) - 1
    assert _zero_numeric(diff, _Sampler(Scripted()))  # zero wherever defined: a = b is drawn again
    assert not _zero_numeric(sympy.nan * a, _Sampler(random.Random(0)))  # undefined everywhere is not zero
    assert not _zero_numeric(a - b, _Sampler(random.Random(0)))


def test_gradient_name_that_is_a_keyword_is_refused():
    text = (ROOT / "tests" / "regressions" / "gradient_name_is_a_keyword.toml").read_text()
    with pytest.raises(SpecError, match=r"inputs\.o: .*gradient would be called 'do', a keyword"):
        parse_spec(text.replace("o_t", "o"), source="bad.toml")


def test_buffer_is_per_group_in_a_per_sample_layout():
    spec = derivgen.load_spec(ROOT / "tests" / "regressions" / "buffer_per_sample.toml")
    x = np.random.default_rng(3).normal(size=(4, 6))
    got = {}
    for backend in ("numpy", "c"):
        rm = np.zeros(4)
        derivgen.load(spec, backend=backend).forward(x, np.ones(6), rm=rm)
        got[backend] = rm
    np.testing.assert_allclose(got["c"], 0.1 * x.mean(-1), rtol=1e-12)
    np.testing.assert_allclose(got["numpy"], got["c"], rtol=1e-12)


def test_fourth_moment_backward_is_centred_and_needs_two_reductions():
    md = derivgen.derive(ROOT / "tests" / "regressions" / "fourth_moment_without_xhat.toml").train
    assert len(md.reductions) == 2
    # the output normalizes x inline: the engine names x̂ = (x - mean)/r itself
    syms = {s.name: s for s in md.coordinate_expr.free_symbols}
    assert md.implicit_coordinate and set(syms) == {"x", "mean", "r"}
    assert md.coordinate_expr == (syms["x"] - syms["mean"]) / syms["r"]
    # the third central moment is computed by the forward, as written
    assert any(str(s.expr) == "Mean((-mean + x)**3)" for s in md.aux)
    # no raw power of x anywhere in the closed form
    assert not md.dx.has(derivgen.spec.model.X)


def test_mixing_coefficient_that_may_be_zero_is_not_divided_by():
    md = derivgen.derive(ROOT / "tests" / "regressions" / "mixing_coefficient_may_be_zero.toml").train
    alpha = next(o.symbol for o in md.spec.options if o.name == "alpha")
    for e in [md.dx, *md.dinputs.values(), *(s.expr for s in md.statistics)]:
        assert not any(p.base == alpha and p.exp.is_negative for p in e.atoms(type(alpha**-1))), e


def test_one_statistic_or_three_reach_the_same_compact_form():
    """Issue 10: sd = sqrt(sum((x - mean)^2)/(N - 1)) + eps written in one statistic derives
    the same closed form, with the same two reductions, as var, s = sqrt(var), sd = s + eps."""
    one = derivgen.derive(ROOT / "tests" / "regressions" / "unbiased_sd_eps_outside.toml").train
    text = (
        (ROOT / "tests" / "regressions" / "unbiased_sd_eps_outside.toml")
        .read_text()
        .replace(
            'sd = "sqrt(sum((x - mean)**2)/(N - 1)) + eps"',
            'var = "sum((x - mean)**2)/(N - 1)"\ns = "sqrt(var)"\nsd = "s + eps"',
        )
    )
    three = derivgen.derive(parse_spec(text, source="three.toml")).train
    for md in (one, three):
        assert sorted(r.name for r in md.reductions) == ["Mean_g", "Mean_g_xhat"]
        assert not md.dx.has(__import__("sympy").Abs)
    # the same formula once the one-statistic version's auxiliary sqrt(mean((x - mean)^2)) is
    # written as s*sqrt((N - 1)/N)
    import sympy

    N = next(iter(s for s in one.dx.free_symbols if s.name == "N"))
    aux = one.aux[-1].symbol
    s = sympy.Symbol("s", positive=True)
    a = one.dx.xreplace({aux: s * sympy.sqrt((N - 1) / N)})
    b = three.dx
    plain = {v: sympy.Symbol(v.name) for v in a.free_symbols | b.free_symbols}
    a, b = a.xreplace(plain), b.xreplace(plain)
    assert sympy.simplify(a - b) == 0


def test_abs_differentiates_to_sign():
    md = derivgen.derive(ROOT / "tests" / "regressions" / "abs_in_statistic.toml").train
    import sympy

    assert not md.dx.has(sympy.re, sympy.im, sympy.Subs, sympy.Derivative)
    assert md.dx.has(sympy.sign) and len(md.reductions) == 1


def test_an_inline_coordinate_is_named_by_the_engine():
    md = derivgen.derive(ROOT / "tests" / "regressions" / "inline_coordinate.toml").train
    assert md.implicit_coordinate and md.coordinate.text == "x̂"
    assert sorted(r.name for r in md.reductions) == ["Mean_Xn_g", "Mean_g"]
    assert md.g is not None and not md.dx.has(derivgen.spec.model.X)


def test_group_maximum_tie_mask_compares_x_as_the_forward_did():
    """The tie mask of max(|x|) reads x itself, never x rewritten through the coordinate x̂
    (whose rounding can miss the maximum's element), in the first order and the JVP."""
    from derivgen.symbolic import functions

    d = derivgen.derive(ROOT / "tests" / "regressions" / "group_max_tie_in_x.toml")
    md = d.modes["train"]
    coord = md.coordinate.symbol
    for e in (md.dx, d.second("train").ty):
        masks = e.atoms(functions.Indicator)
        assert masks and all(not m.has(coord) and m.has(derivgen.spec.model.X) for m in masks), masks


# issue 39: the backward needs one run-time mean per independent mean of ∂L/∂y, by kind
MINIMAL_REDUCTIONS = {
    "taylor_softmax": {"group": 1},  # was 3: <dy>, <dy*x>, <dy*x^2>
    "rms_row_scale": {"group": 1},  # was 2: <xhat*g> and <xhat*dy*w>, g = dy*w
    "instance_layer_norm": {"group": 2, "instance": 2},  # was 4 group: dy*gamma and dy*gamma*rho apart
    "batch_channel_norm": {"group": 0, "sample": 2, "batch": 2},  # was 4 sample
    "batch_instance_norm": {"group": 2, "instance": 2},  # as many; the counts said 2
}


@pytest.mark.parametrize("name", sorted(MINIMAL_REDUCTIONS))
def test_the_backward_needs_the_fewest_means_by_kind(name):
    md = derivgen.derive(ROOT / "tests" / "regressions" / f"{name}.toml").train
    assert md.reduction_counts == MINIMAL_REDUCTIONS[name]
    want = MINIMAL_REDUCTIONS[name]
    summary = str(want["group"]) if len(want) == 1 else " + ".join(f"{n} {k}" for k, n in want.items() if n)
    assert md.reduction_summary == summary


def test_merged_means_read_as_a_person_writes_them():
    from derivgen.spec.model import DY, X

    taylor = derivgen.derive(ROOT / "tests" / "regressions" / "taylor_softmax.toml").train
    (r,) = taylor.reductions
    assert r.arg == DY * (1 + X + X**2 / 2)  # through f as the output writes it, no raw powers apart
    iln = derivgen.derive(ROOT / "tests" / "regressions" / "instance_layer_norm.toml").train
    rho = next(p.symbol for p in iln.spec.params if p.name == "rho")
    assert all(r.arg.has(1 - rho) for r in iln.reductions), [r.arg for r in iln.reductions]
    # the instance means are about the instance mean, not x written in the layer's coordinate
    mu_in = next(b.symbol for b in iln.blocks if b.name == "mu_in")
    assert {b.body for b in iln.block_reductions} == {DY, DY * (X - mu_in)}
    text = derivgen.derive(ROOT / "tests" / "regressions" / "batch_channel_norm.toml").render("text")
    assert "no reduction over the group but 2 sample means" in text and "2 batch means" in text


def test_an_exponential_is_not_split_into_factors_that_overflow():
    """exp_of_a_shifted_square.toml: y = gamma exp(-u^2), u = alpha x + s, at x = 20, alpha = 1,
    s = -20 (u = 0, where -alpha^2 x^2 and -2 alpha s x are -400 and 800): dx, dalpha and ds
    finite and equal to the closed form, in both element types of the NumPy and C targets
    (tests/jax/test_jax_specs.py checks the JAX JVP, which split exp(-u^2) too)."""
    path = ROOT / "tests" / "regressions" / "exp_of_a_shifted_square.toml"
    x = np.full((2, 4), 20.0)
    args = [np.ones(4), np.array([1.0]), np.array([-20.0])]
    for backend in ("numpy", "c"):
        mod = derivgen.load(path, backend)
        for dt in (np.float64, np.float32):
            _, cache = mod.forward(x.astype(dt), *(a.astype(dt) for a in args))
            g = mod.backward(np.ones_like(x, dtype=dt), cache)
            # dy/du = -2u gamma exp(-u^2) = 0 at u = 0, and its derivative in x, alpha, s too
            assert np.all(g.dx == 0) and g.dalpha == 0 and g.ds == 0, (backend, dt)
    for backend in ("numpy", "c"):  # u = 1e-3: dx = -2u exp(-u^2) alpha, no 0*inf anywhere
        mod = derivgen.load(path, backend)
        xs = np.full((2, 4), 20.001)
        _, cache = mod.forward(xs, *args)
        g = mod.backward(np.ones_like(xs), cache)
        u = 20.001 - 20.0
        np.testing.assert_allclose(g.dx, -2 * u * np.exp(-(u**2)), rtol=1e-9)
