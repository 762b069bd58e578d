"""The timing every bench shares: glibc malloc tuned for large blocks, callables timed side by
side in rounds (:func:`round_robin`), and a STREAM-like probe of the memory bandwidth
(:class:`Bandwidth`, ``bandwidth.c``) that the bounds are computed from."""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from derivgen.runtime.build import build_shared


def tune_malloc() -> bool:
    """Keep large blocks on the heap and untrimmed (glibc only)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


BATCH = 3  # timed calls in a row per implementation and round


def round_robin(fns: dict[object, Callable[[], object]], repeat: int, warmup: int = 1) -> dict[object, float]:
    """Median ms of ``repeat`` timed calls of each callable, taken in rounds: in
    every round each callable runs ``warmup`` untimed calls and then up to BATCH
    timed calls in a row. Back-to-back calls keep the cores busy (an idle vCPU
    wakes up slowly), while the rounds spread every implementation over the
    same stretch of time: the shared machine's speed drifts by tens of percent
    over seconds, and only ratios of medians taken side by side are stable."""
    ts: dict = {k: [] for k in fns}
    while any(len(v) < repeat for v in ts.values()):
        for k, fn in fns.items():
            for _ in range(warmup):
                fn()
            for _ in range(min(BATCH, repeat - len(ts[k]))):
                t0 = time.perf_counter()
                fn()
                ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


class Bandwidth:
    """STREAM-like copy probe over two 256 MiB arrays (far larger than the caches)."""

    def __init__(self, threads: int, mib: int = 256) -> None:
        self.threads, self.mib = threads, mib
        self.lib = ctypes.CDLL(str(build_shared(Path(__file__).with_name("bandwidth.c"))))
        self.n = n = mib * 2**20 // 4
        self.arrays = (np.ones(n, np.float32), np.zeros(n, np.float32))
        pa, pb = (ctypes.c_void_p(v.ctypes.data) for v in self.arrays)
        N, T = ctypes.c_int64(n), ctypes.c_int(threads)
        self.copy = lambda: self.lib.dg_copy(pa, pb, N, T)
        self.stream_copy = lambda: self.lib.dg_copy_stream(pa, pb, N, T)

    def rate(self, ms: float) -> float:
        """GB/s (bytes read + bytes written) of one copy taking ``ms``."""
        return 2 * self.n * 4 / ms / 1e6

    def rates(self, ms: dict[str, float]) -> dict[str, float]:
        """GB/s (bytes read + bytes written) from the median ms of copy and stream_copy."""
        return {f"{k}_GBps": self.rate(ms[k]) for k in ("copy", "stream_copy")} | {"MiB": self.mib}
