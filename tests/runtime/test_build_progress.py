"""A first-use compile says so in one line on stderr, whatever stderr is (a terminal, a
file, a pipe: notebooks and CI logs are not terminals), naming what it compiles, about
how long it takes and the cache; a build found in the cache says nothing
(derivgen.runtime.build)."""

import io
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from derivgen.runtime import build

SOURCE = ROOT / "derivgen" / "tools" / "bandwidth.c"  # small: compiles in a second


def test_the_line_goes_to_any_stderr(monkeypatch, tmp_path):
    pipe = io.StringIO()  # not a terminal
    monkeypatch.setattr(build.sys, "stderr", pipe)
    build.announce("layernorm.c", "10 s", tmp_path)
    assert pipe.getvalue() == f"derivgen: compiling layernorm.c (first use, about 10 s; cached in {tmp_path})\n"
    monkeypatch.setattr(build.sys, "stderr", None)  # pythonw: no stderr at all
    build.announce("layernorm.c", "10 s", tmp_path)


def test_estimates_grow_with_the_source(tmp_path):
    small, large = tmp_path / "s.c", tmp_path / "l.c"
    small.write_text("x" * 1000)
    large.write_text("x" * 500_000)
    assert build._estimate(small) == "5 s"
    assert build._estimate(large) == "20 s"  # batchnorm.c's size: 18 s measured
    assert build._variant(["-DDG_EXTRAS_ONLY"], None) == "'s bfloat16 and channels-last kernels"
    assert build._variant(["-DDG_SECOND_ONLY"], None) == "'s second-order kernels"
    assert build._variant(None, ["-O2", "-march=x86-64-v3"]) == " for -march=x86-64-v3"


def test_a_first_build_announces_itself_with_stderr_in_a_file(tmp_path):
    cache = tmp_path / "cache"
    err = tmp_path / "stderr.txt"
    code = f"from derivgen.runtime.build import build_shared; print(build_shared({str(SOURCE)!r}))"
    env = dict(os.environ, DERIVGEN_CACHE=str(cache), PYTHONPATH=str(ROOT))
    for _ in range(2):
        with open(err, "w") as f:
            r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f, text=True, env=env)
        assert r.returncode == 0, err.read_text()
        assert Path(r.stdout.strip()).parent == cache
        if _ == 0:
            lines = err.read_text().splitlines()
            assert lines == [f"derivgen: compiling bandwidth.c (first use, about 5 s; cached in {cache})"], lines
    assert err.read_text() == ""  # the second process found it in the cache
