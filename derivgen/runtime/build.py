"""Compile generated C into shared libraries, cached.

The cache lives in a user cache directory (``$DERIVGEN_CACHE``, else
``$XDG_CACHE_HOME/derivgen``, else ``~/.cache/derivgen``), never in
site-packages or the source tree. Each library is keyed by the sha256 of its
sources, the compiler's identity and the full argument list. Builds are safe
under concurrency: a per-key file lock, a private temporary output, and an
atomic rename. A failing compiler raises :class:`BuildError` carrying its
stderr; a compiler's warnings are shown (a :class:`BuildWarning`, and on
stderr by ``derivgen build``) but do not fail a user's build. The test suite
and CI build with ``-Werror`` (``DERIVGEN_WERROR=1``): every spec they
generate must compile without a warning.

A build that is not in the cache yet (a layer's first use) says so in one line on stderr,
whatever stderr is (a terminal, a notebook, a CI log): what it compiles, about how long
it takes and where the cache is (:func:`announce`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from derivgen.runtime import machine as cpu  # the module: machine() is looked up at each call

REQUIRED_FLAGS = ["-std=c99", "-fPIC", "-shared"]
WARN_FLAGS = ["-Wall", "-Wextra", "-pedantic"]
STRICT_FLAGS = ["-Werror"]  # with DERIVGEN_WERROR=1 (the test suite, CI)
# -ffp-contract=off: every a*b + c rounds twice, as written. Fused multiply-adds made
# the bits depend on which code path the compiler contracted how: a float64 channels-last
# kernel (vectorized across groups) and the NCHW one (vectorized along a run, scalar at
# its end) differed in the last bit, and so did AVX2 and SSE2 builds. Without them every
# layout, ISA build and thread count gives the same bits. Measured side by side (one
# thread): layer norm 8192x1024 fwd+bwd float32 1.085x the time, float64 0.99x, batch and
# group norm 32x64x56x56 1.02-1.04x.
#
# -march=native in DEFAULT_CFLAGS stands for this machine's ISA level: on x86-64 it is
# replaced by the best of x86-64-v4 (AVX-512), -v3 (AVX2 + FMA), -v2 (SSE4.2) and x86-64
# (SSE2) that the CPU runs, read from cpuid (/proc/cpuinfo) when a library is loaded, so
# the library is built for the machine it runs on, and a cache shared between machines
# (the level is in its key) hands each one a build it can run. The levels give the same
# bits (above). A -march=native the user passes in CFLAGS keys the cache by what the
# compiler makes of it on this machine (native_target), so a shared cache stays safe.
# The level also brings GCC's generic tuning: -march=native on the AVX-512 Xeon guest
# (which GCC 12 takes for a Rocket Lake) tunes for 256-bit vectors, and the kernels'
# 512-bit lane sums and copies then met 256-bit stores of the same arrays: measured side
# by side (one thread, layer norm), the native build took 2.5x as long forward and 1.6x
# backward on cached data, 1.4x and 1.2x at 8192x1024 from memory, 2.1x and 1.4x at
# 65536x128. With -march=native in CFLAGS, add -mprefer-vector-width=512 on such CPUs.
DEFAULT_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"]


class BuildWarning(UserWarning):
    """The C compiler warned (the library was built); the message holds its diagnostics."""


def strict() -> bool:
    """Warnings are errors (DERIVGEN_WERROR=1: the test suite and CI)."""
    return os.environ.get("DERIVGEN_WERROR", "").lower() in ("1", "true", "yes")


class BuildError(RuntimeError):
    """The C compiler failed; ``stderr`` holds its diagnostics."""

    def __init__(self, message: str, stderr: str = "", argv: list[str] | None = None) -> None:
        super().__init__(message + (f"\n{stderr.strip()}" if stderr.strip() else ""))
        self.stderr = stderr
        self.argv = argv or []


def cache_dir() -> Path:
    """Where built libraries are cached: $DERIVGEN_CACHE, else $XDG_CACHE_HOME/derivgen, else ~/.cache/derivgen."""
    env = os.environ.get("DERIVGEN_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "derivgen"


def compiler() -> list[str]:
    """The C compiler's command ($CC, else ``cc``), split into words; a BuildError when it is not found."""
    cc = shlex.split(os.environ.get("CC", "") or "cc")
    if shutil.which(cc[0]) is None:
        raise BuildError(f"C compiler {cc[0]!r} not found (set CC, or install gcc: apt-get install -y gcc)")
    return cc


def default_cflags() -> list[str]:
    """:data:`DEFAULT_CFLAGS` with -march=native made this machine's x86-64 level
    (``-march=x86-64-v4`` on an AVX-512 CPU); elsewhere (ARM, ...) native stays."""
    level = cpu.machine().level
    return [f"-march={level}" if f == "-march=native" and level else f for f in DEFAULT_CFLAGS]


def user_cflags() -> list[str]:
    """The optimization flags: $CFLAGS when set (even empty), else :func:`default_cflags`."""
    env = os.environ.get("CFLAGS")
    return shlex.split(env) if env is not None else default_cflags()


def build_target(cflags: list[str] | None = None) -> str:
    """The -march a build with these flags (None: the user's or the defaults) targets:
    "x86-64-v4", "native", ... ("" when it names none): what a library was built for."""
    flags = user_cflags() if cflags is None else cflags
    marches = [f.split("=", 1)[1] for f in flags if f.startswith(("-march=", "-mcpu="))]
    return marches[-1] if marches else ""


@functools.cache
def native_target(cc: tuple[str, ...]) -> str:
    """What ``-march=native`` means to this compiler on this machine (the target flags it
    passes on), for the cache key of a native build; "" when it cannot be asked."""
    try:
        r = subprocess.run(
            [*cc, "-march=native", "-E", "-v", "-x", "c", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    words = r.stderr.split()
    return " ".join(w for w in words if w.startswith(("-march=", "-mtune=", "-m", "--param")))


def march_cflags(march: str, base: list[str] | None = None) -> list[str]:
    """``base`` (the user's CFLAGS, else the defaults) with its -march replaced by ``march``
    ("native" keeps base as it is): builds of one kernel for several instruction sets."""
    base = user_cflags() if base is None else list(base)
    if march == "native":
        return base
    return [f for f in base if not f.startswith(("-march=", "-mtune="))] + [f"-march={march}"]


@functools.cache
def _compiler_id(cc: tuple[str, ...]) -> str:
    """The first line of ``cc --version`` (part of a library's cache key), else the command's name."""
    try:
        r = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60, check=False)
        return r.stdout.splitlines()[0] if r.stdout else cc[0]
    except (OSError, subprocess.SubprocessError):
        return cc[0]


@functools.cache
def openmp_flags(cc: tuple[str, ...]) -> tuple[str, ...]:
    """``-fopenmp`` when the compiler and its runtime support it, else nothing."""
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory(prefix="derivgen-omp-") as tmp:
        c = Path(tmp) / "t.c"
        c.write_text(src)
        try:
            r = subprocess.run(
                [*cc, "-fopenmp", str(c), "-o", str(Path(tmp) / "t")], capture_output=True, timeout=120, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return ()
        return ("-fopenmp",) if r.returncode == 0 else ()


def build_argv(
    sources: list[Path],
    output: Path,
    *,
    openmp: bool = True,
    extra: list[str] | None = None,
    warnings: bool = True,
    cflags: list[str] | None = None,
) -> list[str]:
    """The compiler's argument list; ``cflags`` replaces the user's CFLAGS (or the defaults)."""
    cc = compiler()
    omp = list(openmp_flags(tuple(cc))) if openmp else []
    inc = sorted({f"-I{p.parent}" for p in sources})
    warn = (WARN_FLAGS + (STRICT_FLAGS if strict() else [])) if warnings else []
    flags = user_cflags() if cflags is None else list(cflags)
    return [
        *cc,
        *REQUIRED_FLAGS,
        *warn,
        *flags,
        *omp,
        *(extra or []),
        *inc,
        *[str(s) for s in sources],
        "-o",
        str(output),
        "-lm",
    ]


def build_shared(
    source: Path, *, openmp: bool = True, extra: list[str] | None = None, cflags: list[str] | None = None
) -> Path:
    """Compile ``source`` (and the headers beside it) into a cached shared library;
    ``cflags`` replaces $CFLAGS (e.g. :func:`march_cflags` for another instruction set)."""
    source = Path(source).resolve()
    lib = library_path(source, openmp=openmp, extra=extra, cflags=cflags)
    if lib.is_file():
        return lib
    root = lib.parent
    key = lib.stem[len(source.stem) + 1 :]
    announce(f"{source.name}{_variant(extra, cflags)}", _estimate(source), root)
    return _compile(source, lib, root, key, openmp, extra, cflags)


def announce(what: str, took: str, where: Path) -> None:
    """One line on stderr before a first-use build, whatever stderr is (a terminal, a
    notebook, a CI log; a compile takes seconds, the torch extension a minute or two):
    what it builds, about how long, and the cache it goes to. Nothing when there is no
    stderr (``pythonw``)."""
    err = sys.stderr
    if err is None:
        return
    print(f"derivgen: compiling {what} (first use, about {took}; cached in {where})", file=err, flush=True)


def _variant(extra: list[str] | None, cflags: list[str] | None) -> str:
    """What sets a build apart from a layer's main library, for :func:`announce`."""
    out = ""
    if extra and "-DDG_EXTRAS_ONLY" in extra:
        out += "'s bfloat16 and channels-last kernels"
    if extra and "-DDG_SECOND_ONLY" in extra:
        out += "'s second-order kernels"
    if cflags is not None:
        target = build_target(cflags)
        out += f" for -march={target}" if target else " with the given flags"
    return out


def _estimate(source: Path) -> str:
    """About how long compiling ``source`` takes: measured at -O3 on a 2-core Xeon under
    load, 8 s for layernorm.c (150 kB), 12 s for online_layernorm.c (205 kB), 18 s for
    batchnorm.c (490 kB): some 4 s plus 30 s per MB, rounded to 5 s."""
    try:
        mb = source.stat().st_size / 1e6
    except OSError:
        mb = 0.2
    return f"{max(5, 5 * round((4 + 30 * mb) / 5))} s"


def library_path(
    source: Path, *, openmp: bool = True, extra: list[str] | None = None, cflags: list[str] | None = None
) -> Path:
    """Where :func:`build_shared` keeps (or will put) the library of ``source`` built with
    these flags: the cache key is the sources, the compiler's identity and its arguments."""
    source = Path(source).resolve()
    if not source.is_file():
        raise BuildError(f"C source {source} not found")
    header = source.with_suffix(".h")
    h = hashlib.sha256()
    for f in (source, header, source.with_name("derivgen-kernels.h")):  # what the source includes
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    probe = build_argv([source], Path("OUT"), openmp=openmp, extra=extra, cflags=cflags)
    # the key covers the compiler identity and every argument except the paths
    key_args = [a for a in probe if a not in (str(source), "OUT") and not a.startswith("-I")]
    h.update(_compiler_id(tuple(compiler())).encode())
    h.update("\0".join(key_args).encode())
    if any(a in ("-march=native", "-mcpu=native", "-mtune=native") for a in key_args):
        h.update(native_target(tuple(compiler())).encode())  # native differs by machine
    key = h.hexdigest()[:24]
    return cache_dir() / f"{source.stem}-{key}.so"


def _compile(
    source: Path,
    lib: Path,
    root: Path,
    key: str,
    openmp: bool,
    extra: list[str] | None,
    cflags: list[str] | None,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{source.stem}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if lib.is_file():  # another process built it while we waited
                return lib
            fd, tmp = tempfile.mkstemp(prefix=f".{lib.name}.", suffix=".tmp", dir=root)
            os.close(fd)
            argv = build_argv([source], Path(tmp), openmp=openmp, extra=extra, cflags=cflags)
            try:
                r = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
                if r.returncode != 0:
                    raise BuildError(
                        f"compiling {source.name} failed (exit {r.returncode}): {shlex.join(argv)}", r.stderr, argv
                    )
                if r.stderr.strip():
                    warnings.warn(
                        BuildWarning(f"{source.name}: the C compiler warned:\n{r.stderr.strip()}"), stacklevel=2
                    )
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return lib


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - debugging helper
    """Build each C source named on the command line and print its library's path."""
    for src in argv or sys.argv[1:]:
        print(build_shared(Path(src)))
    return 0
