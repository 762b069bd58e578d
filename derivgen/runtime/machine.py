"""What the machine is: CPU model, instruction-set flags, core count, cache sizes.

The C kernels take two sizes from here when a layer's library is loaded
(``<layer>_configure``): outputs of at least a quarter of the last-level cache
(of at most 16 MiB of it per core: :attr:`Machine.usable_last_level`) are written with streaming stores (a backward pass touches three arrays of
that size, which then no longer fit beside each other), and a streaming tile
holds at most a quarter of L2 (it stays there beside the runs it follows).
``derivgen bench`` prints all of it in its header.

Cache sizes come from ``/sys/devices/system/cpu/cpu0/cache`` (what this CPU
sees: on a virtual machine sysconf's L3 can be the whole socket's, ten times
more), then ``os.sysconf``; a size that cannot be read is 0 and the kernels
keep their built-in defaults.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

_SYS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
_SYSCONF = {1: "SC_LEVEL1_DCACHE_SIZE", 2: "SC_LEVEL2_CACHE_SIZE", 3: "SC_LEVEL3_CACHE_SIZE"}
# the most last-level cache per core the streaming threshold counts on: more than any
# x86 part has per core (12 MiB on Zen 4 X3D), far less than a VM's view of a whole
# host's cache. On the 2-core Xeon guest that reads 480 MiB, the old quarter of it (120
# MiB) left 32 MiB outputs unstreamed: measured with cold caches (as `derivgen bench`
# runs), layer norm 8192x1024 took 1.4x as long forward and backward as streamed.
LLC_PER_CORE = 16 << 20
# the x86-64 micro-architecture levels (the psABI's, GCC's and Clang's -march names), best
# first, with the /proc/cpuinfo flags each needs beyond the levels below it
X86_LEVELS = (
    ("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    ("x86-64-v3", ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")),
    ("x86-64-v2", ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3")),
)
# the flags that decide which kernels a -march=native build gets
ISA_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "avx", "sse4_2", "sse2", "asimd", "sve")


@dataclass(frozen=True)
class Machine:
    """This CPU: model name, core count, cache sizes by level (bytes) and the ISA flags it has."""

    cpu: str
    cores: int
    caches: dict = field(default_factory=dict)  # level -> bytes (data or unified caches)
    flags: tuple = ()  # ISA_FLAGS this CPU has
    level: str = ""  # the best x86-64 level it runs ("x86-64-v4" ... "x86-64"); "" off x86-64

    @property
    def last_level(self) -> int:
        """The size of the last-level cache in bytes (0: unknown)."""
        return self.caches[max(self.caches)] if self.caches else 0

    @property
    def usable_last_level(self) -> int:
        """The last-level cache this process can count on: its size, at most
        :data:`LLC_PER_CORE` per core (0: unknown). A virtual machine's /sys shows the
        host's whole cache (480 MiB on a 2-core Xeon guest), most of it other guests'."""
        return min(self.last_level, LLC_PER_CORE * max(self.cores, 1))

    @property
    def stream_bytes(self) -> int:
        """Outputs at least this large are streamed (0: the kernels' default)."""
        return self.usable_last_level // 4

    @property
    def tile_bytes(self) -> int:
        """A streaming tile holds at most this much (0: the kernels' default)."""
        return self.caches.get(2, 0) // 4

    def describe(self) -> str:
        """One line for a report: model; cores; cache sizes; ISA flags."""
        sizes = ", ".join(f"L{k} {_size(v)}" for k, v in sorted(self.caches.items())) or "caches unknown"
        level = f" ({self.level})" if self.level else ""
        return f"{self.cpu}; {self.cores} cores; {sizes}; {' '.join(self.flags) or 'no SIMD flags read'}{level}"

    def as_dict(self) -> dict:
        """The record as plain JSON-ready data, with the two sizes the kernels are told."""
        return {
            "cpu": self.cpu,
            "cores": self.cores,
            "caches": {f"L{k}": v for k, v in sorted(self.caches.items())},
            "flags": list(self.flags),
            "level": self.level,
            "usable_last_level": self.usable_last_level,
            "stream_bytes": self.stream_bytes,
            "tile_bytes": self.tile_bytes,
        }


def _size(n: int) -> str:
    """A byte count for people: whole MiB or KiB where exact, else bytes."""
    for unit, k in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """'32K' / '1024K' / '32M' / '65536' -> bytes (0 when unreadable)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in "KMG" else t
    return int(digits) * mult if digits.isdigit() else 0


def read_caches(root: Path = _SYS_CACHE) -> dict[int, int]:
    """Level -> size in bytes of the data/unified caches this CPU sees."""
    out: dict[int, int] = {}
    try:
        for d in sorted(root.glob("index*")):
            try:
                kind = (d / "type").read_text().strip()
                level = int((d / "level").read_text())
                size = parse_size((d / "size").read_text())
            except (OSError, ValueError):
                continue
            if kind in ("Data", "Unified") and size > 0:
                out[level] = max(out.get(level, 0), size)
    except OSError:
        pass
    for level, name in _SYSCONF.items():
        if level not in out and name in os.sysconf_names:
            try:
                v = os.sysconf(name)
            except (OSError, ValueError):
                v = 0
            if v and v > 0:
                out[level] = v
    return out


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), flags


def x86_level(flags: set[str] | frozenset[str], arch: str | None = None) -> str:
    """The best x86-64 level (:data:`X86_LEVELS`) a CPU with these /proc/cpuinfo flags runs:
    "x86-64-v4" ... "x86-64"; "" when ``arch`` (default: this machine's) is not x86-64."""
    arch = (arch if arch is not None else platform.machine()).lower()
    if arch not in ("x86_64", "amd64"):
        return ""
    have = set(flags)
    for i, (name, _) in enumerate(X86_LEVELS):
        if all(f in have for _, need in X86_LEVELS[i:] for f in need):
            return name
    return "x86-64"


@functools.lru_cache(maxsize=1)
def machine() -> Machine:
    """This machine, read once per process."""
    cpu, flags = _cpuinfo()
    return Machine(
        cpu=cpu,
        cores=os.cpu_count() or 1,
        caches=read_caches(),
        flags=tuple(f for f in ISA_FLAGS if f in flags),
        level=x86_level(flags),
    )
