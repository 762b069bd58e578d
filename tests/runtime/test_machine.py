"""The machine: cache sizes read from /sys (or sysconf), and given to the kernels on load."""

import ctypes

import numpy as np
import pytest

import derivgen
from derivgen.runtime import machine as mach


@pytest.mark.parametrize(
    "text, size",
    [
        ("32K", 32 << 10),
        ("1024K", 1 << 20),
        ("32M", 32 << 20),
        ("65536", 65536),
        ("1G\n", 1 << 30),
        ("", 0),
        ("big", 0),
    ],
)
def test_parse_size(text, size):
    assert mach.parse_size(text) == size


def _cache_dir(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_caches_from_sys_ignore_instruction_caches(tmp_path):
    root = _cache_dir(
        tmp_path, [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"), (3, "Unified", "32768K")]
    )
    caches = mach.read_caches(root)
    assert caches[1] == 48 << 10 and caches[2] == 2 << 20 and caches[3] == 32 << 20
    m = mach.Machine("test cpu", 2, caches)
    assert m.stream_bytes == 8 << 20 and m.tile_bytes == 512 << 10


def test_a_guest_counts_on_at_most_16_mib_of_last_level_cache_per_core(tmp_path):
    # a 2-core VM guest whose /sys shows the host's whole L3: streaming starts at a quarter
    # of 2 x 16 MiB, not at a quarter of 480 MiB
    root = _cache_dir(tmp_path, [(1, "Data", "48K"), (2, "Unified", "2048K"), (3, "Unified", "491520K")])
    m = mach.Machine("guest", 2, mach.read_caches(root))
    assert m.last_level == 480 << 20 and m.usable_last_level == 32 << 20
    assert m.stream_bytes == 8 << 20 and m.as_dict()["usable_last_level"] == 32 << 20


def test_unreadable_sizes_fall_back_to_sysconf_or_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(mach.os, "sysconf_names", {})
    assert mach.read_caches(tmp_path / "missing") == {}
    m = mach.Machine("cpu", 1, {})
    assert m.stream_bytes == 0 and m.tile_bytes == 0  # 0: the kernels keep their defaults
    assert "caches unknown" in m.describe()


def test_this_machine_is_described():
    m = mach.machine()
    assert m.cores >= 1 and m.cpu
    d = m.as_dict()
    assert set(d) >= {"cpu", "cores", "caches", "flags", "stream_bytes", "tile_bytes"}


def test_kernels_are_configured_from_the_machine_on_load(tmp_path, monkeypatch):
    """The library gets <layer>_configure(stream, tile) once it is loaded; the ISA string
    names what the build targets."""
    monkeypatch.setenv("DERIVGEN_CACHE", str(tmp_path / "cache"))
    calls = []
    real_flags = set(mach.machine().flags)
    fake = mach.Machine("cpu", 2, {2: 4 << 20, 3: 64 << 20})
    monkeypatch.setattr(mach, "machine", lambda: fake)
    from derivgen.runtime import cbind

    real = cbind.CKernel._configure

    def spy(self, lib):
        calls.append(self.meta.name)
        real(self, lib)

    monkeypatch.setattr(cbind.CKernel, "_configure", spy)
    monkeypatch.setattr(cbind, "machine", lambda: fake)  # what _configure reads
    mod = derivgen.load("rmsnorm", backend="c")
    # a kernel of its own: the module's may have been loaded (and its calls cached) by an
    # earlier test in this process
    kernel = cbind.CKernel(mod._META, mod._kernel.source)
    monkeypatch.setattr(mod, "_kernel", kernel)
    x = np.random.default_rng(0).normal(size=(8, 64))
    mod.forward(x, np.ones(64))
    mod.forward(x, np.ones(64))
    assert calls == ["rmsnorm"]  # loaded once, configured once
    isa = kernel.isa
    assert isa.split()[-1] in ("sse2", "scalar") or isa == "scalar"
    for f in isa.split():  # -march=native: only what this CPU has
        assert f in real_flags or f == "scalar"


def test_configure_is_ignored_where_the_build_fixed_the_sizes(tmp_path):
    """-DDG_STREAM_BYTES / -DDG_TILE_BYTES win over what the machine says."""
    import subprocess

    from conftest import ROOT, require_tool

    cc = require_tool("gcc")
    root = ROOT / "generated" / "c"
    probe = tmp_path / "probe.c"
    probe.write_text(
        '#include "derivgen-kernels.h"\n'
        "long long probe(long long s, long long t)"
        "{ Dg_configure(s, t); return Dg_stream_bytes * 1000 + Dg_tile_bytes; }\n"
    )
    for defs, expect in (([], 7 * 1000 + 9), (["-DDG_STREAM_BYTES=5", "-DDG_TILE_BYTES=6"], 5 * 1000 + 6)):
        lib = tmp_path / f"p{len(defs)}.so"
        r = subprocess.run(
            [
                cc,
                "-std=c99",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-Wno-unused-function",
                "-shared",
                "-fPIC",
                "-I",
                str(root),
                *defs,
                str(probe),
                "-o",
                str(lib),
            ],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        f = ctypes.CDLL(str(lib)).probe
        f.restype, f.argtypes = ctypes.c_longlong, [ctypes.c_longlong, ctypes.c_longlong]
        assert f(7, 9) == expect
