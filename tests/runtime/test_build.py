"""The C build: strict flags, cache keying, concurrency, clear failures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, require_tool

from derivgen.runtime import build

GEN_C = sorted((ROOT / "generated" / "c").glob("*.c"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DERIVGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    "openmp,kernels",
    [(True, "-DDG_WITH_EXTRAS"), (False, "-DDG_EXTRAS_ONLY")],
    ids=["openmp-all-kernels", "serial-extras-only"],
)
@pytest.mark.parametrize("src", GEN_C, ids=[p.stem for p in GEN_C])
def test_generated_c_is_strict_c99(src, openmp, kernels, tmp_path):
    """Every kernel of every generated file (float, double, bfloat16, channels-last: the default build
    compiles the first two, and the fuzzer and the other tests compile it under -Werror)."""
    cc = require_tool("gcc")
    argv = [
        cc,
        "-std=c99",
        "-Wall",
        "-Wextra",
        "-pedantic",
        "-Werror",
        "-O2",
        "-fPIC",
        "-c",
        kernels,
        *(["-fopenmp"] if openmp else []),
        str(src),
        "-o",
        str(tmp_path / "k.o"),
    ]
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_cache_location_and_key(cache, monkeypatch):
    src = ROOT / "generated" / "c" / "rmsnorm.c"
    lib = build.build_shared(src)
    assert lib.parent == cache and lib.is_file()
    assert build.build_shared(src) == lib  # cached
    monkeypatch.setenv("CFLAGS", "-O1")
    lib2 = build.build_shared(src)
    assert lib2 != lib  # flags are part of the key
    assert not list(ROOT.glob("generated/c/*.so"))


def test_compiler_failure_carries_stderr(cache, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("int f(void) { return undefined_symbol; }\n")
    with pytest.raises(build.BuildError) as exc:
        build.build_shared(bad)
    assert "undefined_symbol" in exc.value.stderr
    assert not [p for p in cache.iterdir() if p.suffix in (".so", ".tmp")]


def test_missing_compiler_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(build.BuildError, match="not found"):
        build.build_shared(ROOT / "generated" / "c" / "rmsnorm.c")


def test_concurrent_builds_of_the_same_kernel(cache, tmp_path):
    src = tmp_path / "k.c"
    src.write_text((ROOT / "generated" / "c" / "layernorm.c").read_text())
    for h in ("layernorm.h", "derivgen-kernels.h"):
        (tmp_path / h).write_text((ROOT / "generated" / "c" / h).read_text())
    code = (
        "import sys; from pathlib import Path; from derivgen.runtime.build import build_shared; "
        "print(build_shared(Path(sys.argv[1])))"
    )
    env = dict(os.environ, DERIVGEN_CACHE=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    libs = {o[0].strip() for o in outs}
    assert len(libs) == 1
    assert [p.name for p in cache.iterdir() if p.suffix == ".so"] == [Path(libs.pop()).name]
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_build_command(cache, monkeypatch):
    r = subprocess.run(
        [sys.executable, "-m", "derivgen", "build", "rmsnorm", "groupnorm"],
        capture_output=True,
        text=True,
        env=dict(os.environ, DERIVGEN_CACHE=str(cache)),
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    libs = [line.split()[-1] for line in r.stdout.splitlines()]
    assert len(libs) == 2 and all(Path(p).is_file() and Path(p).parent == cache for p in libs)
    assert all(" compiled in " in line for line in r.stdout.splitlines())
    again = subprocess.run(
        [sys.executable, "-m", "derivgen", "build", "rmsnorm"],
        capture_output=True,
        text=True,
        env=dict(os.environ, DERIVGEN_CACHE=str(cache)),
        timeout=600,
    )
    assert again.returncode == 0 and " cached " in again.stdout and again.stdout.split()[-1] == libs[0]
    r = subprocess.run(
        [sys.executable, "-m", "derivgen", "build", "rmsnorm"],
        capture_output=True,
        text=True,
        env=dict(os.environ, DERIVGEN_CACHE=str(cache), CFLAGS="-O2 -fno-such-flag"),
        timeout=600,
    )
    assert r.returncode == 1 and "no-such-flag" in r.stderr and "Traceback" not in r.stderr
