"""The memory-traffic paths of the C kernels -- non-temporal stores through a
per-thread tile, software prefetch across block boundaries -- change where bits
go, never which bits: builds that force them on (DG_STREAM_BYTES=0, a short
DG_AHEAD_BYTES) must give results identical to builds that turn them off, for
every layer, both dtypes, 1 and 2 threads, misaligned inputs and outputs, and
for the AVX-512, AVX2 and SSE2 variants of the streaming copy."""

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import IN_CI, require_tool, run_driver

from derivgen.runtime.machine import X86_LEVELS, machine

# -O1: the streaming stores, tiles and prefetches are intrinsics, compiled as written at any
# level, and -O1 compiles the six layers (with derivgen.torch's extras) about 3x faster than
# -O3; -ffp-contract=off: every ISA the same bits (clang fuses by default)
BASE = "-O1 -fno-math-errno -ffp-contract=off"
OFF = "-DDG_STREAM_BYTES=INT64_MAX -DDG_AHEAD_BYTES=0"
ON = "-DDG_STREAM_BYTES=0 -DDG_AHEAD_BYTES=64"


def _run(tmp_path, tag: str, cflags: str, with_torch: bool) -> dict:
    require_tool("gcc")
    out = tmp_path / f"{tag}.npz"
    env = {"STREAM_TORCH": "1" if with_torch else "0"}
    r = run_driver("stream_driver.py", tmp_path, cflags, out, env=env, timeout=600)
    assert r.returncode == 0, (cflags, r.stdout[-2000:], r.stderr[-4000:])
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


# streamed builds, each path on one ISA (each ISA's streaming stores and copies are their own
# intrinsics): every run without lane sums streamed from registers (DG_DIRECT_MIN=0) on AVX2,
# only runs of 512+ elements (the default; shorter ones written in place) on AVX-512 with
# derivgen.torch's extras, no tile at all for the runs with lane sums (DG_TILE_BYTES=0: what
# runs longer than the tile get: in place) on SSE2. Each is the x86-64 level whose flags the
# CPU must have to run it (runtime.machine.X86_LEVELS), narrowest first.
ISAS = [
    ("sse2", "x86-64", "", ("-DDG_TILE_BYTES=0",)),
    ("avx2", "x86-64-v3", "-mavx2 -mfma", ("-DDG_DIRECT_MIN=0",)),
    ("avx512", "x86-64-v4", "-mavx512f", ("",)),
]
LEVELS = [name for name, _ in X86_LEVELS] + ["x86-64"]  # best first


def runnable(level: str) -> list[tuple]:
    """The entries of :data:`ISAS` a CPU of this x86-64 level runs ("" off x86-64: none)."""
    if level not in LEVELS:
        return []
    return [entry for entry in ISAS if LEVELS.index(entry[1]) >= LEVELS.index(level)]


def test_runnable_isas_follow_the_level():
    """An AVX2-only CPU checks SSE2 and AVX2, an AVX-512 one all three, a baseline x86-64 SSE2,
    another architecture none."""
    assert [e[0] for e in runnable("x86-64-v4")] == ["sse2", "avx2", "avx512"]
    assert [e[0] for e in runnable("x86-64-v3")] == ["sse2", "avx2"]
    assert [e[0] for e in runnable("x86-64-v2")] == ["sse2"]
    assert [e[0] for e in runnable("x86-64")] == ["sse2"]
    assert runnable("") == []


@pytest.mark.parametrize("isas", [pytest.param("widest"), pytest.param("narrower", marks=pytest.mark.full)])
def test_streaming_and_prefetch_change_no_bits(tmp_path, record_property, isas):
    """Every streamed variant of an ISA this CPU runs (AVX-512, AVX2, SSE2: whichever it has)
    gives the bits of one unstreamed build at the widest of them (every ISA build gives the
    same bits, so one baseline serves them all and asserts that too): the widest ISA's variants
    in the quick tier, the narrower ones' in the full tier (``make test-full``: each is two
    more builds of six layers). The ISAs checked are recorded and printed in the run's summary."""
    runs_on = runnable(machine().level)
    if not runs_on:  # not x86-64: these are x86 intrinsics
        msg = f"not an x86-64 CPU ({machine().cpu}): the streaming paths are x86 intrinsics"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    chosen = runs_on[-1:] if isas == "widest" else runs_on[:-1]
    if not chosen:
        pytest.skip(f"{machine().cpu} runs one ISA variant only, the widest, which the quick tier checks")
    widest = runs_on[-1][2]
    have = [(isa, flags, variants) for isa, _, flags, variants in chosen]
    record_property("checked", f"ISAs {', '.join(isa for isa, _, _ in have)} on {machine().cpu}")
    # derivgen.torch's bfloat16 and channels-last kernels (the extras library) on the two
    # widest ISAs: they share every streaming helper with the float kernels checked on all
    # (where torch is missing they are left out, but never under CI=true)
    have_torch = importlib.util.find_spec("torch") is not None or os.environ.get("CI") == "true"
    runs = [("plain", f"{BASE} {widest} {OFF}", have_torch and widest != "")]
    for isa, isa_flags, variants in have:
        extras = have_torch and isa in ("avx2", "avx512")
        runs += [
            (f"{isa}-streamed{k}", f"{BASE} {isa_flags} {ON} {on}", extras and k == 0) for k, on in enumerate(variants)
        ]
    # the builds are independent subprocesses, most of whose time is the compiler: two at a time
    with ThreadPoolExecutor(2) as pool:
        plain, *results = pool.map(lambda run: _run(tmp_path, *run), runs)
    for (tag, cflags, extras), streamed in zip(runs[1:], results):
        # a run with the extras has every key of the baseline; the others all but the extras'
        assert streamed.keys() <= plain.keys() and len(streamed) > 100, tag
        assert not extras or streamed.keys() == plain.keys(), tag
        differ = [n for n in streamed if not np.array_equal(plain[n], streamed[n], equal_nan=True)]
        assert not differ, (cflags, differ[:10])
    # and the comparison has teeth: the results are real numbers, not zeros
    assert all(np.isfinite(v).all() for v in plain.values())
    assert sum(float(np.abs(v).sum()) for k, v in plain.items() if k.endswith("/dx")) > 1.0
