"""What ``pip install .`` installs: the wheel builds without a packaging warning, holds
every data file the tool reads (the catalogue's and the zoo's specs, the templates, the C
and C++ sources it compiles), and, without torch, JAX or Triton, runs the NumPy and C
paths (derive, generate, load). Offline: the wheel is built with this environment's
setuptools (no build isolation), and run from its unpacked files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy, so that the build leaves no build/ or egg-info in the clone
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", ".*cache")
    )
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip is not installed in this environment")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "absent from the `packages` configuration" not in out, out
    assert "Warning" not in out, out
    (whl,) = (tmp / "dist").glob("derivgen-*.whl")
    return whl


def test_the_wheel_holds_every_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("catalogue", "zoo"):
        specs = {f"derivgen/spec/{folder}/{p.name}" for p in (ROOT / "derivgen" / "spec" / folder).glob("*.toml")}
        assert specs and specs <= names, sorted(specs - names)
    templates = {
        f"derivgen/templates/{p.relative_to(ROOT / 'templates').as_posix()}" for p in (ROOT / "templates").rglob("*.j2")
    }
    assert templates <= names, sorted(templates - names)
    assert {"derivgen/torch/ext.cpp", "derivgen/tools/bandwidth.c"} <= names
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "derivgen").rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # every subpackage is named in pyproject.toml


def test_without_the_extras_numpy_and_c_run(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import sys\n"
        "for m in ('torch', 'jax', 'triton'): sys.modules[m] = None  # none of the extras\n"
        "import numpy as np, derivgen\n"
        f"assert derivgen.__file__.startswith({str(site)!r}), derivgen.__file__\n"
        "assert 'layernorm' in derivgen.names() and derivgen.load_spec('dynamic_tanh').name == 'dynamic_tanh'\n"
        "d = derivgen.derive('layernorm')\n"
        "x = np.random.default_rng(0).normal(size=(4, 16))\n"
        "for backend in ('numpy', 'c'):\n"
        "    k = derivgen.load('layernorm', backend=backend)\n"
        "    y, cache = k.forward(x, np.ones(16), np.zeros(16))\n"
        "    assert abs(y.mean(axis=1)).max() < 1e-12\n"
        "    assert abs(k.backward(np.ones_like(x), cache).dx).max() < 1e-12\n"
        "from derivgen.cli import main\n"
        "sys.exit(main(['generate', 'rmsnorm', '--target', 'numpy', '--out', 'gen']))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site), DERIVGEN_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "gen" / "numpy" / "rmsnorm.py").is_file()
