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
