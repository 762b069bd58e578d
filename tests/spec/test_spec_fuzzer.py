"""Generality is tested by generation: the spec fuzzer's CI corpus -- 30 specs a user could
write, fixed seeds; make test runs the 10 of them that together have every feature -- goes
through derive, prove, generate, compile (-Werror) and check (both backends, float32 and
float64, against finite differences and each other). The larger corpus is `make fuzz`. Every failure the fuzzer finds becomes a spec in tests/regressions/.

Correct is not enough: each spec's backward must read the fewest run-time means of ∂L/∂y
any backward can (specfuzz.brute_force_minimum, a rank of the Jacobian), on the CI corpus
and the shape family's first seeds."""

import os
import signal
import subprocess
import sys
import time

import pytest
import specfuzz
from conftest import LRN_FEATURES, QUICK_CFLAGS, ROOT, private_cache, sample_and_rest

import derivgen
from derivgen.spec import parse_spec, reserved_reason
from derivgen.symbolic.block import BlockMean

# and two of the block family (a group layout and a batch layout; the all layout's take a minute
# each: `make fuzz` runs them, and the zoo's switchnorm and the sanitizer's block spec are in it).
# Seeds 28 and up are `make fuzz`'s. make test runs the sample of seeds 0-27 that has every
# feature of them all (specfuzz.covering) and the block seeds; make test-full the other seeds too.
CI_SEEDS = [*range(28), specfuzz.BLOCK_SEEDS, specfuzz.BLOCK_SEEDS + 8]
QUICK_SEEDS = [*specfuzz.covering(range(28)), specfuzz.BLOCK_SEEDS, specfuzz.BLOCK_SEEDS + 8]
# no corpus deadline: each spec is bounded by specfuzz.SECONDS of CPU time, so the verdict is the
# same on a loaded machine as on an idle one (only slower)
CI_DEADLINE = None

# The run-time means are judged on the CI corpus and the shape family's first 48 seeds (a Taylor
# softmax, a per-row scale, a mixture of two kinds' normalizations in every spec): derived and
# judged only, a few seconds a spec (their whole pipeline is `make fuzz`'s). make test judges
# the CI corpus's sample and the shape seeds that have every shape and layout of the 48.
SHAPE_CI_SEEDS = range(specfuzz.SHAPE_SEEDS, specfuzz.SHAPE_SEEDS + 48)
SHAPES = ("output ", "mixture ", "layout ")
SHAPE_QUICK_SEEDS = specfuzz.covering(
    SHAPE_CI_SEEDS, key=lambda s: {f for f in specfuzz.features(s) if f.startswith(SHAPES)}
)

# The tensor family (seeds from specfuzz.TENSOR_SEEDS): the ordinary draws with tensor inputs
# beside x (of x's shape, per sample, per position; with a gradient, constant, 0/1 masks), a core
# value the statistics read in place of x, masked or weighted statistics, tensors in the output
# and outputs beside y, judged by specfuzz.run_tensors: NumPy and C against PyTorch autograd of
# the spec's forward (written from its fields), finite differences and each other, float32
# against float64; proven at N = 2, 3; the run-time means against the brute-force minimum.
# The CI corpus is its first 40 seeds and 300085 (a per-channel weight in the core: the first 40
# have one only in a slow seed); make test runs the quick seeds among them that have every tensor
# feature of them all, make test-full the others; `make fuzz SEEDS=300000-300199` (or any range
# from 300000) the larger corpus.
TENSOR_CI_SEEDS = [*range(specfuzz.TENSOR_SEEDS, specfuzz.TENSOR_SEEDS + 40), specfuzz.TENSOR_SEEDS + 85]
# open findings among them: what fails and the regression spec that holds the bug (fixed: take the
# seed off); the corpus test leaves them out (each runs until its 120 s are spent)
KNOWN_TENSOR_FAILURES = {
    # masked or weighted statistics: the proof spends minutes in SymPy outside its work budget
    300016: "tensors/masked_tanh_proof_time",  # tanh of the coordinate: _proven's xreplace
    300017: "tensors/masked_exp_proof_time",  # exp(-z²/4): canonical_exponentials (near 120 s)
    300028: "tensors/masked_root_proof_time",  # sqrt(z² + 1): _primitive_root
}
# the seeds whose pipeline takes over 12 s on an idle core (proofs that fall back to 80-digit
# numbers, several outputs): make test-full runs them, make test's sample is drawn from the others
SLOW_TENSOR_SEEDS = {300002, 300008, 300011, 300018, 300020, 300026, 300030, 300034}
TENSOR_FEATURES = ("tensor ", "core value", "parameter in core", "values ", "outputs ", "output is", "layout ")
TENSOR_RUN_SEEDS = [s for s in TENSOR_CI_SEEDS if s not in KNOWN_TENSOR_FAILURES]
TENSOR_QUICK_SEEDS = specfuzz.covering(
    [s for s in TENSOR_RUN_SEEDS if s not in SLOW_TENSOR_SEEDS],
    key=lambda s: {f for f in specfuzz.features(s) if f.startswith(TENSOR_FEATURES)},
)

MEANS_SEEDS = [*CI_SEEDS, *SHAPE_CI_SEEDS, *TENSOR_CI_SEEDS]
MEANS_QUICK_SEEDS = [*QUICK_SEEDS, *SHAPE_QUICK_SEEDS, *TENSOR_QUICK_SEEDS]


def test_generated_specs_are_valid_and_varied():
    kinds, names = set(), set()
    for seed in range(60):
        text = specfuzz.generate(seed)
        spec = parse_spec(text, source=f"fuzz{seed}.toml")  # valid by construction
        kinds.add((spec.layout, spec.reduce))
        # leading(p) and window(e, k): derivgen's own names (Lead_p, Win1)
        masks = {m.name for m in spec.masks} | {w.name for w in spec.windows}
        names |= {n for n in spec.symbols if n not in ("x", "N") and n not in masks}
        assert all(reserved_reason(n) is None for n in names)
    assert len(kinds) == 5  # trailing, batch, instance, group, position
    # the block family: block statistics in every layout whose groups hold blocks
    family = [parse_spec(specfuzz.generate(s), source=f"fuzz{s}.toml") for s in range(100_000, 100_030)]
    assert all(sp.mode().blocks for sp in family)
    assert {sp.reduce for sp in family} == {"batch", "group", "all"}
    assert {a.kind for sp in family for b in sp.mode().blocks for a in b.expr.atoms(BlockMean)} == {
        "instance",
        "sample",
        "batch",
    }
    # the names derivgen's generated code once used for itself are ordinary names now
    assert names & {"s", "m", "b", "base", "part", "idx", "grp", "mine", "np", "stats", "call"}
    assert any(n.endswith("_t") for n in names)
    # the shape family: every spec has a shape whose fewest means are judged, and its first 48
    # seeds have them all -- the mixtures in every layout with blocks
    shapes = {s: {f for f in specfuzz.features(s) if f.startswith(("output ", "mixture "))} for s in SHAPE_CI_SEEDS}
    assert all(shapes.values())
    assert set().union(*shapes.values()) >= {
        "output polynomial in x",
        "output scaled by an input",
        "output input times x",
        "output input times the coordinate",
        "mixture group+instance",
        "mixture batch+instance",
        "mixture instance+sample",
        "mixture batch+sample",
    }
    assert {parse_spec(specfuzz.generate(s), source="s.toml").reduce for s in SHAPE_CI_SEEDS if s % 2} == {
        "batch",
        "group",
        "all",
    }


def _spec(layout: str, body: str, name: str = "t"):
    return parse_spec(f'name = "{name}"\n[layout]\n{layout}\n{body}', source=f"{name}.toml")


TRAILING, ALL, BATCH = 'kind = "trailing"', 'kind = "channels"\nreduce = "all"', 'kind = "channels"\nreduce = "batch"'


def test_shape_features_come_from_the_formulas():
    """The shapes of the fewest-means judgement: a polynomial of x in the output (a Taylor
    softmax), the output scaled by a per-group input, an input times x, and a mixture of two
    levels' statistics or normalized values (w and 1 - w, a symbol or numbers)."""
    taylor = _spec(
        TRAILING,
        """
[statistics]
s = "sum(1 + x + x**2/2)"
[output]
y = "(1 + x + x**2/2)/s"
""",
    )
    assert specfuzz.shape_features(taylor) == {"output polynomial in x"}
    rms = _spec(
        TRAILING,
        """
[params]
gamma = {}
[inputs]
k = {}
[statistics]
r = "1/sqrt(mean(x**2) + 1e-6)"
[output]
y = "k*(gamma*x*r + 0.5*k*x + k*tanh(x*r))"
""",
    )
    assert specfuzz.shape_features(rms) == {
        "output scaled by an input",
        "output input times x",
        "output input times the coordinate",
    }
    mixed = _spec(
        ALL,
        """
[options]
rho = { min = 0, max = 1 }
[statistics]
mi = "mean(x, 'instance')"
ml = "mean(x, 'sample')"
mb = "mean(x, 'batch')"
mu = "rho*mi + (1 - rho)*ml"
vb = "mean((x - mb)**2, 'batch')"
vi = "mean((x - mi)**2, 'instance')"
[output]
y = "0.3*(x - mb)/sqrt(vb + 1) + 0.7*(x - mi)/sqrt(vi + 1) + x - mu"
""",
    )
    assert specfuzz.shape_features(mixed) == {"mixture instance+sample", "mixture batch+instance"}
    # not mixtures: two terms of two shapes, or of one level
    plain = _spec(
        BATCH,
        """
[statistics]
mu = "mean(x)"
mi = "mean(x, 'instance')"
[output]
y = "0.5*tanh(x - mu) + 0.5*(x - mi) + 0.2*(x - mu) + 0.8*tanh(x - mu)"
""",
    )
    assert specfuzz.shape_features(plain) == set()


def test_the_quick_sample_has_every_feature_of_its_corpus():
    every = set().union(*map(specfuzz.features, range(28)))
    sample = set().union(*map(specfuzz.features, QUICK_SEEDS))
    assert every <= sample and len(QUICK_SEEDS) < len(CI_SEEDS)
    assert {f for f in every if f.startswith("layout ")} == {
        "layout trailing/features",
        "layout channels/batch",
        "layout channels/instance",
        "layout channels/group",
        "layout channels/position",
    }
    assert {"call exp", "call sqrt", "table buffers", "table modes.eval.statistics"} <= every
    # the shape family's sample for the fewest-means judgement: every shape and layout of its 48
    shaped = {f for s in SHAPE_CI_SEEDS for f in specfuzz.features(s) if f.startswith(SHAPES)}
    assert shaped == {f for s in SHAPE_QUICK_SEEDS for f in specfuzz.features(s) if f.startswith(SHAPES)}


@pytest.mark.slow
@pytest.mark.parametrize("seeds", sample_and_rest(CI_SEEDS, QUICK_SEEDS))
def test_ci_corpus_passes(seeds, tmp_path, monkeypatch):
    monkeypatch.setenv("DERIVGEN_CACHE", private_cache(tmp_path))
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)  # compile fast; still -Werror
    t0 = time.perf_counter()
    # every seed's second order is checked (finite differences, the other backend); every
    # other one is proven by brute force at N = 2 here, and every other channel layout's
    # channels-last kernels checked against its NCHW ones (all of them, N = 2, 3, in `make fuzz`)
    results = specfuzz.run_corpus(
        seeds,
        jobs=min(2, os.cpu_count() or 1),
        deadline=CI_DEADLINE,
        second_order=(2, (2,)),
        channels_last_every=2,
    )
    print("\n" + specfuzz.summary(results, time.perf_counter() - t0))
    failed = [f"seed {r.seed}: {r.failure}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert len(results) == len(seeds)


# the corpus's specs whose backward still reads more means than the minimum, each with its
# count (engine/minimum) and why: open findings, listed so that the test holds every other spec
# to the minimum and fails when one of these changes (fixed: take it off the list)
KNOWN_ABOVE_MINIMUM = {
    # ⟨x̂·exp(sy)⟩, a mean without ∂L/∂y (zero: sy is per channel, one value per group of a
    # batch layout, and ⟨x̂⟩ = 0) computed in the backward
    9: "train: group 3/2",
    # the shape family's mixtures and polynomials: group means whose coefficients in ∂L/∂x are
    # linearly dependent over per-group values without being pairwise proportional
    200007: "train: group 5/2, instance 2/2",
    200013: "train: group 4/3, instance 2/2",
    200019: "train: group 3/2, instance 2/2",
    200036: "train: group 6/4",
    200037: "train: group 5/4, instance 2/2",
    200044: "train: group 4/3",
    200047: "train: group 5/4, instance 2/2",
    # the tensor family: ⟨x̂·exp(w)⟩ (a mean without ∂L/∂y: a per-channel weight exp(w) in the
    # variance, or a weight with a gradient, sigmoid(t)) computed in the backward, as seed 9's
    300005: "train: group 3/2",
    300015: "train: group 3/2",
}


@pytest.mark.parametrize("seeds", sample_and_rest(MEANS_SEEDS, MEANS_QUICK_SEEDS))
def test_ci_corpus_reductions_are_at_the_minimum(seeds):
    """Every spec's backward reads the fewest run-time means of ∂L/∂y of each kind any backward
    can: the engine's count by kind (group means, block means per kind) is the brute-force
    minimum (specfuzz.brute_force_minimum: the rank of the Jacobian's parts off the diagonal,
    never the engine's list of reductions). A count above it names the seed, mode and kinds;
    the open findings of :data:`KNOWN_ABOVE_MINIMUM` must read exactly as listed."""
    above, changed = [], []
    for seed in seeds:
        spec = parse_spec(specfuzz.generate(seed), source=f"fuzz{seed}.toml")
        found = [str(r) for r in specfuzz.reduction_minimum(spec, derivgen.derive(spec)) if not r.at_minimum]
        if seed in KNOWN_ABOVE_MINIMUM:
            if found != [KNOWN_ABOVE_MINIMUM[seed]]:
                changed.append(f"seed {seed}: listed {KNOWN_ABOVE_MINIMUM[seed]!r}, now {found or 'at the minimum'}")
        else:
            above += [f"seed {seed} {r} (engine/minimum)" for r in found]
    assert not above, "\n".join(above)
    assert not changed, "\n".join(changed)


# hand-derived minima (kind -> means any backward needs), with the spec's layout and body
KNOWN_MINIMA = {
    "layernorm": ("catalogue", {"group": 2}),  # ⟨g⟩, ⟨g·x̂⟩
    "rmsnorm": ("catalogue", {"group": 1}),  # ⟨g·x̂⟩
    "softmax": ("zoo", {"group": 1}),  # ⟨∂L/∂y·y⟩; its max has no gradient
    "absmax_scale": ("zoo", {"group": 1}),  # ⟨∂L/∂y·x⟩ at the arg max (one element)
    "prmsnorm": ("zoo", {"group": 1}),  # the leading slice's ⟨g·x⟩
    "batchnorm": ("catalogue", {"group": 2}),  # train; eval: none
    "taylor_softmax": (
        TRAILING,
        {"group": 1},  # ⟨∂L/∂y·(1 + x + x²/2)⟩
        """
[statistics]
s = "sum(1 + x + x**2/2)"
[output]
y = "(1 + x + x**2/2)/s"
""",
    ),
    "rms_row_scale": (
        TRAILING,
        {"group": 1},  # ⟨∂L/∂y·γ·x̂⟩: ∂L/∂x's, and ∂L/∂k's too
        """
[params]
gamma = {}
[inputs]
k = {}
[statistics]
r = "1/sqrt(mean(x**2) + 1e-6)"
[output]
y = "k*gamma*x*r"
""",
    ),
    "input_gradient": (
        TRAILING,
        {"group": 3},  # ⟨g⟩, ⟨g·x̂⟩ and ∂L/∂k's ⟨∂L/∂y·x̂⟩ (g = ∂L/∂y·(γ + k/10))
        """
[params]
gamma = {}
[inputs]
k = {}
[statistics]
mu = "mean(x)"
r = "1/sqrt(mean((x - mu)**2) + 1e-5)"
[normalized]
name = "xhat"
expr = "(x - mu)*r"
[output]
y = "gamma*xhat + 0.1*k*xhat"
""",
    ),
    "lrn_features": (TRAILING, {}, None),  # windows only: no mean
    # tensor inputs and outputs beside y: every gradient's means and every cotangent's
    "add_layernorm": ("zoo", {"group": 2}),  # ⟨g⟩, ⟨g·ĥ⟩ (∂L/∂h beside them: no mean)
    "flash_layernorm_parallel": ("zoo", {"group": 2}),  # g = ∂L/∂y·w + ∂L/∂y₁·w₁: ⟨g⟩, ⟨g·ĥ⟩
    "rmsnorm_gated_before": ("zoo", {"group": 1}),  # ⟨g·û⟩, through x and the gate alike
    "masked_batchnorm": ("zoo", {"group": 2}),  # the valid positions' ⟨g⟩, ⟨g·x̂⟩
    "adaln": ("zoo", {"group": 2}),  # the modulation's gradients read no mean
    "instance_blocks": (
        BATCH,
        {"instance": 2},  # instance norm written with block means in a batch layout
        """
[statistics]
mi = "mean(x, 'instance')"
vi = "mean((x - mi)**2, 'instance')"
[output]
y = "(x - mi)/sqrt(vi + 1e-5)"
""",
    ),
    "batch_instance": (
        BATCH,
        {"group": 2, "instance": 2},  # ρ·BN + (1 - ρ)·IN, with a group maximum beside it
        """
[params]
gamma = {}
[options]
rho = { default = 0.5, min = 0, max = 1 }
[statistics]
mu = "mean(x)"
var = "mean((x - mu)**2)"
mi = "mean(x, 'instance')"
vi = "mean((x - mi)**2, 'instance')"
mx = "max(abs(x)) + 1"
[output]
y = "gamma*(rho*(x - mu)/sqrt(var + 1e-5) + (1 - rho)*(x - mi)/sqrt(vi + 1e-5)) + x/mx"
""",
    ),
    "batch_channel": (
        ALL,
        {"batch": 2, "sample": 2},  # ρ·BN + (1 - ρ)·LN over the channels
        """
[params]
gamma = {}
[options]
rho = { default = 0.5, min = 0, max = 1 }
[statistics]
mb = "mean(x, 'batch')"
vb = "mean((x - mb)**2, 'batch')"
ml = "mean(x, 'sample')"
vl = "mean((x - ml)**2, 'sample')"
[output]
y = "gamma*(rho*(x - mb)/sqrt(vb + 1e-5) + (1 - rho)*(x - ml)/sqrt(vl + 1e-5))"
""",
    ),
}


def _known(name):
    where, minimum, *body = KNOWN_MINIMA[name]
    if where in ("catalogue", "zoo"):
        return derivgen.load_spec(name), minimum
    if name == "lrn_features":
        return parse_spec(LRN_FEATURES, source="lrn_features.toml"), minimum
    return _spec(where, body[0], name), minimum


@pytest.mark.parametrize("name", list(KNOWN_MINIMA))
def test_brute_force_minimum_of_known_layers(name):
    """The rank computation itself, on layers whose fewest means are known by hand: per kind
    (the kinds the layout holds and the layer does not use: zero), every mode (batch norm's
    eval mode: none), at two random points; and its Jacobian is the spec's forward's, by
    central differences of the forward alone (derivgen.tools.evaluate): with tensor inputs
    and outputs beside y, every block of it (x and each tensor with a gradient, against y
    and each output)."""
    import dataclasses

    import numpy as np

    from derivgen.tools.evaluate import evaluate

    spec, minimum = _known(name)
    d = derivgen.derive(spec)
    for mode in d.modes:
        want = minimum if mode == "train" else {}
        for seed in (0, 1):
            got = specfuzz.brute_force_minimum(spec, mode, seed, d)
            assert {k: n for k, n in got.items() if n} == want, (mode, seed, got)
    case = specfuzz.rank_case(spec)
    if len(case.x) > 144:
        return
    md = d.modes["train"]
    jac, _ = specfuzz._jacobian(md, case)
    block = specfuzz.block_mean(case.grid)
    n = len(case.x)

    def outputs(c):  # y and the outputs beside it, side by side
        y, env = specfuzz.group_evaluator(md, c).forward(c.x, c.params, c.scalars, block)
        return np.concatenate([y, *(evaluate(o.expr, env) * np.ones(n) for o in spec.outputs)])

    rows = ["x", *(t.name for t in spec.grad_tensors)]
    assert jac.shape == (n * len(rows), n * (1 + len(spec.outputs)))
    h, fd = 1e-6, np.empty_like(jac)
    for r, which in enumerate(rows):
        for e in range(n):
            moved = []
            for sign in (1, -1):
                if which == "x":
                    c = dataclasses.replace(case, x=case.x + sign * h * np.eye(n)[e])
                else:
                    c = dataclasses.replace(
                        case, tensors={**case.tensors, which: case.tensors[which] + sign * h * np.eye(n)[e]}
                    )
                moved.append(outputs(c))
            fd[r * n + e] = (moved[0] - moved[1]) / (2 * h)
    assert np.abs(fd - jac).max() < 1e-6 * max(1.0, np.abs(jac).max())


def test_reductions_above_the_minimum_are_reported():
    """The judgement: a count above the minimum is an excess of that kind; below it is one
    too (negative: the brute force or the backward is wrong)."""
    r = specfuzz.Reductions("train", {"group": 3, "instance": 2}, {"group": 2, "instance": 2, "batch": 0})
    assert not r.at_minimum and r.excess == {"group": 1} and str(r) == "train: group 3/2, instance 2/2"
    assert specfuzz.Reductions("eval", {"group": 1}, {"group": 2}).excess == {"group": -1}
    assert specfuzz.Reductions("eval", {}, {"group": 0, "instance": 0}).at_minimum


_AFTER_OPENMP = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import derivgen, specfuzz
mod = derivgen.load("layernorm", backend="c")
mod.set_num_threads(2)
x = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
y, cache = mod.forward(x, np.ones(256, np.float32), np.zeros(256, np.float32))   # libgomp's pool is up
r = specfuzz.run_corpus([0], jobs=2)   # one spawned worker suffices
print([(x.seed, x.ok, x.failure) for x in r])
sys.exit(0 if all(x.ok for x in r) else 1)
"""


def test_corpus_runs_after_openmp_kernels_in_the_same_process(tmp_path):
    """Regression: the corpus forked its workers from a pytest process that had already run
    OpenMP kernels; the children's first parallel region waited forever on libgomp's
    inherited (threadless) pool, and CI hung until its 90 minutes ran out. Workers are
    spawned now. Bounded: a hang fails here after 240 s instead of hanging the suite."""
    env = dict(
        os.environ,
        DERIVGEN_CACHE=private_cache(tmp_path),
        CFLAGS=QUICK_CFLAGS,
        PYTHONPATH=str(specfuzz.ROOT),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _AFTER_OPENMP, os.path.dirname(specfuzz.__file__)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stuck workers too, not only their parent
        out, _ = proc.communicate()
        pytest.fail("the corpus hung after OpenMP kernels ran in its process:\n" + out[-2000:])
    assert proc.returncode == 0, out


NAMING_SEEDS = range(120)


@pytest.mark.parametrize("seeds", sample_and_rest(NAMING_SEEDS, specfuzz.covering(NAMING_SEEDS)))
def test_naming_the_coordinate_or_not_needs_the_same_reductions(seeds):
    """The same layer written with its normalized coordinate in [normalized] or inline in the
    output (z = (x - mu)*r three times over): the engine names an inline coordinate itself, so
    the backward needs no more run-time reductions either way (regression: fuzz seed 228
    needed 6 inline, where mean(g) and mean(g*x̂) do)."""
    import derivgen

    worse = []
    for seed in seeds:
        named = parse_spec(specfuzz.generate(seed, name_coordinate=True), source=f"named{seed}.toml")
        inline = parse_spec(specfuzz.generate(seed, name_coordinate=False), source=f"inline{seed}.toml")
        assert named.normalized is not None and inline.normalized is None
        dn, di = derivgen.derive(named), derivgen.derive(inline)
        for mode in dn.modes:
            a, b = len(dn.modes[mode].reductions), len(di.modes[mode].reductions)
            if b > a:
                worse.append(f"seed {seed} {mode}: {b} reductions inline, {a} named")
    assert not worse, "\n".join(worse)


# regression specs (tests/regressions/) that the fuzzer's channels-last check found
CHANNELS_LAST_REGRESSIONS = ["batch_no_gradient_partials"]


@pytest.mark.parametrize("name", CHANNELS_LAST_REGRESSIONS)
def test_channels_last_regression_spec(name, monkeypatch):
    """The channels-last kernels of a spec the fuzzer's channels-last check failed build
    without a warning (-Werror) and give the NCHW kernels' bits."""
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)  # compile fast; still -Werror
    spec = derivgen.load_spec(ROOT / "tests" / "regressions" / f"{name}.toml")
    assert specfuzz.channels_last_mismatches(spec) == []


# ------------------------------------------------------------------ the tensor family


def test_the_tensor_family_is_valid_and_varied():
    """Every seed of the tensor family parses to a layer with tensor inputs, values or outputs
    beside y, in every layout, with none of what it leaves out (block statistics, windows,
    leading(), group max/min); its first 40 seeds have every tensor shape and kind, a core
    value with tensors and with a parameter in it, tensors in the statistics and in the
    output, values beside the core, one and two outputs beside y and the core value among them."""
    from derivgen.symbolic.reduce import SELECTIONS

    kinds = set()
    for seed in range(specfuzz.TENSOR_SEEDS, specfuzz.TENSOR_SEEDS + 60):
        spec = parse_spec(specfuzz.generate(seed), source=f"fuzz{seed}.toml")
        assert spec.multi, seed
        assert not spec.windows and not spec.masks, seed
        assert not any(m.blocks or any(st.expr.has(*SELECTIONS) for st in m.statistics) for m in spec.modes), seed
        kinds.add((spec.layout, spec.reduce))
    assert len(kinds) == 5
    every = set().union(*(specfuzz.features(s) for s in TENSOR_RUN_SEEDS))
    assert every >= {
        "tensor x",
        "tensor sample",
        "tensor position",
        "tensor mask",
        "tensor constant",
        "tensor with gradient",
        "tensor in core",
        "tensor in statistics",
        "tensor in output",
        "core value",
        "parameter in core",
        "values beside the core",
        "outputs beside y: 1",
        "outputs beside y: 2",
        "output is the core value",
    }
    # the quick sample has every tensor feature of the seeds the corpus test runs
    feats = {f for s in TENSOR_RUN_SEEDS for f in specfuzz.features(s) if f.startswith(TENSOR_FEATURES)}
    assert feats == {f for s in TENSOR_QUICK_SEEDS for f in specfuzz.features(s) if f.startswith(TENSOR_FEATURES)}
    # and the families before it draw what they drew (the tensor family's draws are its own)
    assert "[tensors]" not in specfuzz.generate(specfuzz.TENSOR_SEEDS - 1)


def test_the_tensor_family_weights_every_mean_and_writes_the_core_for_x():
    """The rewrites the family makes of an ordinary draw: every mean(e) and sum(e) over a mask's
    valid elements (nested ones too), and x written as the core value (not inside names)."""
    got = specfuzz._weighted_means("sum((x - mu)**2)/(N - 1) + mean(abs(x - mean(x)))", "m", "f")
    assert got == "(sum(m*((x - mu)**2))/f)/(N - 1) + (mean(m*(abs(x - (mean(m*(x))/f))))/f)"
    assert specfuzz._with_core("x_t*x + exp(x)/xv", "h") == "x_t*h + exp(h)/xv"


@pytest.mark.parametrize(
    "layout, shape",
    [
        (TRAILING, "x"),
        (TRAILING, "sample"),
        ('kind = "trailing"\naxes = 2', "sample"),
        (BATCH, "position"),
        (BATCH, "sample"),
        ('kind = "channels"\nreduce = "instance"', "position"),
        ('kind = "channels"\nreduce = "group"', "sample"),
        ('kind = "channels"\nreduce = "position"', "sample"),
    ],
)
def test_tensor_case_masks_leave_two_valid_elements_in_every_group(layout, shape):
    """A mask the judge draws leaves at least two valid elements in every group (a masked
    variance has something to spread over), in its declared shape; so does the brute force's."""
    import numpy as np

    spec = _spec(
        layout,
        f"""
[tensors]
m = {{ mask = true, shape = "{shape}" }}
[statistics]
f = "mean(m)"
mu = "mean(m*x)/f"
v = "mean(m*(x - mu)**2)/f"
[output]
y = "(x - mu)/sqrt(v + 1)"
""",
    )
    for seed in range(5):
        case = specfuzz.tensor_case(spec, "train", seed)
        x_shape, m = case.args["x"].shape, case.args["m"]
        assert m.shape == specfuzz.declared_shape(spec, spec.tensors[0], x_shape, case.k)
        full = np.broadcast_to(m.reshape(specfuzz.broadcast_shape(spec, spec.tensors[0], x_shape, case.k)), x_shape)
        counts = full.reshape(case.layout.view4).sum(axis=case.layout.reduce_axes)
        assert counts.min() >= 2 and set(np.unique(m)) <= {0.0, 1.0}
        assert specfuzz.rank_case(spec, seed).tensors["m"].sum() >= 2


def test_the_tensor_judge_finds_a_wrong_gradient_or_output():
    """The judge itself: adaLN's generated NumPy passes; the same with one gradient (dx, or a
    broadcast tensor's) or one output beside y (add_rmsnorm's h) off by one part in 10⁴ fails
    against PyTorch and against finite differences."""
    spec = derivgen.load_spec("adaln")
    mod = derivgen.load(spec, backend="numpy")
    case = specfuzz.tensor_case(spec, "train", 11)
    assert specfuzz.tensor_checks(spec, {"numpy": mod}, case) == []

    class Off:
        def __init__(self, field):
            self.field = field

        def __getattr__(self, name):  # the second order: the module's own
            return getattr(mod, name)

        def forward(self, *args, **kw):
            return mod.forward(*args, **kw)

        def backward(self, *args, **kw):
            g = mod.backward(*args, **kw)
            getattr(g, self.field)[...] *= 1.0001  # in place: the judge checks out= comes back
            return g

    for field in ("dx", "dscale"):
        bad = specfuzz.tensor_checks(spec, {"numpy": Off(field)}, case)
        # and the double backward, judged against differences of this backward, disagrees
        assert len(bad) == 3 and all(field in b for b in bad[:2]) and "backward_backward" in bad[2], bad
        assert "torch" in bad[0] and "finite differences" in bad[1]
    fused = derivgen.load_spec("add_rmsnorm")
    fmod = derivgen.load(fused, backend="numpy")

    class OffH:
        def __getattr__(self, name):
            return getattr(fmod, name)

        def forward(self, *args, **kw):
            (y, h), cache = fmod.forward(*args, **kw)
            h[...] *= 1.0001
            return (y, h), cache

        def backward(self, *args, **kw):
            return fmod.backward(*args, **kw)

    bad = specfuzz.tensor_checks(fused, {"numpy": OffH()}, specfuzz.tensor_case(fused, "train", 11))
    assert bad and "h=" in bad[0], bad


def test_the_second_order_judge_finds_a_wrong_double_backward_or_jvp():
    """specfuzz.second_checks: add_layernorm's generated second order passes; the double
    backward with one gradient (dresidual, or ddh: the cotangent's) off by one part in 10⁴, or
    the JVP's tangent of h, fails."""
    spec = derivgen.load_spec("add_layernorm")
    mod = derivgen.load(spec, backend="numpy")
    case = specfuzz.tensor_case(spec, "train", 11)
    assert specfuzz.second_checks(spec, mod, case, "train") == []

    class Off:
        def __init__(self, field):
            self.field = field

        def __getattr__(self, name):
            return getattr(mod, name)

        def backward_backward(self, *args, **kw):
            g = mod.backward_backward(*args, **kw)
            if self.field in g._fields:
                getattr(g, self.field)[...] *= 1.0001
            return g

        def jvp(self, *args, **kw):
            ty, th = mod.jvp(*args, **kw)
            return ty, th * (1.0001 if self.field == "th" else 1.0)

    for field in ("dresidual", "ddh", "th"):
        bad = specfuzz.second_checks(spec, Off(field), case, "train")
        assert len(bad) == 1 and ("jvp" if field == "th" else "backward_backward") in bad[0], (field, bad)


@pytest.mark.slow
@pytest.mark.parametrize("seeds", sample_and_rest(TENSOR_RUN_SEEDS, TENSOR_QUICK_SEEDS))
def test_tensor_corpus_passes(seeds, tmp_path, monkeypatch):
    """The tensor family's seeds through specfuzz.run_tensors: proven (or checked numerically)
    at N = 2, 3; NumPy and C (built with -Werror) against PyTorch autograd of the spec's forward,
    finite differences and each other, in float64, float32 against float64; every other channel
    layout's channels-last kernels against its NCHW ones (all of them in `make fuzz`)."""
    monkeypatch.setenv("DERIVGEN_CACHE", private_cache(tmp_path))
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)  # compile fast; still -Werror
    t0 = time.perf_counter()
    results = specfuzz.run_corpus(seeds, jobs=min(2, os.cpu_count() or 1), deadline=CI_DEADLINE, channels_last_every=2)
    print("\n" + specfuzz.summary(results, time.perf_counter() - t0))
    failed = [f"seed {r.seed}: {r.failure}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert len(results) == len(seeds)


def test_known_tensor_failures_name_their_regression_spec():
    for seed, name in KNOWN_TENSOR_FAILURES.items():
        assert seed in TENSOR_CI_SEEDS and (ROOT / "tests" / "regressions" / f"{name}.toml").exists(), seed


# the proofs that run past their budget of work, each in SymPy outside it at a place of its own:
# an exponential of the coordinate (canonical_exponentials' sympy.expand; fuzz seeds 300052,
# 300132), tanh beside y (_proven's xreplace, tanh's assumptions; 300016, 300044, 300069, 300091,
# 300136, 300151), a root of the coordinate (_primitive_root's sympy.expand; 300028, 300049,
# 300078, 300178, 300196); each layer without its mask proves in about a second
PROOF_TIME_REGRESSIONS = ["masked_exp_proof_time", "masked_tanh_proof_time", "masked_root_proof_time"]
TENSOR_REGRESSIONS = sorted((ROOT / "tests" / "regressions" / "tensors").glob("*.toml"))
# the regression specs whose pipeline takes minutes (the bug they hold), or over a minute
# (masked_second_order_time's second order, about 30 s, and its proofs): their own tests below
SLOW_TENSOR_REGRESSIONS = {*PROOF_TIME_REGRESSIONS, "masked_second_order_time"}


@pytest.mark.parametrize(
    "path", [p for p in TENSOR_REGRESSIONS if p.stem not in SLOW_TENSOR_REGRESSIONS], ids=lambda p: p.stem
)
def test_tensor_regression_spec_goes_through_the_pipeline(path, monkeypatch):
    """The specs of tests/regressions/tensors/ (layers with tensor inputs, values or outputs
    beside y, which derivgen.tools.check does not take: tests/derive/test_regressions.py runs
    the others) through specfuzz.run_tensors."""
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)
    r = specfuzz.run_tensors(path.read_text(), prove_sizes=(2, 3))
    assert r.ok and r.proof == "proven", r


@pytest.mark.xfail(strict=True, reason="open: masked statistics beside other outputs get no centred coordinate")
def test_masked_statistics_beside_other_outputs_are_centred():
    """masked_outputs_raw_powers (fuzz seed 300170): the backward must not be written in raw
    powers of x; at an offset of 1000 its float64 gradients agree with PyTorch autograd as the
    centred closed forms do (to 1e-9, relative), where raw powers are off by ~1e-6."""
    spec = derivgen.load_spec(ROOT / "tests" / "regressions" / "tensors" / "masked_outputs_raw_powers.toml")
    case = specfuzz.tensor_case(spec, "train", 11)
    case.args["x"] = case.args["x"] + 1000.0
    _, want, _ = specfuzz._torch_tensors(spec, case, case.args)
    for backend in ("numpy", "c"):
        _, grads, _ = specfuzz._call_module(derivgen.load(spec, backend=backend), spec, case, case.args)
        assert specfuzz._relative(grads.dx, want["dx"]) < 1e-9, backend


@pytest.mark.full
@pytest.mark.xfail(strict=True, reason="open: SymPy's evaluation outside the proof's work budget")
@pytest.mark.parametrize("name", PROOF_TIME_REGRESSIONS)
def test_masked_statistics_proof_settles_within_its_budget(name):
    """The proof at N = 3 under the fuzzer's budget of work settles (proven, or checked
    numerically once the budget is spent) within 20 s, as the unmasked layers' do in one."""
    from derivgen.prove import proof

    spec = derivgen.load_spec(ROOT / "tests" / "regressions" / "tensors" / f"{name}.toml")
    d = derivgen.derive(spec)

    def late(signum, frame):
        raise TimeoutError("the proof at N = 3 took longer than 20 s")

    old, work = signal.signal(signal.SIGALRM, late), proof.SYMBOLIC_WORK
    proof.SYMBOLIC_WORK = specfuzz.PROOF_WORK
    signal.alarm(20)
    t0 = time.perf_counter()
    try:
        assert proof.prove_mode(d.modes["train"], (3,)).ok
        assert time.perf_counter() - t0 < 20  # should the proof have caught the alarm
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        proof.SYMBOLIC_WORK = work


@pytest.mark.full
def test_masked_second_order_derives_within_its_budget():
    """masked_second_order_time (fuzz seed 300008): its second order, which generating any of
    its modules derives, takes under 60 s of CPU time (it took about 80 s, 50 of them in
    derive.rewrite.tidy's factor_terms; with the large sums' denominators factored, about 30:
    over the quick tier's 20 s, so in the full one)."""
    spec = derivgen.load_spec(ROOT / "tests" / "regressions" / "tensors" / "masked_second_order_time.toml")
    d = derivgen.derive(spec)
    t0 = time.process_time()
    d.second("train")
    assert time.process_time() - t0 < 60


@pytest.mark.xfail(strict=True, reason="open: proportional means of dL/dy over a per-group factor not merged")
def test_per_group_factor_means_are_one():
    """per_group_factor_means (fuzz seed 300067): mean(dy*n) and mean(g*n) with g = dy*(weight + k),
    one value per instance group, are one mean: the backward reads the brute-force minimum, 2."""
    spec = derivgen.load_spec(ROOT / "tests" / "regressions" / "per_group_factor_means.toml")
    found = specfuzz.reduction_minimum(spec, derivgen.derive(spec))
    assert all(r.at_minimum for r in found), [str(r) for r in found]
