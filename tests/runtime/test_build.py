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
    [(True, "-DDG_WITH_EXTRAS -DDG_WITH_SECOND"), (False, "-DDG_EXTRAS_ONLY"), (False, "-DDG_SECOND_ONLY")],
    ids=["openmp-all-kernels", "serial-extras-only", "serial-second-only"],
)
@pytest.mark.parametrize("src", GEN_C, ids=[p.stem for p in GEN_C])
def test_generated_c_is_strict_c99(src, openmp, kernels, tmp_path):
    """Every kernel of every generated file (float and double first and second order, bfloat16,
    channels-last: the default build compiles the first order in float and double, and the
    fuzzer and the other tests compile every library under -Werror), and each library alone
    (a function only the other calls must not warn)."""
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
        *kernels.split(),
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


def test_second_order_kernels_are_a_library_of_their_own(cache):
    """`derivgen build` compiles the first-order kernels, `--second` the double backward and JVP
    too, into a second library; neither holds the other's kernels, and the C binding loads the
    second only when a second-order kernel is first called."""
    import ctypes

    r = subprocess.run(
        [sys.executable, "-m", "derivgen", "build", "rmsnorm", "--second"],
        capture_output=True,
        text=True,
        env=dict(os.environ, DERIVGEN_CACHE=str(cache)),
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["rmsnorm", "compiled"], ["rmsnorm", "2nd"]], lines
    first, second = (ctypes.CDLL(line.split()[-1]) for line in lines)
    assert hasattr(first, "rmsnorm_train_forward_f32") and not hasattr(first, "rmsnorm_train_bb_f32")
    assert hasattr(second, "rmsnorm_train_jvp_f64") and not hasattr(second, "rmsnorm_train_backward_f64")
    import derivgen
    from derivgen.runtime.cbind import CKernel

    loaded = derivgen.load("rmsnorm", backend="c")._kernel
    kernel = CKernel(loaded.meta, loaded.source)
    kernel.cfunc("train", "backward", "f32")
    assert kernel._second is None  # first order only: the second library not loaded
    kernel.second_cfunc("train", "bb", "f32")
    assert kernel._second is not None


# ---- the load-time ISA dispatch: the library built for this machine's x86-64 level ----


def test_default_flags_target_this_machines_x86_level(monkeypatch):
    from derivgen.runtime import machine as mach

    monkeypatch.delenv("CFLAGS", raising=False)
    for level in ("x86-64-v4", "x86-64-v3", "x86-64"):
        monkeypatch.setattr(mach, "machine", lambda level=level: mach.Machine("cpu", 2, level=level))
        flags = build.user_cflags()
        assert f"-march={level}" in flags and "-march=native" not in flags
        assert build.build_target(flags) == level
    monkeypatch.setattr(mach, "machine", lambda: mach.Machine("arm", 2, level=""))
    assert "-march=native" in build.user_cflags()  # off x86-64 native stays


def test_x86_levels_from_cpuinfo_flags():
    from derivgen.runtime.machine import X86_LEVELS, x86_level

    v2 = {f for _, need in X86_LEVELS[2:] for f in need}
    v3 = v2 | set(X86_LEVELS[1][1])
    v4 = v3 | set(X86_LEVELS[0][1])
    assert x86_level(v4, "x86_64") == "x86-64-v4"
    assert x86_level(v4 - {"avx512vl"}, "x86_64") == "x86-64-v3"
    assert x86_level(v3, "x86_64") == "x86-64-v3"
    assert x86_level(v3 - {"fma"}, "x86_64") == "x86-64-v2"
    assert x86_level({"sse2"}, "x86_64") == "x86-64"
    assert x86_level(v4, "aarch64") == ""


def test_native_builds_are_keyed_by_what_native_means_here(cache, monkeypatch):
    src = ROOT / "generated" / "c" / "rmsnorm.c"
    monkeypatch.setattr(build, "native_target", lambda cc: "-march=one-cpu")
    a = build.library_path(src, cflags=["-O2", "-march=native"])
    monkeypatch.setattr(build, "native_target", lambda cc: "-march=another-cpu")
    b = build.library_path(src, cflags=["-O2", "-march=native"])
    c = build.library_path(src, cflags=["-O2", "-march=x86-64-v3"])
    monkeypatch.setattr(build, "native_target", lambda cc: "-march=a-third-cpu")
    assert a != b and build.library_path(src, cflags=["-O2", "-march=x86-64-v3"]) == c


def test_every_x86_level_this_cpu_runs_gives_the_same_results(cache):
    """The variants the dispatch can pick (each level this CPU runs) agree: bit for bit
    (-ffp-contract=off and the fixed lane count make the summation order the same); the
    library reports the level it was built for."""
    import numpy as np

    import derivgen
    from derivgen.runtime.machine import X86_LEVELS, machine

    level = machine().level
    if not level:
        pytest.skip("not an x86-64 machine")
    names = [n for n, _ in X86_LEVELS] + ["x86-64"]
    levels = names[names.index(level) :]
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((300, 160)) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal((300, 160)).astype(np.float32)
    g, b = (1 + 0.1 * rng.standard_normal((2, 160))).astype(np.float32)
    results = {}
    for lv in levels:
        flags = ["-O3", f"-march={lv}", "-fno-math-errno", "-ffp-contract=off"]
        mod = derivgen.load("layernorm", backend="c", cflags=flags)
        mod.set_num_threads(2)
        assert mod._kernel.target == lv
        y, cache_ = mod.forward(x, g, b)
        results[lv] = (y, *mod.backward(dy, cache_))
    ref = results[levels[0]]
    for lv, got in results.items():
        for a, r in zip(got, ref):
            np.testing.assert_array_equal(a, r, err_msg=lv)
