import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from derivgen.runtime.build import cache_dir

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# The tests live in one folder per stage (tests/spec, tests/derive, ...); the helpers they share
# (this module, oracle, torch_cases, specfuzz, the *_driver.py scripts, c/, regressions/) stay here,
# importable by plain name from every folder.
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# tests/triton run the generated Triton kernels on CPU tensors under Triton's interpreter; Triton
# reads this when it is first imported (torch.compile's tests may import it first), so it is set
# before any test runs
os.environ.setdefault("TRITON_INTERPRET", "1")

# every kernel the tests build must compile without a single warning (users' builds only show them)
os.environ["DERIVGEN_WERROR"] = "1"

# two test workers on two cores, each calling kernels whose OpenMP teams have two threads: a
# thread that waits at a barrier spins (libgomp's default) on the core the other worker
# needs. Passive waiting yields it: a tiny layer norm forward + backward took 3.2 ms a call
# spinning and 0.41 ms passive on the loaded 2-core Intel Xeon guest (the kernels' results do
# not depend on it). Set before any test loads libgomp (torch's or the kernels')
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def require_tool(name: str) -> str:
    """Path of an executable; skip locally when missing, fail under CI=true."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed"
        if IN_CI:
            pytest.fail(msg + " (required under CI=true)")
        pytest.skip(msg)
    return path


def require_module(name: str):
    try:
        return __import__(name)
    except ImportError:
        if IN_CI:
            pytest.fail(f"python module {name} is not installed (required under CI=true)")
        pytest.skip(f"{name} not installed")


# the flags of the tests that check values, not speed: the test session's default CFLAGS
# (set below). Compiling is most of the suite's time, and the C of a layer with its double
# backward and JVP kernels compiles about 3x faster at -O0 than at -O1, and 3x faster at -O1
# than at the default -O3 (a 7,000-line regression spec on the Intel Xeon guest, loaded: 9.2,
# 29 and 86 s). Without -ffast-math every optimization level rounds the same operations the
# same way (-ffp-contract=off: no fused multiply-adds), so the values these tests check are
# the -O3 build's; -Werror still fails any warning. The tests of what optimization changes
# build with their own flags: the bits of every x86-64 level at -O3 (tests/runtime/test_build.py),
# the streaming paths at -O2 (test_streaming.py), strict C99 at -O2 (test_build.py), the kernel
# helpers' lane orders (test_kernel_helpers.py), the catalogue against PyTorch at the default
# flags (test_backends_vs_torch.py), the sanitizers (test_sanitizers.py)
QUICK_CFLAGS = "-O0 -march=native -fno-math-errno -ffp-contract=off"
os.environ.setdefault("CFLAGS", QUICK_CFLAGS)


# `make test` is the quick tier: it deselects the tests marked `full` (-m "not full"), the
# members of a corpus beyond its sample; `make test-full` (or plain pytest) runs them all
def corpus(items, quick, ids=None, unpack=False) -> list:
    """Parameters for ``pytest.mark.parametrize`` over a corpus: the members in ``quick``
    as they are, every other one marked ``full`` (``make test-full`` runs it, ``make test``
    does not); ``ids(item)`` names a member; ``unpack``: each member is a tuple of the
    values of several argument names."""
    quick = set(quick)
    missing = quick - set(items)
    assert not missing, f"the quick sample names members the corpus lacks: {sorted(missing)}"
    return [
        pytest.param(
            *(it if unpack else (it,)),
            id=None if ids is None else ids(it),
            marks=() if it in quick else pytest.mark.full,
        )
        for it in items
    ]


def fuzz_corpus(seeds) -> list:
    """:func:`corpus` of spec fuzzer seeds; the sample: the seeds that together have every
    feature of them all (``specfuzz.covering``)."""
    import specfuzz

    seeds = list(seeds)
    return corpus(seeds, specfuzz.covering(seeds))


def spec_file_corpus(paths) -> list:
    """:func:`corpus` of spec files, named by their stems; the sample: the files that together
    have every feature of them all (``specfuzz.covering`` by ``specfuzz.text_features``)."""
    import specfuzz

    quick = specfuzz.covering(paths, key=lambda p: specfuzz.text_features(p.read_text(), p.name))
    return corpus(paths, quick, ids=lambda p: p.stem)


def sample_and_rest(items, quick) -> list:
    """The parameters of a test that runs a corpus as one list: the sample (id "sample") and
    the other members (id "rest", marked ``full``)."""
    rest = [it for it in items if it not in quick]
    return [pytest.param(list(quick), id="sample"), pytest.param(rest, id="rest", marks=pytest.mark.full)]


def grid(*axes, names=None) -> list:
    """The product of three or more ``axes`` as a corpus (tuples, for ``parametrize`` over
    as many argument names) whose quick sample has every pair of values of any two axes: the
    last axis's index is the sum of the others' modulo its length (every other axis at least
    as long). ``names`` maps an axis's value to its part of the test id (``str`` by default)."""
    import itertools

    last = len(axes[-1])
    assert len(axes) >= 3 and all(len(a) >= last for a in axes[:-1]), "a pairwise sample needs these"
    names = names or [str] * len(axes)
    items, quick = [], []
    for idx in itertools.product(*(range(len(a)) for a in axes)):
        item = tuple(a[i] for a, i in zip(axes, idx))
        items.append(item)
        if idx[-1] == sum(idx[:-1]) % last:
            quick.append(item)
    return corpus(items, quick, ids=lambda item: "-".join(f(v) for f, v in zip(names, item)), unpack=True)


# the one line a build not yet in the cache prints on stderr (derivgen.runtime.build.announce)
FIRST_USE = re.compile(r"^derivgen: compiling .* \(first use, about [^;]*; cached in .*\)$")


# the suite's build cache, as the tests found it ($DERIVGEN_CACHE, else ~/.cache/derivgen)
SUITE_CACHE = cache_dir()


def private_cache(tmp_path) -> str:
    """A build cache of a test's own under ``tmp_path`` (its kernels built with its CFLAGS),
    whose ``torch_ext`` and ``modules`` folders are the suite's: derivgen.torch's C++ extension
    does not depend on CFLAGS and takes half a minute to build, so every private cache shares
    one build (its own lock file serializes the first); the generated sources and their index
    (api.materialize) do not depend on them either, so a layer derived once in the suite is
    not derived again in a driver's subprocess."""
    cache = Path(tmp_path) / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    for folder in ("torch_ext", "modules"):
        shared = SUITE_CACHE / folder
        shared.mkdir(parents=True, exist_ok=True)
        link = cache / folder
        if not link.exists():
            try:
                link.symlink_to(shared, target_is_directory=True)
            except FileExistsError:  # another thread's driver of the same test made it first
                pass
    return str(cache)


def run_driver(script: str, tmp_path, cflags: str, *args, env=None, timeout: int = 900):
    """Run ``tests/<script>`` in a subprocess whose C kernels are built with
    ``cflags`` into a cache of its own under ``tmp_path`` (:func:`private_cache`)."""
    full = dict(os.environ, CFLAGS=cflags, DERIVGEN_CACHE=private_cache(tmp_path), PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / script), *map(str, args)],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


# torch.nn.LocalResponseNorm along a trailing layout's features: the window(e, k) spec the
# window tests of every target share (the zoo's lrn runs along a position's channels)
LRN_FEATURES = """
name = "lrn_features"
title = "Local response normalization over the features"
summary = "x of shape (..., d)"

[layout]
kind = "trailing"

[options]
size = { default = 5, min = 1, integer = true }
alpha = { default = 1e-4, min = 0 }
beta = { default = 0.75, min = 0 }
k = { default = 1, min = 0 }

[output]
y = "x/(k + alpha*window(x**2, size)/size)**beta"
"""


def block_layer(spec) -> bool:
    """Does the layer have block statistics (mean(e, kind))? The Triton target refuses those
    layers with a NotImplementedError that says so."""
    return any(m.blocks for m in spec.modes)


def assert_refuses_blocks(spec, backend: str) -> None:
    """``derivgen.load(spec, backend)`` refuses a layer with block statistics, saying why."""
    import pytest

    import derivgen

    with pytest.raises(NotImplementedError, match="block statistics"):
        derivgen.load(spec, backend=backend)


# Linux with transparent huge pages: where derivgen's fresh large outputs take the advice
HAS_THP = sys.platform.startswith("linux") and Path("/sys/kernel/mm/transparent_hugepage").is_dir()


def huge_page_advised(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised to take transparent huge pages
    (the ``hg`` flag of its /proc/self/smaps entry)."""
    vma = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            vma = lo <= address < hi
        elif vma and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def pytest_terminal_summary(terminalreporter):
    """What a test says it checked where that depends on the machine (``record_property("checked",
    ...)``: the ISAs this CPU runs), printed under the run so a green run names what it covered."""
    lines = [
        f"{r.nodeid}: {value}"
        for r in terminalreporter.stats.get("passed", [])
        for key, value in getattr(r, "user_properties", ())
        if key == "checked" and r.when == "call"
    ]
    if lines:
        terminalreporter.section("checked on this machine")
        for line in lines:
            terminalreporter.write_line(line)


def require_torch_extension():
    """derivgen.torch's C++ extension module; skip locally where it cannot be built, fail under
    CI=true or where a C++ compiler and ninja are installed."""
    from derivgen.torch import ext

    mod = ext.module()
    if mod is None:
        why = "derivgen.torch's C++ extension is turned off (DERIVGEN_TORCH_EXT=0) or could not be built"
        if IN_CI or (ext.enabled() and shutil.which("c++") and shutil.which("ninja")):
            pytest.fail(why + " (required under CI=true, and where a C++ compiler and ninja are installed)")
        pytest.skip(why)
    return mod
