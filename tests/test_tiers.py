"""The two tiers of the test suite: `make test` deselects the corpus members marked `full`
(conftest.corpus), `make test-full` runs everything, and the mark is registered."""

import re
import tomllib

from conftest import ROOT


def _recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.MULTILINE)
    assert m, f"Makefile has no {target} target"
    return m[1]


def test_make_test_deselects_full_and_make_test_full_does_not():
    quick, full = _recipe("test"), _recipe("test-full")
    assert "pytest" in quick and '-m "not full"' in quick
    assert "pytest" in full and "-m" not in full.split("pytest", 1)[1]
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("full:") for m in markers)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_a_corpus_keeps_its_sample_unmarked():
    import pytest
    from conftest import corpus

    params = corpus([3, 1, 2], quick=[1], ids=lambda s: f"seed{s}")
    assert [p.id for p in params] == ["seed3", "seed1", "seed2"]
    assert [bool(p.marks) for p in params] == [True, False, True]
    assert all(m.name == "full" for p in params for m in p.marks)
    with pytest.raises(AssertionError, match="lacks"):
        corpus([1, 2], quick=[5])


def test_a_grid_sample_has_every_pair_of_values():
    import itertools

    from conftest import grid

    axes = ([(2, 3), (4,), (1, 1, 5)], [1, 2, 5], ["f64", "f32"])
    params = grid(*axes)
    assert len(params) == 18 and len({p.id for p in params}) == 18
    quick = [p.values for p in params if not p.marks]
    assert len(quick) == 9
    for a, b in itertools.combinations(range(3), 2):
        assert {(q[a], q[b]) for q in quick} == set(itertools.product(axes[a], axes[b])), (a, b)


def test_features_come_from_the_formulas_and_declarations():
    import specfuzz

    text = """name = "t"
title = "Not mean(x) but prose: exp(x)"
[layout]
kind = "trailing"
[params]
b = { role = "shift", shape = "scalar" }
[statistics]
mu = "mean(x)"
[output]
y = "tanh(x - mu) + b"
"""
    f = specfuzz.text_features(text, "t.toml")
    assert {"call mean", "call tanh", "role shift", "shape scalar", "table params"} <= f
    assert "call exp" not in f and "layout trailing/features" in f
    # a corpus's sample: the earliest item with the most new features first, none redundant here
    feats = {1: {"a"}, 2: {"a", "b"}, 3: {"c"}, 4: {"b", "c"}}
    assert specfuzz.covering([1, 2, 3, 4], key=feats.__getitem__) == [2, 3]
