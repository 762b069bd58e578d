"""A plain (non-editable) wheel install, used from another directory."""

import os
import subprocess
import sys
import venv

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_wheel_in_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(dist.glob("derivgen-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = dict(os.environ, DERIVGEN_CACHE=str(tmp_path / "cache"))
    env.pop("PYTHONPATH", None)
    r = subprocess.run(
        [str(env_dir / "bin" / "derivgen"), "generate", "layernorm", "--out", "gen"],
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (work / "gen" / "c" / "layernorm.c").is_file()
    code = (
        "import numpy as np, derivgen; k = derivgen.load('layernorm', backend='c'); "
        "x = np.random.default_rng(0).normal(size=(4, 6)); y, c = k.forward(x, np.ones(6), np.zeros(6)); "
        "g = k.backward(np.ones_like(x), c); assert abs(y.mean(-1)).max() < 1e-12; "
        "assert abs(g.dx).max() < 1e-9; print(derivgen.__file__)"
    )
    r = subprocess.run([str(py), "-c", code], cwd=work, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "site-packages" in r.stdout and str(ROOT) not in r.stdout
    assert list((tmp_path / "cache").glob("*.so"))
