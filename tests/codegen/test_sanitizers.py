"""C safety: the kernels under AddressSanitizer + UBSan, and valgrind memcheck.

Both run in subprocesses, so a fault is a failed test, not a dead test run."""

import os
import subprocess

import pytest
from conftest import ROOT, require_tool, run_driver

# -O0: every load and store as written is instrumented, and the sanitized compiles, most of
# these tests' time, take a quarter as long as at -O1 (batch norm's file with its extras: 5 s
# against 20 s on the Intel Xeon guest); the shapes are small, so the slower kernels cost
# little. -g1: line tables for the sanitizers' reports, a third less compile time than -g
SAN = "-O0 -g1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all"


def _sanitized(tmp_path, *args, extra: str = ""):
    gcc = require_tool("gcc")
    libasan = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.fail("gcc has no libasan.so (install libasan8 / gcc)")
    env = {
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }
    return run_driver("sanitize_driver.py", tmp_path, f"{SAN} {extra}", *args, env=env)


def test_the_sanitizer_catches_an_out_of_bounds_read(tmp_path):
    r = _sanitized(tmp_path, "--out-of-bounds")
    assert r.returncode != 0 and "no fault detected" not in r.stdout
    assert "AddressSanitizer" in r.stderr


# the plain paths (and layers with block statistics, whose passes stream nothing), and the
# streaming-store tiles and prefetch forced on for every size
@pytest.mark.parametrize(
    "extra,args",
    [("", ("--blocks",)), ("-march=native -DDG_STREAM_BYTES=0 -DDG_AHEAD_BYTES=64", ())],
    ids=["plain", "streamed"],
)
def test_kernels_under_asan_and_ubsan(tmp_path, extra, args):
    r = _sanitized(tmp_path, *args, extra=extra)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-6000:])
    assert "ERROR: AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, r.stderr[-6000:]
    assert "ran " in r.stdout
    # the sanitized libraries really were built with the sanitizer flags
    libs = list((tmp_path / "cache").glob("*.so"))
    assert libs and all(b"__asan" in p.read_bytes() for p in libs)


def test_valgrind_memcheck_is_clean(tmp_path):
    gcc = require_tool("gcc")
    valgrind = require_tool("valgrind")
    gen = ROOT / "generated" / "c"
    exe = tmp_path / "memcheck"
    srcs = [ROOT / "tests" / "c" / "memcheck.c", gen / "layernorm.c", gen / "batchnorm.c", gen / "online_layernorm.c"]
    r = subprocess.run(
        [
            gcc,
            "-std=c99",
            "-Wall",
            "-Wextra",
            "-pedantic",
            "-Werror",
            "-O1",
            "-g",
            f"-I{gen}",
            *map(str, srcs),
            "-o",
            str(exe),
            "-lm",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [valgrind, "--error-exitcode=3", "--leak-check=full", "--errors-for-leak-kinds=all", str(exe)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "memcheck driver: ok" in r.stdout
    assert "ERROR SUMMARY: 0 errors" in r.stderr
