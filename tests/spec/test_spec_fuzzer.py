"""Generality is tested by generation: the spec fuzzer's CI corpus -- 30 specs a user could
write, fixed seeds; make test runs the 10 of them that together have every feature -- goes
through derive, prove, generate, compile (-Werror) and check (both backends, float32 and
float64, against finite differences and each other). The larger corpus is `make fuzz`. Every failure the fuzzer finds becomes a spec in tests/regressions/."""

import os
import signal
import subprocess
import sys
import time

import pytest
import specfuzz
from conftest import ROOT, private_cache, sample_and_rest

import derivgen
from derivgen.spec.model import parse_spec, reserved_reason
from derivgen.symbolic.block import BlockMean

# and two of the block family (a group layout and a batch layout; the all layout's take a minute
# each: `make fuzz` runs them, and the zoo's switchnorm and the sanitizer's block spec are in it).
# Seeds 28 and up are `make fuzz`'s. make test runs the sample of seeds 0-27 that has every
# feature of them all (specfuzz.covering) and the block seeds; make test-full the other seeds too.
CI_SEEDS = [*range(28), specfuzz.BLOCK_SEEDS, specfuzz.BLOCK_SEEDS + 8]
QUICK_SEEDS = [*specfuzz.covering(range(28)), specfuzz.BLOCK_SEEDS, specfuzz.BLOCK_SEEDS + 8]
CI_DEADLINE = 900  # seconds; seeds not started by then fail the test ("not run")


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


@pytest.mark.slow
@pytest.mark.parametrize("seeds", sample_and_rest(CI_SEEDS, QUICK_SEEDS))
def test_ci_corpus_passes(seeds, tmp_path, monkeypatch):
    monkeypatch.setenv("DERIVGEN_CACHE", private_cache(tmp_path))
    monkeypatch.setenv("CFLAGS", "-O1 -march=native -fno-math-errno")  # compile fast; still -Werror
    t0 = time.perf_counter()
    # every seed's second order is checked (finite differences, the other backend); every
    # other one is proven by brute force at N = 2 here, and every other channel layout's
    # channels-last kernels checked against its NCHW ones (all of them, N = 2, 3, in `make fuzz`)
    results = specfuzz.run_corpus(
        seeds,
        jobs=min(2, os.cpu_count() or 1),
        proof_seconds=10.0,
        deadline=CI_DEADLINE,
        second_order=(2, (2,)),
        channels_last_every=2,
    )
    print("\n" + specfuzz.summary(results, time.perf_counter() - t0))
    failed = [f"seed {r.seed}: {r.failure}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert len(results) == len(seeds)


_AFTER_OPENMP = """
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
import derivgen, specfuzz
mod = derivgen.load("layernorm", backend="c")
mod.set_num_threads(2)
x = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
y, cache = mod.forward(x, np.ones(256, np.float32), np.zeros(256, np.float32))   # libgomp's pool is up
r = specfuzz.run_corpus([0], jobs=2, proof_seconds=5.0, deadline=120)   # one spawned worker suffices
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
        CFLAGS="-O1 -march=native -fno-math-errno",
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
    monkeypatch.setenv("CFLAGS", "-O1 -march=native -fno-math-errno")  # compile fast; still -Werror
    spec = derivgen.load_spec(ROOT / "tests" / "regressions" / f"{name}.toml")
    assert specfuzz.channels_last_mismatches(spec) == []
