"""The NumPy backend's executor: chunks of whole normalization groups on a thread pool,
and the small array helpers the generated NumPy modules call (through
:mod:`derivgen.runtime`, which re-exports them).

The generated NumPy modules compute in float64 over chunks of whole
normalization groups (so float32 data with a large mean offset or |x| ~ 1e30
is centred and squared exactly as in double), one chunk at a time per worker
thread: NumPy releases the GIL inside its loops, so chunks run in parallel.
Every chunk writes its own slices of y, dx and the statistics; parameter
gradients are returned per chunk and summed in chunk order, so results are
the same bits for any number of threads.
"""

from __future__ import annotations

import os as _os
import threading as _threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager as _contextmanager
from typing import Any

import numpy as np

from derivgen.runtime.validate import Layout

CHUNK_BYTES = 1 << 20  # float64 bytes of x per chunk: a chunk and its temporaries stay in L2/L3
NUM_THREADS = 0  # 0: OMP_NUM_THREADS if set (as the C kernels), else the CPUs available


def set_num_threads(n: int) -> None:
    """Worker threads of the NumPy backend (0: OMP_NUM_THREADS, else all CPUs available)."""
    global NUM_THREADS
    NUM_THREADS = max(0, int(n))


def num_threads() -> int:
    """The NumPy backend's worker threads (see :func:`set_num_threads`)."""
    if NUM_THREADS:
        return NUM_THREADS
    env = _os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(_os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return _os.cpu_count() or 1


def chunks(layout: Layout, itemsize: int = 8) -> Iterator[tuple[tuple, tuple]]:
    """Index tuples (into the 4-D x view, into the 4-D parameter view) covering
    whole normalization groups, each chunk about CHUNK_BYTES of float64 data."""
    L = layout
    if L.per_sample:
        per = max(1, L.G * L.Cg * L.S * itemsize)
        step = max(1, CHUNK_BYTES // per)
        for o0 in range(0, L.O, step):
            yield (slice(o0, min(L.O, o0 + step)),), (slice(None),)
    else:
        per = max(1, L.O * L.Cg * L.S * itemsize)
        step = max(1, CHUNK_BYTES // per)
        for g0 in range(0, L.G, step):
            s = (slice(None), slice(g0, min(L.G, g0 + step)))
            yield s, s


def _ufunc_bufsize(layout: Layout, default: int) -> int:
    """NumPy copies broadcast operands through its ufunc buffer when a contiguous
    run is shorter than the buffer (8192 elements): rows of 1024 then cost 2-3x
    a plain loop. A buffer no longer than the runs of x that a statistic or a
    parameter is constant along avoids the copies (buffering stays as it was
    for short runs, where it does not matter)."""
    L = layout
    run = L.S if L.S > 1 else (L.Cg if L.per_sample else 0)
    return default if run < 1024 else min(default, run - run % 16)


@_contextmanager
def _numpy_state(bufsize: int, err: dict, errcall: Any) -> Iterator[None]:
    """The caller's floating-point error handling and our ufunc buffer size, for
    this thread only; restored on exit."""
    with np.errstate(call=errcall, **err):
        old = np.getbufsize()
        np.setbufsize(bufsize)
        try:
            yield
        finally:
            np.setbufsize(old)


class _Scratch:
    """float64 copies of the chunks, in buffers one worker reuses chunk after chunk."""

    def __init__(self) -> None:
        self.bufs: list[np.ndarray] = []
        self.k = 0

    def f64(self, a: np.ndarray) -> np.ndarray:
        """``a`` as float64: itself when it already is, else a copy in the next buffer."""
        if a.dtype == np.float64:
            return a
        k, self.k = self.k, self.k + 1
        if k == len(self.bufs):
            self.bufs.append(np.empty(0))
        if self.bufs[k].size < a.size:
            self.bufs[k] = np.empty(a.size)
        out = self.bufs[k][: a.size].reshape(a.shape)
        np.copyto(out, a)
        return out


def for_chunks(layout: Layout, body: Callable[[tuple, tuple, _Scratch], Any]) -> list:
    """Run ``body(s, sp, tmp)`` on every chunk of whole groups (see :func:`chunks`)
    on up to :func:`num_threads` threads; ``tmp.f64(a)`` is ``a`` in float64, in
    a buffer the thread reuses. Returns ``[(s, sp, result), ...]`` in chunk order."""
    todo = list(chunks(layout))
    results = [None] * len(todo)
    state = (_ufunc_bufsize(layout, np.getbufsize()), np.geterr(), np.geterrcall())
    nth = min(num_threads(), len(todo))
    lock = _threading.Lock()
    nxt = iter(range(len(todo)))
    failed = []

    def work() -> None:
        scratch = _Scratch()
        with _numpy_state(*state):
            while not failed:
                with lock:
                    k = next(nxt, None)
                if k is None:
                    return
                s, sp = todo[k]
                scratch.k = 0
                try:
                    results[k] = (s, sp, body(s, sp, scratch))
                except BaseException:
                    failed.append(k)
                    raise

    if nth <= 1:
        work()
        return results
    helpers = [_pool().submit(work) for _ in range(nth - 1)]
    try:
        work()
    finally:
        for h in helpers:
            if not h.cancel():  # a helper that never started has nothing left to do
                h.result()
    return results


_POOL = None
_POOL_LOCK = _threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The shared worker pool, grown when more threads are wanted than it has."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < num_threads() - 1:
            _POOL = ThreadPoolExecutor(max(1, num_threads() - 1), thread_name_prefix="derivgen")
        return _POOL


def _forget_pool() -> None:
    """A forked child has none of the parent's threads: start a new pool there."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, _threading.Lock()


if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_forget_pool)


def group_mean(layout: Layout) -> Callable[[np.ndarray], np.ndarray]:
    """``_mean``: the mean over each normalization group of a chunk (np.mean's
    sum and division, without its per-call overhead)."""
    axes = layout.reduce_axes

    def mean(a: np.ndarray) -> np.ndarray:
        m = np.add.reduce(a, axis=axes, keepdims=True)
        np.true_divide(m, a.size // m.size, out=m)
        return m

    return mean


def group_max(layout: Layout) -> Callable[[np.ndarray], np.ndarray]:
    """``_max``: the maximum over each normalization group of a chunk (a NaN propagates)."""
    axes = layout.reduce_axes
    return lambda a: np.maximum.reduce(np.asarray(a), axis=axes, keepdims=True)


def group_min(layout: Layout) -> Callable[[np.ndarray], np.ndarray]:
    """``_min``: the minimum over each normalization group of a chunk (a NaN propagates)."""
    axes = layout.reduce_axes
    return lambda a: np.minimum.reduce(np.asarray(a), axis=axes, keepdims=True)


def sum_prod(a: np.ndarray, b: np.ndarray, axes: int | tuple[int, ...] | None) -> np.ndarray:
    """``sum(a*b)`` over ``axes`` (all axes for None) of the 4-D chunk arrays,
    keeping dimensions: one pass and no temporary (``np.einsum``) when a and b
    have the same shape, else the plain product and sum."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 4:
        return np.add.reduce(a * b, axis=axes, keepdims=True)
    if axes is not None:
        axes = tuple(int(i) % 4 for i in np.atleast_1d(axes))
    keep = [i for i in range(4) if axes is not None and i not in axes]
    out = np.einsum("abcd,abcd->" + "".join("abcd"[i] for i in keep), a, b)
    return np.reshape(out, [a.shape[i] if i in keep else 1 for i in range(4)])


def group_mean_prod(layout: Layout) -> Callable[..., np.ndarray]:
    """``_mean_prod(a, b)``: the group mean of a*b; ``_mean_sq(a)``, the same
    function with one argument: of a*a. Without the temporary product (see
    :func:`sum_prod`)."""
    axes = layout.reduce_axes

    def mean_prod(a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        b = a if b is None else b
        m = sum_prod(a, b, axes)
        n = int(np.prod(np.broadcast_shapes(np.shape(a), np.shape(b)))) // m.size
        return np.true_divide(m, n, out=m)

    return mean_prod


def group_total(value: np.ndarray | float, like: np.ndarray) -> float:
    """The sum over the groups of a chunk of a per-group value (``like`` is a per-group
    array of the chunk: a constant value counts once per group)."""
    return float(np.sum(np.broadcast_to(value, np.shape(like))))


def new_stats(layout: Layout, names: Iterable[str]) -> dict[str, np.ndarray]:
    """Uninitialized float64 per-group statistics, 4-D."""
    return {n: np.empty(layout.stat4, dtype=np.float64) for n in names}


def f64(a: Any) -> np.ndarray:
    """``a`` as a float64 array."""
    return np.asarray(a, dtype=np.float64)


def store(out: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Write ``value`` into ``out`` element by element (flat order); returns ``out``."""
    out.reshape(-1)[...] = value.reshape(-1)
    return out
